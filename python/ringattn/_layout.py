"""Which tokens of a sequence each rank of a ring holds, in plain torch: the layouts of
parallel/sequence_layout.cpp, chunk for chunk.

    contiguous  rank r of N holds tokens [r S/N, (r+1) S/N)                    (S % N == 0)
    zigzag      2N chunks of c = S/(2N) tokens; rank r holds chunk r, then     (S % 2N == 0)
                chunk 2N-1-r (equal causal work on every rank)

A rank's local rows are its chunks one after the other.
"""
import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout, where):
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout is {layout!r}; expected 'zigzag' or 'contiguous'")


def _chunks(seq_len, rank, size, layout, where):
    """(global_start, length) of this rank's chunks in local order; ValueError naming S, N and
    what S must be a multiple of, or the rank out of range (SequenceLayout's checks)."""
    check_layout(layout, where)
    if size < 1:
        raise ValueError(f"{where}: size N = {size}; expected >= 1 ranks")
    if not 0 <= rank < size:
        raise ValueError(f"{where}: rank {rank} is out of range for N = {size} ranks "
                         f"(0 to {size - 1})")
    if seq_len < 1:
        raise ValueError(f"{where}: sequence length S = {seq_len}; expected >= 1 tokens")
    if layout == "contiguous":
        if seq_len % size:
            raise ValueError(f"{where}: contiguous layout: sequence length S = {seq_len} is not "
                             f"a multiple of N = {size} ranks (each holds S/N tokens)")
        length = seq_len // size
        return [(rank * length, length)]
    if seq_len % (2 * size):
        raise ValueError(f"{where}: zigzag layout: sequence length S = {seq_len} is not a "
                         f"multiple of 2N = {2 * size} (N = {size} ranks, each holding 2 of 2N "
                         "equal chunks)")
    c = seq_len // (2 * size)
    return [(rank * c, c), ((2 * size - 1 - rank) * c, c)]


def positions(seq_len, rank, size, layout, *, device=None):
    """The global positions of the tokens of rank `rank`'s shard, in local order: an int64
    tensor [seq_len // size] (for RoPE by global position, or a mask)."""
    chunks = _chunks(seq_len, rank, size, layout, "ringattn.positions")
    return torch.cat([torch.arange(start, start + length, device=device)
                      for start, length in chunks])


def shard(x, rank, size, layout, dim=1):
    """Rank `rank`'s tokens of the whole sequence `x` (its length x.shape[dim]): a view of x
    (contiguous layout) or a new tensor of its two chunks (zigzag). Differentiable. dim=1 for
    [batch, seq, heads, head_dim], dim=-1 (or 2) for LSE [batch, heads, seq]."""
    chunks = _chunks(x.shape[dim], rank, size, layout, "ringattn.shard")
    pieces = [x.narrow(dim, start, length) for start, length in chunks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard(shards_or_gathered, size, layout, dim=1):
    """The whole sequence from every rank's shard: a list of the N shards in rank order (as
    mpi4py's allgather returns them), or one tensor of the N shards concatenated along dim in
    rank order. Differentiable; the inverse of shard()."""
    where = "ringattn.unshard"
    check_layout(layout, where)
    if isinstance(shards_or_gathered, torch.Tensor):
        gathered = shards_or_gathered
        tokens = gathered.shape[dim]
        if size < 1 or tokens < 1 or tokens % size:
            raise ValueError(f"{where}: the gathered tensor has {tokens} tokens on axis {dim}; "
                             f"expected a positive multiple of N = {size} ranks")
        shards = torch.split(gathered, tokens // size, dim)
    else:
        shards = list(shards_or_gathered)
        if len(shards) != size:
            raise ValueError(f"{where}: {len(shards)} shards for N = {size} ranks; expected one "
                             "per rank, in rank order")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"{where}: the shards have shapes {sorted(shapes)}; every rank holds "
                         "the same number of tokens")
    seq_len = shards[0].shape[dim] * size
    pieces = []
    for rank, local in enumerate(shards):
        local_start = 0
        for start, length in _chunks(seq_len, rank, size, layout, where):
            pieces.append((start, local.narrow(dim, local_start, length)))
            local_start += length
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim)
