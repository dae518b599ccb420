"""Which tokens of a sequence each rank of a ring holds: the library's layouts, read through
ringattn_layout_chunks, so that the package shards exactly as the ring lays out its calls.

    contiguous  rank r of N holds tokens [r S/N, (r+1) S/N)                    (S % N == 0)
    zigzag      2N chunks of S/(2N) tokens; rank r holds chunk r, then     (S % 2N == 0)
                chunk 2N-1-r (equal causal work on every rank)
    balanced    chunks that even out each rank's visible work under the    (S % 2N == 0)
                ring calls' mask (causal, window, documents): the layout
                follows the mask, so these functions take it too

A rank's local rows are its chunks one after the other.
"""
import operator

import torch

from ringattn import _capi
from ringattn._ops import check_document_tensor, documents_for_c, window_pair

LAYOUTS = tuple(_capi.LAYOUT_CODES)


def check_layout(layout, where):
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout is {layout!r}; expected 'zigzag', 'contiguous' or "
                         "'balanced'")


def _int32(value, name, where):
    """value as an int that the C API's int32 field holds (ctypes would wrap a larger one)."""
    value = operator.index(value)
    if not -2**31 <= value < 2**31:
        raise ValueError(f"{where}: {name} is {value}; expected a 32-bit int")
    return value


def _host_documents(document_starts, where):
    """The starts as ringattn_layout_chunks reads them, an int64 CPU tensor [count] (one list) or
    [batch, count] (one a batch row), or None; and the batch of the lists."""
    if document_starts is None:
        return None, 1
    check_document_tensor(document_starts, where)
    if document_starts.dim() not in (1, 2):
        raise ValueError(f"{where}: document_starts has shape {list(document_starts.shape)}; "
                         "expected [count] or [batch, count]")
    starts = documents_for_c(document_starts).cpu().contiguous()
    return starts, starts.shape[0] if starts.dim() == 2 else 1


def _chunks(seq_len, rank, size, layout, where, causal, window, document_starts):
    """(global_start, length) of this rank's chunks in local order, from the library. The
    balanced layout needs the ring calls' mask (causal given, True or False); the others ignore
    it. The library's refusals (S not a multiple of N or 2N, a rank out of range, a bad mask)
    raise RingattnError with its message."""
    check_layout(layout, where)
    if layout == "balanced" and causal is None:
        raise ValueError(f"{where}: the balanced layout follows the mask of the ring's calls: "
                         "pass their causal (True or False), and their window and "
                         "document_starts if they have any")
    window_left, window_right = window_pair(window, where)
    starts, batch = _host_documents(document_starts, where)
    params = _capi.LayoutParams(
        layout=_capi.LAYOUT_CODES[layout], size=_int32(size, "size", where),
        rank=_int32(rank, "rank", where), causal=int(bool(causal)),
        seq_len=operator.index(seq_len), batch=batch,
        **_capi.mask_fields(window_left, window_right, starts))
    return _capi.library().layout_chunks(params)


def positions(seq_len, rank, size, layout, *, causal=None, window=None, document_starts=None,
              device=None):
    """The global positions of the tokens of rank `rank`'s shard, in local order: an int64
    tensor [seq_len // size] (for RoPE by global position, or a mask). For the balanced layout,
    causal, window and document_starts are those of the ring calls (document_starts: the whole
    sequence's, [count] or [batch, count], on any device)."""
    chunks = _chunks(seq_len, rank, size, layout, "ringattn.positions", causal, window,
                     document_starts)
    return torch.cat([torch.arange(start, start + length, device=device)
                      for start, length in chunks])


def shard(x, rank, size, layout, dim=1, *, causal=None, window=None, document_starts=None):
    """Rank `rank`'s tokens of the whole sequence `x` (its length x.shape[dim]): a view of x when
    the rank holds one chunk (contiguous), else a new tensor of its chunks. Differentiable.
    dim=1 for [batch, seq, heads, head_dim], dim=-1 (or 2) for LSE [batch, heads, seq]. The mask
    as in positions()."""
    chunks = _chunks(x.shape[dim], rank, size, layout, "ringattn.shard", causal, window,
                     document_starts)
    pieces = [x.narrow(dim, start, length) for start, length in chunks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard(shards_or_gathered, size, layout, dim=1, *, causal=None, window=None,
            document_starts=None):
    """The whole sequence from every rank's shard: a list of the N shards in rank order (as
    mpi4py's allgather returns them), or one tensor of the N shards concatenated along dim in
    rank order. Differentiable; the inverse of shard() under the same layout and mask."""
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
        for start, length in _chunks(seq_len, rank, size, layout, where, causal, window,
                                     document_starts):
            pieces.append((start, local.narrow(dim, local_start, length)))
            local_start += length
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim)
