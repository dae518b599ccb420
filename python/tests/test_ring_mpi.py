"""ringattn.RingAttention across real MPI ranks, against the fp64 oracle on the whole sequence.

Run under mpiexec (python/tests/run_mpi_tests.sh runs 1, 2, 3 and 4 ranks):

    mpiexec -n 4 --oversubscribe python -m pytest python/tests/test_ring_mpi.py

and without it as a ring of one rank. Every rank builds the same random problem (rank 0's seed,
broadcast), shards it with the layout, runs the ring forward and backward on its shard, gathers
every rank's outputs (mpi4py allgather) and unshards them, then compares O, LSE, dQ, dK and dV
with the oracle in reference.py on the whole sequence (docs/testing.md, "Ring"):
  f64 inputs: relative error under 1e-12;
  f32 inputs: relative error under 1e-5, and at most 1.1x the error of ringattn.attention on the
              whole problem in one process, for O, dQ, dK and dV; the LSE gets sqrt(N - 1) * u / 4
              (u = 2^-24) on top, for the fp32 rounding of the running LSE at each merge (as in
              tests/parallel/mpi_ring_attention.cpp).
One verdict on every rank: a test checks on every rank, gathers what failed where, and fails on
every rank if it failed on any.
"""
import math

import pytest
import torch

MPI = pytest.importorskip("mpi4py.MPI", reason="ring attention from Python needs mpi4py")

import ringattn  # noqa: E402
from conftest import SEED, cuda_devices, seeded_generator  # noqa: E402
from reference import attention as reference  # noqa: E402
from reference import TinyAttentionModel, relative_error  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SHARED_SEED = COMM.bcast(SEED, root=0)  # every rank builds rank 0's problem
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
UNIT_ROUNDOFF_F32 = 2.0 ** -24
LAYOUTS = ["zigzag", "contiguous"]


@pytest.fixture
def gen(request):
    """A generator of the shared seed and the test's id: the same numbers on every rank."""
    return seeded_generator(SHARED_SEED, request.node.nodeid)


def agree(failures):
    """Fails on every rank when any rank failed, listing what failed where."""
    everyone = COMM.allgather(list(failures))
    lines = [f"rank {rank}: {message}" for rank, own in enumerate(everyone) for message in own]
    if lines:
        pytest.fail("\n".join(lines) + f"\n({SIZE} ranks, seed {SHARED_SEED}: "
                    f"RINGATTN_TEST_SEED={SHARED_SEED} replays it)", pytrace=False)


def compare(out, ref, what):
    """The relative error of out against ref, and a failure message or None for the shape, NaN
    or infinities."""
    if out.shape != ref.shape:
        return math.inf, f"{what}: shape {list(out.shape)}, expected {list(ref.shape)}"
    if not torch.isfinite(out).all():
        return math.inf, f"{what}: not finite"
    return relative_error(out, ref), None


def gather_whole(ring, local, dim):
    """Every rank's shard, gathered and unsharded: the whole sequence on every rank."""
    return ringattn.unshard(COMM.allgather(local.detach()), SIZE, ring.layout, dim)


# (batch, seq, q_heads, kv_heads, head_dim, v_head_dim); seq a multiple of 2N for N = 1 to 4.
# GQA 2, 4 and 8; v_head_dim above and below head_dim, and MLA's 192/128; S = 360 gives zigzag
# chunks of 45 tokens on 4 ranks. The sequences are long enough for the 1.1x criterion to measure
# the schedule: over 16 seeds on 2 to 4 ranks the ring's fp32 O reaches 1.09x the one-process
# error at S = 192 (24/40) and 1.06x at S = 96 (192/128), the fp32 rounding of the running O at
# each merge against a small one-process error, but at most 1.04x at the lengths below.
SHAPES = [
    (2, 384, 4, 2, 32, 32),
    (2, 384, 4, 1, 24, 40),
    (1, 360, 8, 1, 40, 24),
    (2, 192, 4, 2, 192, 128),
]


class Problem:
    """A whole-sequence problem, the same on every rank: q, k, v rounded to dtype, and the
    gradients dO and dLSE of the loss sum(O * dO) + sum(LSE * dLSE) in fp64."""

    def __init__(self, gen, shape, dtype, causal):
        b, s, hq, hkv, d, dv = shape
        self.dtype, self.causal = dtype, causal
        self.q = torch.randn(b, s, hq, d, generator=gen, dtype=torch.float64).to(dtype)
        self.k = torch.randn(b, s, hkv, d, generator=gen, dtype=torch.float64).to(dtype)
        self.v = torch.randn(b, s, hkv, dv, generator=gen, dtype=torch.float64).to(dtype)
        self.do = torch.randn(b, s, hq, dv, generator=gen, dtype=torch.float64)
        self.dlse = torch.randn(b, hq, s, generator=gen, dtype=torch.float64)

    def loss(self, o, lse, do, dlse):
        return (o.double() * do).sum() + (0 if lse is None else (lse.double() * dlse).sum())

    def oracle(self, use_lse):
        """O, LSE, dQ, dK, dV of the fp64 oracle on the rounded inputs."""
        q, k, v = (t.detach().double().requires_grad_() for t in (self.q, self.k, self.v))
        o, lse = reference(q, k, v, causal=self.causal)
        self.loss(o, lse if use_lse else None, self.do, self.dlse).backward()
        return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]

    def one_process(self, use_lse):
        """The same by ringattn.attention on the whole problem (the ring of one rank)."""
        q, k, v = (t.detach().clone().requires_grad_() for t in (self.q, self.k, self.v))
        o, lse = ringattn.attention(q, k, v, causal=self.causal, return_lse=True)
        self.loss(o, lse if use_lse else None, self.do, self.dlse).backward()
        return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]

    def ring(self, ring, use_lse):
        """The same by the ring: this rank's shards, forward, backward, then gathered."""
        q, k, v = (ring.shard(t).detach().clone().requires_grad_()
                   for t in (self.q, self.k, self.v))
        do, dlse = ring.shard(self.do), ring.shard(self.dlse, dim=2)
        if use_lse:
            o, lse = ring(q, k, v, causal=self.causal, return_lse=True)
        else:
            o, lse = ring(q, k, v, causal=self.causal), None
        self.loss(o, lse, do, dlse).backward()
        local = [o, lse, q.grad, k.grad, v.grad]
        return [None if t is None else gather_whole(ring, t, 2 if i == 1 else 1)
                for i, t in enumerate(local)]


NAMES = ["O", "LSE", "dQ", "dK", "dV"]


@pytest.mark.parametrize("use_lse", [True, False], ids=["loss_o_lse", "loss_o"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ring_matches_oracle_on_the_whole_sequence(gen, shape, dtype, layout, causal, use_lse):
    problem = Problem(gen, shape, dtype, causal)
    oracle = problem.oracle(use_lse)
    single = problem.one_process(use_lse) if dtype == torch.float32 else None
    with ringattn.RingAttention(COMM, layout) as ring:
        out = problem.ring(ring, use_lse)
    failures = []
    for i, name in enumerate(NAMES):
        what = f"{name} ({layout}, {'causal' if causal else 'full'}, {dtype}, {shape})"
        if out[i] is None:
            if name != "LSE" or use_lse:
                failures.append(f"{what}: missing")
            continue
        if out[i].dtype != dtype:  # LSE: the accumulator dtype, which is the input's here
            failures.append(f"{what}: dtype {out[i].dtype}")
        err, message = compare(out[i], oracle[i], what)
        if message:
            failures.append(message)
            continue
        if err >= TOL[dtype]:
            failures.append(f"{what}: relative error {err:.3g} >= {TOL[dtype]:g}")
        if single is not None:
            single_err = relative_error(single[i], oracle[i])
            allowance = math.sqrt(SIZE - 1) * UNIT_ROUNDOFF_F32 / 4 if name == "LSE" else 0.0
            bound = 1.1 * single_err + allowance
            if err > bound:
                failures.append(f"{what}: the ring's error {err:.3g} exceeds {bound:.3g} = 1.1x "
                                f"the error of ringattn.attention on the whole problem "
                                f"({single_err:.3g})" + (" + sqrt(N - 1) u / 4" if allowance
                                                         else ""))
    agree(failures)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_identical_calls_are_bitwise_equal_and_views_are_taken(gen, layout):
    """A second call (workspaces reused) gives bitwise the same outputs, and packed QKV views
    (q, k, v slices of one [B, S/N, H, 3D] tensor) give those of contiguous copies."""
    problem = Problem(gen, (2, 48, 4, 4, 16, 16), torch.float64, True)
    with ringattn.RingAttention(COMM, layout) as ring:
        first, again = problem.ring(ring, True), problem.ring(ring, True)
        packed = ring.shard(torch.cat([problem.q, problem.k, problem.v], dim=-1))
        q, k, v = (t.requires_grad_() for t in packed.clone().split(16, dim=-1))
        o, lse = ring(q, k, v, causal=True, return_lse=True)
        problem.loss(o, lse, ring.shard(problem.do), ring.shard(problem.dlse, dim=2)).backward()
        viewed = [gather_whole(ring, t, 2 if i == 1 else 1)
                  for i, t in enumerate([o, lse, q.grad, k.grad, v.grad])]
    failures = [f"{name} differs between two identical calls"
                for name, a, b in zip(NAMES, first, again) if not torch.equal(a, b)]
    failures += [f"{name} of packed views differs from contiguous shards"
                 for name, a, b in zip(NAMES, viewed, first) if not torch.equal(a, b)]
    agree(failures)


def test_eager_path_is_bitwise_the_custom_op(gen):
    """A plain eager ring call goes through one autograd.Function (no custom-op dispatch): the
    same O, LSE and gradients, bitwise, as the custom op that torch.compile and fake tensors
    use, with documents, a window and a gradient reaching the LSE (the CPU ring's extra column)."""
    problem = Problem(gen, (2, 48, 4, 2, 8, 6), torch.float64, True)
    starts = torch.tensor([5, 17, 30])
    results = []
    with ringattn.RingAttention(COMM, "zigzag") as ring:
        q, k, v, do = (ring.shard(t) for t in (problem.q, problem.k, problem.v, problem.do))
        dlse = ring.shard(problem.dlse, dim=2)
        for eager in (True, False):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            if eager:
                o, lse = ring(*leaves, causal=True, window=(9, None), document_starts=starts,
                              return_lse=True)
            else:
                o, lse = torch.ops.ringattn.ring_forward(*leaves, starts, ring.ring_id, True,
                                                         1.0 / math.sqrt(8), 9, 0, True, False)
            torch.autograd.backward((o, lse), (do, dlse))
            results.append([o.detach(), lse.detach()] + [t.grad for t in leaves]
                           + [type(o.grad_fn).__name__])
    eager, op = results
    failures = [] if "EagerRing" in eager[5] and "EagerRing" not in op[5] else [
        f"graph nodes {eager[5]} (eager) and {op[5]} (custom op)"]
    failures += [f"{name} of the eager path differs from the custom op's"
                 for name, a, b in zip(NAMES, eager[:5], op[:5]) if not torch.equal(a, b)]
    agree(failures)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_are_the_library_layout(layout):
    """The library's own positions, read from its output: with q = k = 0 every visible key
    scores the same, so under the causal mask the query at global position p has
    LSE = log(p + 1) and, with v = the key's global position, O = p / 2. Both must match
    positions() row for row on every rank."""
    seq = 24 * 4
    local = seq // SIZE
    with ringattn.RingAttention(COMM, layout) as ring:
        pos = ringattn.positions(seq, RANK, SIZE, layout)
        zeros = torch.zeros(1, local, 2, 4, dtype=torch.float64)
        v = pos.to(torch.float64).view(1, local, 1, 1).expand(1, local, 2, 1)
        o, lse = ring(zeros, zeros, v, causal=True, return_lse=True)
    failures = []
    seen = torch.exp(lse[0, 0]) - 1
    if not torch.equal(seen.round().long(), pos) or (seen - pos).abs().max() > 1e-9:
        failures.append(f"the library puts local rows at positions {seen.round().long().tolist()}"
                        f", positions() says {pos.tolist()}")
    if relative_error(o[0, :, 0, 0], pos.double() / 2) > 1e-13:
        failures.append(f"O = {o[0, :, 0, 0].tolist()}, expected positions / 2")
    if not torch.equal(ring.positions(seq), pos):
        failures.append("ring.positions() differs from ringattn.positions()")
    agree(failures)


def test_positions_shard_and_unshard(gen):
    """The layouts by hand (SequenceLayout: zigzag = chunks r and 2N-1-r of 2N), shard() and
    unshard() against them, for 1 to 5 ranks and both layouts."""
    assert ringattn.positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert ringattn.positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert ringattn.positions(12, 1, 3, "zigzag").tolist() == [2, 3, 8, 9]
    assert ringattn.positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    x = torch.randn(2, 60, 3, 5, generator=gen, dtype=torch.float64)
    lse = torch.randn(2, 3, 60, generator=gen, dtype=torch.float64)
    for size in range(1, 6):
        for layout in LAYOUTS:
            if 60 % (2 * size if layout == "zigzag" else size):
                continue
            every = [ringattn.positions(60, r, size, layout) for r in range(size)]
            assert torch.equal(torch.cat(every).sort().values, torch.arange(60)), (size, layout)
            shards = [ringattn.shard(x, r, size, layout) for r in range(size)]
            for r in range(size):
                assert torch.equal(shards[r], x[:, every[r]]), (size, layout, r)
                assert torch.equal(ringattn.shard(lse, r, size, layout, dim=-1), lse[..., every[r]])
            assert torch.equal(ringattn.unshard(shards, size, layout), x)
            assert torch.equal(ringattn.unshard(torch.cat(shards, 1), size, layout), x)
            lse_shards = [ringattn.shard(lse, r, size, layout, dim=2) for r in range(size)]
            assert torch.equal(ringattn.unshard(lse_shards, size, layout, dim=-1), lse)
    # Differentiable both ways: the gradient of shard() lands on the rank's rows.
    y = x.clone().requires_grad_()
    ringattn.shard(y, 1, 3, "zigzag").sum().backward()
    rows = y.grad[0, :, 0, 0].nonzero().flatten()
    assert torch.equal(rows, ringattn.positions(60, 1, 3, "zigzag"))


def test_layout_errors_name_what_is_wrong():
    """The library's refusals (ringattn_layout_chunks) with its message; the package's own checks
    of the layout's name and of the shards given to unshard()."""
    with pytest.raises(ringattn.RingattnError, match=r"params->seq_len is 10; expected a positive "
                                                     r"multiple of 2 \* size = 4 \(the zigzag "
                                                     r"layout"):
        ringattn.positions(10, 0, 2, "zigzag")
    with pytest.raises(ringattn.RingattnError, match=r"params->seq_len is 10; expected a positive "
                                                     r"multiple of size = 3 \(the contiguous"):
        ringattn.shard(torch.zeros(1, 10, 1, 1), 0, 3, "contiguous")
    with pytest.raises(ringattn.RingattnError, match=r"params->rank is 2; expected 0 <= rank < "
                                                     r"size \(2\)"):
        ringattn.positions(8, 2, 2, "zigzag")
    with pytest.raises(ValueError, match="layout is 'ring'; expected 'zigzag', 'contiguous' or "
                                         "'balanced'"):
        ringattn.positions(8, 0, 2, "ring")
    with pytest.raises(ValueError, match="3 shards for N = 2 ranks"):
        ringattn.unshard([torch.zeros(1, 4, 1, 1)] * 3, 2, "zigzag")
    with pytest.raises(ValueError, match="the shards have shapes"):
        ringattn.unshard([torch.zeros(1, 4, 1, 1), torch.zeros(1, 2, 1, 1)], 2, "zigzag")
    with pytest.raises(ValueError, match="expected a positive multiple of N = 3 ranks"):
        ringattn.unshard(torch.zeros(1, 4, 1, 1), 3, "contiguous")


def test_an_error_on_one_rank_raises_on_every_rank(gen):
    """Bad shapes on the last rank alone, then on every rank: RingattnError on every rank, with
    the same message, naming what differs; the ring works again afterwards."""
    q = torch.randn(1, 8, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 8, 2, 8, generator=gen, dtype=torch.float64)
    last = RANK == SIZE - 1
    disagree = "the ranks disagree: "
    cases = [  # (what, the call, what the message must hold; None: no error)
        ("q of 3 heads on the last rank", lambda: ring(q[:, :, :3] if last else q, k, k),
         [disagree, f"rank {SIZE - 1} has q [1, 8, 3, 8] f64"] if SIZE > 1
         else ["q has 3 heads, not a multiple of the 2 heads of k and v"]),
        ("q of rank 3 on the last rank", lambda: ring(q[0] if last else q, k, k),
         [disagree, f"rank {SIZE - 1} has q [8, 4, 8] f64"] if SIZE > 1 else ["q has rank 3"]),
        ("q of 3 heads on 2 K/V heads", lambda: ring(q[:, :, :3], k, k),
         ["q has 3 heads, not a multiple of the 2 heads of k and v"]),
        ("f16 on a CPU ring", lambda: ring(q.half(), k.half(), k.half()),
         ["q has dtype f16; host tensors run on the CPU block"]),
        ("scales that differ", lambda: ring(q, k, k, scale=0.5 + RANK),
         [disagree, "rank 0 has scale 0.5"] if SIZE > 1 else None),
    ]
    failures = []
    with ringattn.RingAttention(COMM, "zigzag") as ring:
        for what, call, expected in cases:
            try:
                call()
                message = None
            except ringattn.RingattnError as error:
                message = str(error)
            if expected is None:
                if message is not None:
                    failures.append(f"{what}: raised {message}")
                continue
            if message is None:
                failures.append(f"{what}: no RingattnError")
            elif not all(part in message for part in expected):
                failures.append(f"{what}: the message {message!r} lacks one of {expected}")
            messages = COMM.allgather(message)
            if len(set(messages)) != 1:
                failures.append(f"{what}: the ranks' messages differ: {messages}")
        o = ring(q, k, k, causal=True)
    ref, _ = reference(ringattn.unshard(COMM.allgather(q), SIZE, "zigzag"),
                       ringattn.unshard(COMM.allgather(k), SIZE, "zigzag"),
                       ringattn.unshard(COMM.allgather(k), SIZE, "zigzag"), causal=True)
    if relative_error(gather_whole(ring, o, 1), ref) >= 1e-12:
        failures.append("the ring's result after the errors is wrong")
    agree(failures)


def test_construction_and_lifetime_errors(gen):
    with pytest.raises(ValueError, match="layout is 'spiral'"):
        ringattn.RingAttention(COMM, "spiral")
    with pytest.raises(TypeError, match="expected an mpi4py communicator"):
        ringattn.RingAttention(0)
    with pytest.raises(ValueError, match="device is 'meta'"):
        ringattn.RingAttention(COMM, device="meta")
    q = torch.randn(1, 8, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    ring = ringattn.RingAttention(COMM, "contiguous")
    ring_id = ring.ring_id
    o = ring(q, q, q, causal=True)
    del ring  # the graph holds the ring until its backward has run
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    del o
    assert ring_id not in ringattn._ring._rings, "a ring no one holds is destroyed"
    ring = ringattn.RingAttention(COMM, "contiguous")
    assert ring.ring_id != ring_id
    o = ring(q, q, q)
    ring.close()
    ring.close()  # closing twice is harmless
    with pytest.raises(ringattn.RingattnError, match=f"ringattn ring {ring.ring_id} is closed"):
        ring(q, q, q)
    with pytest.raises(ringattn.RingattnError, match="is closed"):
        o.sum().backward()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_ring_without_a_gpu_fails_on_every_rank():
    try:
        ringattn.RingAttention(COMM, device="cuda").close()
        message = None
    except ringattn.RingattnError as error:
        message = str(error)
    messages = COMM.allgather(message)
    agree([] if all(m is not None for m in messages) else
          [f"ranks without an error: {[r for r, m in enumerate(messages) if m is None]}"])


def node_local_gpu():
    """The GPU a device ring uses on this rank: that of its node-local rank, modulo the GPUs."""
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    index = local.Get_rank() % torch.cuda.device_count()
    local.Free()
    return torch.device("cuda", index)


@pytest.mark.skipif(cuda_devices() == 0, reason="needs a CUDA GPU and a library built with CUDA")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_ring_by_the_flashattention_criterion(gen, layout, causal):
    """bf16 shards over NCCL against the fp64 oracle: max|out - ref| <= 2 max|low - ref| + 1e-5
    with low naive attention in bf16 (test_cuda.py's criterion), for O, LSE, dQ, dK and dV; and
    a gradient of the LSE refused on every rank."""
    device = node_local_gpu()
    b, s, hq, hkv, d = 2, 1024, 8, 2, 64
    q, k, v, do = (torch.randn(b, s, h, d, generator=gen).bfloat16()
                   for h in (hq, hkv, hkv, hq))

    def naive(dtype):
        # detach: q, k, v are bf16 already, and .to() of their own dtype would return them,
        # making them (not copies) require grad and the ring's shards of them non-leaves.
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, lse = reference(*leaves, causal=causal, dtype=dtype)
        (o * do.to(dtype)).sum().backward()
        return [o, lse] + [t.grad for t in leaves]

    ref, low = naive(torch.float64), naive(torch.bfloat16)
    failures = []
    with ringattn.RingAttention(COMM, layout, device="cuda") as ring:
        leaves = [ring.shard(t).to(device).requires_grad_() for t in (q, k, v)]
        o, lse = ring(*leaves, causal=causal, return_lse=True)
        (o.float() * ring.shard(do).to(device).float()).sum().backward()
        out = [gather_whole(ring, t.cpu(), 2 if i == 1 else 1)
               for i, t in enumerate([o, lse] + [t.grad for t in leaves])]
        o, lse = ring(*leaves, causal=causal, return_lse=True)
        try:
            lse.sum().backward()
            failures.append("a gradient of the LSE of a CUDA ring did not raise")
        except NotImplementedError:
            pass
    for name, x, lo, r in zip(NAMES, out, low, ref):
        err = (x.double() - r).abs().max().item()
        low_err = (lo.double() - r).abs().max().item()
        if not err <= 2 * low_err + 1e-5:
            failures.append(f"{name} ({layout}, causal={causal}): error {err:.3g}, bf16 naive "
                            f"{low_err:.3g}")
    agree(failures)


def test_meta_tensors_give_shapes_and_dtypes():
    with ringattn.RingAttention(COMM) as ring:
        for dtype, acc in ((torch.float32, torch.float32), (torch.float64, torch.float64),
                           (torch.bfloat16, torch.float32)):
            q = torch.empty(3, 10, 8, 64, dtype=dtype, device="meta")
            k = torch.empty(3, 10, 2, 64, dtype=dtype, device="meta")
            v = torch.empty(3, 10, 2, 32, dtype=dtype, device="meta")
            o, lse = ring(q, k, v, causal=True, return_lse=True)
            assert o.shape == (3, 10, 8, 32) and o.dtype == dtype and o.device.type == "meta"
            assert lse.shape == (3, 8, 10) and lse.dtype == acc


def test_opcheck(gen):
    """torch.library.opcheck of both ops (schemas, fake implementations, autograd registration),
    each of its calls a ring call on every rank alike."""
    q = torch.randn(2, 8, 4, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 8, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 8, 2, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    with ringattn.RingAttention(COMM) as ring:
        args = (q, k, v, None, ring.ring_id, True, 0.4, 0, 0, True, False)
        torch.library.opcheck(torch.ops.ringattn.ring_forward.default, args)
        o, lse = torch.ops.ringattn.ring_forward(*[a.detach() if torch.is_tensor(a) else a
                                                   for a in args])
        do = torch.randn(o.shape, dtype=o.dtype, generator=gen)
        dlse = torch.randn(lse.shape, dtype=lse.dtype, generator=gen)
        torch.library.opcheck(torch.ops.ringattn.ring_backward.default,
                              (do, dlse, q.detach(), k.detach(), v.detach(), o, lse,
                               None, ring.ring_id, True, 0.4, 0, 0, True, False))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(gen, backend):
    """torch.compile(fullgraph=True) through the ring: the output and parameter gradients of
    eager mode."""
    torch._dynamo.reset()
    with ringattn.RingAttention(COMM) as ring:
        torch.manual_seed(SHARED_SEED)
        model = TinyAttentionModel(ring, embed=16, dtype=torch.float64)
        x = ring.shard(torch.randn(2, 24, 16, generator=gen, dtype=torch.float64))
        eager = model(x)
        eager.square().mean().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        out = compiled(x)
        out.square().mean().backward()
    failures = []
    if relative_error(out, eager) >= 1e-12:
        failures.append(f"{backend}: output differs from eager by {relative_error(out, eager):.3g}")
    for (name, p), g in zip(model.named_parameters(), eager_grads):
        if relative_error(p.grad, g) >= 1e-12:
            failures.append(f"{backend}: gradient of {name} differs from eager")
    agree(failures)
