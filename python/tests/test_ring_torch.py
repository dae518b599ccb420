"""ringattn.RingAttention from a torch.distributed group: the ring made from an NCCL unique id
(ringattn_ring_create_nccl) that the group's first rank makes and the group broadcasts.

On any machine: a one-process gloo group; the ring refuses CPU tensors, and without a GPU says so.
With a GPU: the one-rank ring from the group against the fp64 reference (the criterion of
test_cuda.py), forward and backward. With two GPUs: two processes under torch.multiprocessing,
an NCCL group, each rank's shard against the reference's; skipped with fewer GPUs.
"""
import os

import pytest
import torch
import torch.distributed as dist

import ringattn
from conftest import SEED, cuda_devices


@pytest.fixture
def one_process_group(tmp_path):
    """The default group: this process alone, over gloo, destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_group_ring_refuses_cpu_tensors(one_process_group):
    with pytest.raises(ValueError, match="a ring from a torch.distributed group moves CUDA "
                                         "tensors over NCCL"):
        ringattn.RingAttention(one_process_group, device="cpu")


def test_group_ring_refuses_a_comm_of_another_kind():
    with pytest.raises(TypeError, match="comm is a str; expected an mpi4py communicator .* or a "
                                        "torch.distributed ProcessGroup"):
        ringattn.RingAttention("world")


@pytest.mark.skipif(cuda_devices() > 0, reason="checks the message of a machine without a GPU")
def test_group_ring_without_a_gpu_says_so(one_process_group):
    with pytest.raises(ringattn.RingattnError, match="no CUDA GPU is visible to this process|"
                                                     "built with CUDA") as info:
        ringattn.RingAttention(one_process_group)
    assert info.value.status == 2  # unsupported


def problem(seq, generator, dtype=torch.bfloat16, device="cuda"):
    b, hq, hkv, d = 1, 4, 2, 64
    q = torch.randn(b, seq, hq, d, device=device, generator=generator).to(dtype)
    k = (2 * torch.randn(b, seq, hkv, d, device=device, generator=generator)).to(dtype)
    v = torch.randn(b, seq, hkv, d, device=device, generator=generator).to(dtype)
    do = torch.randn(b, seq, hq, d, device=device, generator=generator).to(dtype)
    return q, k, v, do


def ring_run(ring, q, k, v, do, **mask):
    """This rank's O, dQ, dK, dV of the ring on its shards of the whole q, k, v, do."""
    q, k, v = (ring.shard(t).detach().requires_grad_() for t in (q, k, v))
    o = ring(q, k, v, **mask)
    (o.float() * ring.shard(do).float()).sum().backward()
    return o, q.grad, k.grad, v.grad


def reference_shards(ring, q, k, v, do, dtype, **mask):
    """The same from naive attention over the whole sequence in `dtype`, cut to this shard."""
    from test_cuda import naive
    dlse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    o, _, dq, dk, dv = naive(q, k, v, do, dlse, dtype, **mask)
    return tuple(ring.shard(t) for t in (o, dq, dk, dv))


def check_ring_against_reference(ring, seq, seed):
    from test_cuda import within_bound
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = problem(seq, g)
    mask = dict(causal=True, window=(seq // 3, 0))
    out = ring_run(ring, q, k, v, do, **mask)
    ref = reference_shards(ring, q, k, v, do, torch.float64, **mask)
    low = reference_shards(ring, q, k, v, do, torch.bfloat16, **mask)
    for name, x, lo, r in zip(("O", "dQ", "dK", "dV"), out, low, ref):
        within_bound(x, lo, r, f"ring from a torch group, rank {ring.rank} of {ring.size}, {name}")


@pytest.mark.skipif(cuda_devices() == 0, reason="needs a CUDA GPU and a library built with CUDA")
def test_one_rank_ring_from_a_group_matches_the_reference(one_process_group):
    with ringattn.RingAttention(one_process_group, layout="zigzag") as ring:
        assert (ring.rank, ring.size, ring.device) == (0, 1, "cuda")
        check_ring_against_reference(ring, 1000, SEED)


def _two_gpu_rank(rank, store, seed):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        with ringattn.RingAttention(dist.group.WORLD, layout="zigzag") as ring:
            check_ring_against_reference(ring, 2048, seed)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(cuda_devices() < 2, reason="needs two CUDA GPUs")
def test_two_rank_ring_from_an_nccl_group_matches_the_reference(tmp_path):
    import torch.multiprocessing as mp
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # A child's failure (an assertion of its rank) raises here, naming the rank.
    mp.spawn(_two_gpu_rank, args=(str(tmp_path / "store"), SEED), nprocs=2, join=True)
