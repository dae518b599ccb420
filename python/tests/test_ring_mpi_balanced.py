"""ringattn.RingAttention(comm, layout="balanced") across real MPI ranks, and the balanced layout
of ringattn.positions/shard/unshard. Run like test_ring_mpi.py (python/tests/run_mpi_tests.sh
runs it at 1, 2, 3 and 4 ranks; plain pytest: a ring of one).

The balanced layout follows the mask of the ring's calls, so every rank shards with the calls'
causal, window and document_starts (ring.shard(..., causal=, window=, document_starts=)), runs
the ring forward and backward (a loss over O and LSE), gathers and unshards the results with the
same mask, and compares them with ringattn.attention on the whole sequence in one process under
the same documents, and with the fp64 oracle of reference.py:
  f64: relative error under 1e-12 against both;
  f32 (S = 384): under 1e-5 against the oracle, and at most 1.2x the one-process op's error (the
       LSE with sqrt(N - 1) u / 4 on top), the bound of tests/parallel/mpi_ring_balanced.cpp.
positions() is checked against the ring's own layout, read from its output (q = k = 0, v = the
key's global position: under a causal mask with documents the row at position p has
LSE = log(p - d + 1) and O = (d + p) / 2, d its document's start), and shard/unshard round-trip
for 1 to 5 ranks. One verdict on every rank.
"""
import math

import pytest
import torch

MPI = pytest.importorskip("mpi4py.MPI", reason="ring attention from Python needs mpi4py")

import ringattn  # noqa: E402
from reference import attention as reference  # noqa: E402
from reference import relative_error  # noqa: E402
from test_ring_mpi import (COMM, NAMES, RANK, SIZE, TOL, UNIT_ROUNDOFF_F32, agree,  # noqa: E402
                           compare, gen)  # noqa: F401

S = 384  # a multiple of 2N for N = 1 to 4
SHAPES = {torch.float64: (2, S, 4, 2, 16), torch.float32: (2, S, 4, 2, 32)}
ERROR_FACTOR = 1.2


def starts(*lists):
    return torch.tensor(lists[0] if len(lists) == 1 else lists, dtype=torch.int64)


# (name, the calls' mask). Each gives the balanced layout a shape of its own on 2 to 4 ranks
# (neither zigzag's chunks nor the contiguous split), but for the causal window on 2 ranks (the
# contiguous split, already even) and the causal mask alone (zigzag's chunks).
MASKS = [
    ("causal per-batch documents",
     dict(causal=True, document_starts=starts([0, 300, 310, 320], [0, 250, 250, 400]))),
    ("two-sided window and documents",
     dict(causal=False, window=(50, 30), document_starts=starts([0, 60, 62, 80]))),
    ("causal window and per-batch documents",
     dict(causal=True, window=(40, None),
          document_starts=starts([0, 300, 310, 320], [0, 250, 250, 400]))),
    ("causal alone", dict(causal=True)),
]


def gather(ring, local, dim, mask):
    """Every rank's shard, gathered and unsharded by the mask's layout."""
    return ring.unshard(COMM.allgather(local.detach()), dim, **mask)


def run_ring(ring, q, k, v, do, dlse, mask):
    """The ring on this rank's shards (sharded with the mask): O, LSE and the gradients of
    sum(O dO) + sum(LSE dLSE), each gathered into the whole sequence."""
    leaves = [ring.shard(t, **mask).detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = ring(*leaves, return_lse=True, **mask)
    ((o.double() * ring.shard(do, **mask)).sum()
     + (lse.double() * ring.shard(dlse, dim=2, **mask)).sum()).backward()
    local = [o, lse] + [t.grad for t in leaves]
    return [gather(ring, t, 2 if i == 1 else 1, mask) for i, t in enumerate(local)]


def run_whole(fn, q, k, v, do, dlse, mask):
    """fn (ringattn.attention or the oracle) on the whole sequence: the same five."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves, **mask)
    ((o.double() * do).sum() + (lse.double() * dlse).sum()).backward()
    return [o.detach(), lse.detach()] + [t.grad for t in leaves]


def own_layout(mask, size):
    """Whether the balanced layout of `mask` on `size` ranks is neither zigzag's nor contiguous."""
    def standard(layout):
        return all(torch.equal(ringattn.positions(S, r, size, "balanced", **mask),
                               ringattn.positions(S, r, size, layout)) for r in range(size))
    return not standard("zigzag") and not standard("contiguous")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,mask", MASKS, ids=[m[0].replace(" ", "_") for m in MASKS])
def test_balanced_ring_matches_the_one_process_op(gen, name, mask, dtype):
    b, seq, hq, hkv, d = SHAPES[dtype]
    q, k, v = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64).to(dtype)
               for h in (hq, hkv, hkv))
    do = torch.randn(b, seq, hq, d, generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, hq, seq, generator=gen, dtype=torch.float64)
    with ringattn.RingAttention(COMM, "balanced") as ring:
        out = run_ring(ring, q, k, v, do, dlse, mask)
    single = run_whole(lambda *t, **kw: ringattn.attention(*t, return_lse=True, **kw),
                       q, k, v, do, dlse, mask)
    oracle = run_whole(reference, q.double(), k.double(), v.double(), do, dlse, mask)
    failures = []
    for what_name, x, one, ref in zip(NAMES, out, single, oracle):
        what = f"{what_name} ({name}, {dtype})"
        err, message = compare(x, ref, what)
        if message:
            failures.append(message)
            continue
        if err >= TOL[dtype]:
            failures.append(f"{what}: relative error {err:.3g} >= {TOL[dtype]:g} (oracle)")
        if dtype == torch.float64:
            if relative_error(x, one) >= TOL[dtype]:
                failures.append(f"{what}: differs from the one-process op by "
                                f"{relative_error(x, one):.3g}")
        else:
            one_err = relative_error(one, ref)
            allowance = math.sqrt(SIZE - 1) * UNIT_ROUNDOFF_F32 / 4 if what_name == "LSE" else 0.0
            bound = ERROR_FACTOR * one_err + allowance
            if err > bound:
                failures.append(f"{what}: the ring's error {err:.3g} exceeds {bound:.3g}, "
                                f"{ERROR_FACTOR}x the one-process op's ({one_err:.3g})"
                                + (" + sqrt(N - 1) u / 4" if allowance else ""))
    agree(failures)


def test_the_masks_give_layouts_of_their_own():
    """On 2 to 4 ranks the first two masks lay the sequence out unlike zigzag and contiguous, so
    the tests above see what only the balanced layout does."""
    failures = [f"{name}: zigzag's or the contiguous layout on {SIZE} ranks"
                for name, mask in MASKS[:2] if SIZE > 1 and not own_layout(mask, SIZE)]
    agree(failures)


@pytest.mark.parametrize("documents", [[0, 300, 310, 320], [0, 250, 250, 400], [0, 60, 62, 80]],
                         ids=["late_documents", "empty_document", "early_documents"])
def test_positions_are_the_rings_layout(documents):
    """The ring's layout read from its output: with q = k = 0 every visible key scores the same,
    so under a causal mask with documents the query at global position p, in the document that
    starts at d, has LSE = log(p - d + 1) and, with v = the key's global position,
    O = (d + p) / 2. positions() under the same mask must give that p for every local row."""
    mask = dict(causal=True, document_starts=starts(documents))
    local = S // SIZE
    with ringattn.RingAttention(COMM, "balanced") as ring:
        pos = ring.positions(S, **mask)
        zeros = torch.zeros(1, local, 2, 4, dtype=torch.float64)
        v = pos.to(torch.float64).view(1, local, 1, 1).expand(1, local, 2, 1)
        o, lse = ring(zeros, zeros, v, return_lse=True, **mask)
    begin = torch.zeros(S, dtype=torch.int64)  # each position's document start, by definition
    for start in documents:
        if start < S:
            begin[start:] = start
    failures = []
    if not torch.equal(pos, ringattn.positions(S, RANK, SIZE, "balanced", **mask)):
        failures.append("ring.positions() differs from ringattn.positions()")
    if (lse[0, 0] - torch.log((pos - begin[pos] + 1).double())).abs().max() > 1e-12:
        failures.append(f"the ring's LSE {lse[0, 0].tolist()} is not that of the rows at "
                        f"positions() {pos.tolist()}")
    if relative_error(o[0, :, 0, 0], (begin[pos] + pos).double() / 2) > 1e-13:
        failures.append(f"O = {o[0, :, 0, 0].tolist()}, expected (d + p) / 2 at positions() "
                        f"{pos.tolist()}")
    agree(failures)


def test_balanced_shard_and_unshard_round_trip(gen):
    """For 1 to 5 ranks and every mask: the ranks' positions hold each position once,
    shard() takes x's rows at positions() (x and LSE), unshard() of the shards (a list or one
    gathered tensor) gives x back, and the documents as [count], [1, count], int32, or on
    another rank's device give the same layout. The ring object's methods are the functions'."""
    seq = 240  # a multiple of 2N for N = 1 to 5
    x = torch.randn(2, seq, 3, 5, generator=gen, dtype=torch.float64)
    lse = torch.randn(2, 3, seq, generator=gen, dtype=torch.float64)
    changed = 0
    for name, mask in MASKS:
        mask = dict(mask)
        if "document_starts" in mask:
            mask["document_starts"] = mask["document_starts"] * seq // S
        for size in range(1, 6):
            where = (name, size)
            every = [ringattn.positions(seq, r, size, "balanced", **mask) for r in range(size)]
            assert torch.equal(torch.cat(every).sort().values, torch.arange(seq)), where
            assert all(len(p) == seq // size for p in every), where
            shards = [ringattn.shard(x, r, size, "balanced", **mask) for r in range(size)]
            for r in range(size):
                assert torch.equal(shards[r], x[:, every[r]]), (where, r)
                assert torch.equal(ringattn.shard(lse, r, size, "balanced", dim=-1, **mask),
                                   lse[..., every[r]]), (where, r)
            assert torch.equal(ringattn.unshard(shards, size, "balanced", **mask), x), where
            assert torch.equal(ringattn.unshard(torch.cat(shards, 1), size, "balanced", **mask),
                               x), where
            lse_shards = [ringattn.shard(lse, r, size, "balanced", dim=2, **mask)
                          for r in range(size)]
            assert torch.equal(ringattn.unshard(lse_shards, size, "balanced", dim=-1, **mask),
                               lse), where
            documents = mask.get("document_starts")
            if documents is not None and size > 1:
                plain = {key: value for key, value in mask.items() if key != "document_starts"}
                changed += any(not torch.equal(p, ringattn.positions(seq, r, size, "balanced",
                                                                     **plain))
                               for r, p in enumerate(every))
                if documents.dim() == 1:
                    for other in (documents[None], documents.to(torch.int32)):
                        again = dict(mask, document_starts=other)
                        assert all(torch.equal(p, ringattn.positions(seq, r, size, "balanced",
                                                                     **again))
                                   for r, p in enumerate(every)), (where, other)
    assert changed >= 5, "the documents never changed the balanced layout"
    # Differentiable: the gradient of shard() lands on the rank's rows.
    mask = MASKS[0][1]
    y = torch.randn(2, S, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    ringattn.shard(y, 1, 3, "balanced", **mask).sum().backward()
    rows = y.grad[0, :, 0, 0].nonzero().flatten()
    assert torch.equal(rows, ringattn.positions(S, 1, 3, "balanced", **mask).sort().values)
    # The ring's own methods.
    with ringattn.RingAttention(COMM, "balanced") as ring:
        assert torch.equal(ring.positions(S, **mask),
                           ringattn.positions(S, RANK, SIZE, "balanced", **mask))
        assert torch.equal(ring.shard(y.detach(), **mask),
                           ringattn.shard(y.detach(), RANK, SIZE, "balanced", **mask))
        whole = ring.unshard(COMM.allgather(ring.shard(y.detach(), **mask)), **mask)
    assert torch.equal(whole, y.detach())


def test_balanced_layout_errors():
    """The layout's mask is asked for by name; the library's refusals reach Python with its
    message."""
    documents = starts([0, 100])
    with pytest.raises(ValueError, match=r"ringattn.positions: the balanced layout follows the "
                                         r"mask of the ring's calls: pass their causal"):
        ringattn.positions(S, 0, 2, "balanced", document_starts=documents)
    with pytest.raises(ValueError, match="ringattn.shard: the balanced layout follows"):
        ringattn.shard(torch.zeros(1, 8, 1, 1), 0, 2, "balanced")
    with pytest.raises(ringattn.RingattnError) as info:
        ringattn.positions(10, 0, 2, "balanced", causal=True)
    assert str(info.value) == (
        "ringattn_layout_chunks: params->seq_len is 10; expected a positive multiple of "
        "2 * size = 4 (the balanced layout gives each rank at least 2 equal chunks) "
        "(ringattn status 1: invalid argument)")
    assert info.value.status == 1
    with pytest.raises(ringattn.RingattnError, match=r"params->rank is 3; expected 0 <= rank < "
                                                     r"size \(3\)"):
        ringattn.positions(12, 3, 3, "balanced", causal=False)
    with pytest.raises(ringattn.RingattnError, match=r"document start 1 of batch row 0 is 5, "
                                                     r"below start 0 \(9\)"):
        ringattn.positions(S, 0, 2, "balanced", causal=True, document_starts=starts([9, 5]))
    with pytest.raises(ringattn.RingattnError, match="window_left is -3"):
        ringattn.positions(S, 0, 2, "balanced", causal=True, window=(-3, None))
    with pytest.raises(ValueError, match=r"document_starts has shape \[1, 1, 2\]"):
        ringattn.positions(S, 0, 2, "balanced", causal=True, document_starts=documents[None, None])
    with pytest.raises(TypeError, match="document_starts has dtype torch.float32"):
        ringattn.positions(S, 0, 2, "balanced", causal=True, document_starts=documents.float())
    with pytest.raises(ValueError, match="size is 4294967298; expected a 32-bit int"):
        ringattn.positions(S, 0, 2**32 + 2, "balanced", causal=True)
