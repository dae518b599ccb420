"""ringattn.RingAttention with sliding windows and packed documents across real MPI ranks,
against the one-process op (ringattn.attention on the whole sequence, the same mask) and the fp64
oracle of reference.py (its boolean mask from the definition). Run like test_ring_mpi.py
(python/tests/run_mpi_tests.sh runs both at 1, 2, 3 and 4 ranks; plain pytest: a ring of one).

Every rank builds the same problem, runs the ring on its shards with the whole sequence's
document starts, gathers and unshards O, LSE, dQ, dK and dV (a loss over O and LSE), and compares:
  f64: relative error under 1e-12 against the oracle and against the one-process op;
  f32: relative error under 1e-5 against the oracle, and at most 1.1x (zigzag: 1.2x) the
       one-process op's error, the LSE with sqrt(N - 1) u / 4 on top (as in test_ring_mpi.py).
       Under a window or documents a row sees few keys, so the one-process error is small, and
       each merge of the ring rounds the running O by weights from an fp32 LSE; the zigzag layout
       gives a row's keys to up to three calls. tests/parallel/mpi_ring_masks.cpp measured the
       ring's O at up to 1.12x on zigzag, and sets the same bounds on the same lengths: S = 384
       and head_dim 32 for f32 (at S = 96 the merges' rounding alone reaches 1.1x), S = 96 for
       f64 (windows reaching across several shards).
One verdict on every rank.
"""
import functools
import math

import pytest
import torch

MPI = pytest.importorskip("mpi4py.MPI", reason="ring attention from Python needs mpi4py")

import ringattn  # noqa: E402
from reference import attention as reference  # noqa: E402
from reference import TinyAttentionModel, relative_error  # noqa: E402
from test_ring_mpi import (COMM, LAYOUTS, NAMES, SHARED_SEED, SIZE, TOL,  # noqa: E402
                           UNIT_ROUNDOFF_F32, agree, compare, gather_whole, gen)  # noqa: F401

# (batch, seq, q_heads, kv_heads, head_dim) by dtype; seq a multiple of 2N for N = 1 to 4.
SHAPES = {torch.float64: (2, 96, 4, 2, 16), torch.float32: (2, 384, 4, 2, 32)}
S = 96  # the other tests' length
ERROR_FACTOR = {"contiguous": 1.1, "zigzag": 1.2}


def starts(*lists):
    return torch.tensor(lists[0] if len(lists) == 1 else lists, dtype=torch.int64)


# (name, keywords of the whole sequence's mask): document starts for a sequence of 384 tokens,
# scaled to the problem's length; windows in tokens.
MASKS = [
    ("causal window and per-batch documents",
     dict(causal=True, window=(20, 0),
          document_starts=starts([0, 120, 124, 280], [0, 192, 192, 800]))),
    ("two-sided window and documents", dict(window=(13, 25), document_starts=starts([0, 48, 240]))),
    ("causal documents", dict(causal=True, document_starts=starts([0, 160]))),
    ("causal window", dict(causal=True, window=(33, None))),
]


def scaled(kw, seq):
    kw = dict(kw)
    if "document_starts" in kw:
        kw["document_starts"] = kw["document_starts"] * seq // 384
    return kw


def run_ring(ring, q, k, v, do, dlse, kw):
    """The ring on this rank's shards: O, LSE and the gradients of sum(O dO) + sum(LSE dLSE),
    gathered into the whole sequence."""
    leaves = [ring.shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = ring(*leaves, return_lse=True, **kw)
    ((o.double() * ring.shard(do)).sum()
     + (lse.double() * ring.shard(dlse, dim=2)).sum()).backward()
    local = [o, lse] + [t.grad for t in leaves]
    return [gather_whole(ring, t, 2 if i == 1 else 1) for i, t in enumerate(local)]


def run_whole(fn, q, k, v, do, dlse, kw):
    """fn (ringattn.attention or the oracle) on the whole sequence: the same five."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves, **kw)
    ((o.double() * do).sum() + (lse.double() * dlse).sum()).backward()
    return [o.detach(), lse.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,kw", MASKS, ids=[m[0].replace(" ", "_") for m in MASKS])
def test_ring_with_masks_matches_the_one_process_op(gen, name, kw, dtype, layout):
    b, seq, hq, hkv, d = SHAPES[dtype]
    kw = scaled(kw, seq)
    q, k, v = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64).to(dtype)
               for h in (hq, hkv, hkv))
    do = torch.randn(b, seq, hq, d, generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, hq, seq, generator=gen, dtype=torch.float64)
    with ringattn.RingAttention(COMM, layout) as ring:
        out = run_ring(ring, q, k, v, do, dlse, kw)
    single = run_whole(functools.partial(ringattn.attention, return_lse=True), q, k, v, do, dlse,
                       kw)
    oracle = run_whole(reference, q.double(), k.double(), v.double(), do, dlse, kw)
    failures = []
    for name_, x, one, ref in zip(NAMES, out, single, oracle):
        what = f"{name_} ({name}, {layout}, {dtype})"
        err, message = compare(x, ref, what)
        if message:
            failures.append(message)
            continue
        if err >= TOL[dtype]:
            failures.append(f"{what}: relative error {err:.3g} >= {TOL[dtype]:g} (oracle)")
        one_err = relative_error(one, ref)
        if dtype == torch.float64:
            if relative_error(x, one) >= TOL[dtype]:
                failures.append(f"{what}: differs from the one-process op by "
                                f"{relative_error(x, one):.3g}")
        else:
            allowance = math.sqrt(SIZE - 1) * UNIT_ROUNDOFF_F32 / 4 if name_ == "LSE" else 0.0
            bound = ERROR_FACTOR[layout] * one_err + allowance
            if err > bound:
                failures.append(f"{what}: the ring's error {err:.3g} exceeds {bound:.3g}, "
                                f"{ERROR_FACTOR[layout]}x the one-process op's ({one_err:.3g})"
                                + (" + sqrt(N - 1) u / 4" if allowance else ""))
    agree(failures)


def test_the_mask_reaches_the_ring(gen):
    """The ring with a window differs from the ring without one (so the comparisons above can
    fail when the mask is dropped on the way to the library)."""
    q, k, v = (torch.randn(1, S, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    with ringattn.RingAttention(COMM, "zigzag") as ring:
        plain = gather_whole(ring, ring(*(ring.shard(t) for t in (q, k, v)), causal=True), 1)
        masked = gather_whole(ring, ring(*(ring.shard(t) for t in (q, k, v)), causal=True,
                                         window=(10, 0), document_starts=starts([0, 50])), 1)
    agree([] if not torch.equal(plain, masked) else ["the window and documents changed nothing"])


def test_bad_masks_fail_alike_on_every_rank(gen):
    """A negative window or decreasing starts on every rank, and (from 2 ranks) a window on one
    rank only: RingattnError with the same message on every rank, naming the field; the ring
    stays usable."""
    q = torch.randn(1, S // SIZE, 2, 8, generator=gen, dtype=torch.float64)
    cases = [("window_left is -1", dict(window=(-1, 0))),
             ("below start 1 (50)", dict(document_starts=starts([0, 50, 40])))]
    if SIZE > 1:
        cases.append(("window_left", dict(window=(7 if COMM.Get_rank() == SIZE - 1 else 8, 0))))
    failures = []
    with ringattn.RingAttention(COMM, "zigzag") as ring:
        for part, kw in cases:
            try:
                ring(q, q, q, causal=True, **kw)
                message = None
            except ringattn.RingattnError as error:
                message = str(error)
            messages = COMM.allgather(message)
            if any(m is None for m in messages):
                failures.append(f"{kw}: no error on ranks {[r for r, m in enumerate(messages) if m is None]}")
            elif len(set(messages)) != 1:
                failures.append(f"{kw}: the ranks' messages differ: {messages}")
            elif part not in messages[0]:
                failures.append(f"{kw}: the message does not name {part!r}: {messages[0]}")
        o = ring(q, q, q, causal=True, window=(5, 0))
    if not torch.isfinite(o).all():
        failures.append("the ring's result after the errors is not finite")
    agree(failures)


def test_opcheck_with_documents(gen):
    q = torch.randn(2, S // SIZE, 4, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, S // SIZE, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    docs = starts([0, 20, 61], [3, 3, 90])
    with ringattn.RingAttention(COMM) as ring:
        args = (q, k, k, docs, ring.ring_id, True, 0.4, 12, 0, True, False)
        torch.library.opcheck(torch.ops.ringattn.ring_forward.default, args)
        o, lse = torch.ops.ringattn.ring_forward(*[a.detach() if torch.is_tensor(a) else a
                                                   for a in args])
        do = torch.randn(o.shape, dtype=o.dtype, generator=gen)
        dlse = torch.randn(lse.shape, dtype=lse.dtype, generator=gen)
        torch.library.opcheck(torch.ops.ringattn.ring_backward.default,
                              (do, dlse, q.detach(), k.detach(), k.detach(), o, lse, docs,
                               ring.ring_id, True, 0.4, 12, 0, True, False))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_with_a_window_and_documents(gen, backend):
    torch._dynamo.reset()
    docs = starts([0, 9, 30], [0, 17, 17])
    with ringattn.RingAttention(COMM) as ring:
        torch.manual_seed(SHARED_SEED)
        model = TinyAttentionModel(functools.partial(ring, window=(6, 0), document_starts=docs),
                                   embed=16, dtype=torch.float64)
        x = ring.shard(torch.randn(2, 48, 16, generator=gen, dtype=torch.float64))
        eager = model(x)
        eager.square().mean().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = torch.compile(model, fullgraph=True, backend=backend)(x)
        out.square().mean().backward()
    failures = []
    if relative_error(out, eager) >= 1e-12:
        failures.append(f"{backend}: output differs from eager by {relative_error(out, eager):.3g}")
    for (name, p), g in zip(model.named_parameters(), eager_grads):
        if relative_error(p.grad, g) >= 1e-12:
            failures.append(f"{backend}: gradient of {name} differs from eager")
    agree(failures)
