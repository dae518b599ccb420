"""The randomized differential check of ringattn.RingAttention across real MPI ranks: random
shapes, layouts (zigzag, contiguous, balanced) and masks (random_mask: causal or not, windows
from 1 token to wider than the sequence, about a shard's length among them, and packed documents
with repeated, unaligned and out-of-range starts), in f64 against the fp64 oracle of reference.py
on the whole sequence, O, LSE, dQ, dK and dV of a loss over O and LSE, relative error under 1e-12
(docs/testing.md, "Ring"). Run like test_ring_mpi.py (python/tests/run_mpi_tests.sh at 1 to 4
ranks); every rank draws the same cases from the shared seed. One verdict on every rank, naming
the first cases that failed.

The f32 bound of the ring's error (1.1x the one-process op's) is test_ring_mpi.py's and
test_ring_mpi_masks.py's: it holds at their lengths, not at the short random ones here, where
each merge's rounding weighs as much as a whole row's.
"""
import random

import pytest
import torch

MPI = pytest.importorskip("mpi4py.MPI", reason="ring attention from Python needs mpi4py")

import ringattn  # noqa: E402
from random_masks import random_mask  # noqa: E402
from reference import attention as reference  # noqa: E402
from test_ring_mpi import COMM, NAMES, SIZE, agree, compare, gen  # noqa: E402,F401

CASES = 150  # about 2-3 s at 2 to 4 ranks on two cores
TOL = 1e-12


def whole_sequence_problem(rng, gen):
    """One case: its description, the mask's keywords, and q, k, v, dO, dLSE of the whole
    sequence (the same on every rank)."""
    layout = rng.choice(["zigzag", "contiguous", "balanced"])
    unit = SIZE if layout == "contiguous" else 2 * SIZE
    seq = unit * rng.choice([1, 2, 3, 5, 8, 13, 24])
    batch, kv_heads = rng.choice([1, 2]), rng.choice([1, 2])
    q_heads, head_dim = kv_heads * rng.choice([1, 2, 3]), rng.choice([1, 4, 8, 16])
    v_head_dim = rng.choice([head_dim, 8])
    mask = random_mask(rng, seq, batch, edges=(seq // SIZE, 64))
    if mask["document_starts"] is not None:
        mask["document_starts"] = torch.tensor(mask["document_starts"], dtype=torch.int64)
    gain = rng.choice([1.0, 1.0, 8.0])
    f64 = dict(generator=gen, dtype=torch.float64)
    tensors = (torch.randn(batch, seq, q_heads, head_dim, **f64) * gain,
               torch.randn(batch, seq, kv_heads, head_dim, **f64) * gain,
               torch.randn(batch, seq, kv_heads, v_head_dim, **f64),
               torch.randn(batch, seq, q_heads, v_head_dim, **f64),
               torch.randn(batch, q_heads, seq, **f64))
    what = (f"{layout}, seq {seq}, batch {batch}, heads {q_heads}/{kv_heads}, head dims "
            f"{head_dim}/{v_head_dim}, gain {gain}, {mask}")
    return what, layout, mask, tensors


def loss(o, lse, do, dlse):
    """sum(O dO) + sum(LSE dLSE) over the rows that see some key (LSE = -inf elsewhere)."""
    seen = torch.isfinite(lse)
    return (o * do).sum() + torch.where(seen, lse * dlse, torch.zeros_like(lse)).sum()


def oracle(mask, q, k, v, do, dlse):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = reference(*leaves, **mask)
    loss(o, lse, do, dlse).backward()
    return [o.detach(), lse.detach()] + [t.grad for t in leaves]


def ring_call(ring, mask, q, k, v, do, dlse):
    """The ring on this rank's shards (the balanced layout's follow the mask), gathered and
    unsharded into the whole sequence on every rank."""
    layout_mask = mask if ring.layout == "balanced" else {}
    leaves = [ring.shard(t, **layout_mask).clone().requires_grad_() for t in (q, k, v)]
    o, lse = ring(*leaves, return_lse=True, **mask)
    loss(o, lse, ring.shard(do, **layout_mask), ring.shard(dlse, dim=2, **layout_mask)).backward()
    local = [o.detach(), lse.detach()] + [t.grad for t in leaves]
    return [ringattn.unshard(COMM.allgather(t), SIZE, ring.layout, 2 if i == 1 else 1,
                             **layout_mask) for i, t in enumerate(local)]


def mismatches(out, ref):
    """What differs from the oracle beyond TOL (test_ring_mpi's compare), LSE's rows at -inf
    compared exactly and left out of its error."""
    found = []
    for name, x, r in zip(NAMES, out, ref):
        if name == "LSE" and x.shape == r.shape:
            seen = torch.isfinite(r)
            if not torch.equal(torch.isfinite(x), seen):
                found.append("LSE: rows at -inf differ")
                continue
            x, r = x[seen], r[seen]
        err, message = compare(x, r, name)
        if message or err >= TOL:
            found.append(message or f"{name}: relative error {err:.3g} >= {TOL:g}")
    return found


def test_random_rings_match_the_oracle(gen):
    rng = random.Random(int(torch.randint(2**62, (1,), generator=gen)))
    rings = {layout: ringattn.RingAttention(COMM, layout)
             for layout in ("zigzag", "contiguous", "balanced")}
    failures = []
    try:
        for case in range(CASES):
            what, layout, mask, tensors = whole_sequence_problem(rng, gen)
            try:
                found = mismatches(ring_call(rings[layout], mask, *tensors),
                                   oracle(mask, *tensors))
            except ringattn.RingattnError as error:
                found = [f"RingattnError: {error}"]
            failures += [f"case {case} ({what}): {message}" for message in found]
            if len(failures) >= 5:
                break
    finally:
        for ring in rings.values():
            ring.close()
    agree(failures)
