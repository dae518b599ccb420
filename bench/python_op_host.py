"""The Python wrapper's own host cost a call of ringattn.attention and of a ringattn.RingAttention
of one rank (MPI.COMM_SELF, where mpi4py is there): the library's calls replaced by no-ops, tiny
CPU tensors [1, 8, 2, 16] f32, one thread; the best of 5 rounds; the ring both as an eager call
makes it and through its custom op (what torch.compile calls). Runs anywhere (no GPU); what a GPU
call costs on top is the library's launch (bench/python_op.py measures the whole).

    RINGATTN_LIBRARY=build/libringattn.so python3 bench/python_op_host.py [PYTHON_DIR]
"""
import sys
import time

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "python")
import torch  # noqa: E402

import ringattn  # noqa: E402
from ringattn import _capi  # noqa: E402


def best_us(fn, calls, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        for _ in range(100):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    torch.set_num_threads(1)
    lib = _capi.library()
    for name in ("forward", "backward", "backward_prepare", "ring_forward", "ring_backward"):
        setattr(type(lib), name, lambda self, *args, **kwargs: None)
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def forward_backward():
        o = ringattn.attention(qg, kg, vg, causal=True)
        o.backward(o)

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        o.backward(o)

    print(f"forward {best_us(lambda: ringattn.attention(q, k, v, causal=True), 2000):.1f} us, "
          f"forward+backward {best_us(forward_backward, 1000):.1f} us a call "
          f"(SDPA's forward+backward, computing: {best_us(sdpa, 1000):.1f} us)")
    try:
        from mpi4py import MPI
    except ImportError:
        print("ring: skipped (no mpi4py)")
        return
    with ringattn.RingAttention(MPI.COMM_SELF) as ring:
        op = torch.ops.ringattn.ring_forward
        args = (None, ring.ring_id, True, 0.25, 0, 0, False, False)

        def ring_eager():
            o = ring(qg, kg, vg, causal=True)
            o.backward(o)

        def ring_op():
            o = op(qg, kg, vg, *args)[0]
            o.backward(o)

        print(f"ring: forward {best_us(lambda: ring(q, k, v, causal=True), 2000):.1f} us, "
              f"forward+backward {best_us(ring_eager, 1000):.1f} us a call; through the custom "
              f"op: forward {best_us(lambda: op(q, k, v, *args), 2000):.1f} us, "
              f"forward+backward {best_us(ring_op, 1000):.1f} us")


if __name__ == "__main__":
    main()
