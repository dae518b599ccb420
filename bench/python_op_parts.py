"""Where the host time of a small ringattn.attention call on a GPU goes: each step of the call
timed alone, back to back on the host (time.perf_counter, no sync between calls, best of 5 rounds
after warm-up), at the small shape of bench/python_op.py (batch 1, 128 tokens, 4 heads of 64,
causal, bf16). The steps are those of python/ringattn/_ops.py: the whole op (forward, and forward
+ backward), the same through torch.autograd.grad (no .grad accumulation) beside SDPA's and
beside an identity autograd.Function (the engine's cost for one Python node on CUDA), the
backward's Python body called directly, then its parts one by one: the output allocations, the current stream, the device
guard, the descriptors, the parameter struct, the C API call alone with prepared parameters
(its checks, tensor maps and launch), and the backward's allocations, delta pass (which zeroes
dQ's accumulator), C call and dQ rounding. SDPA's cuDNN forward the same way, for reference. A GPU
whose work is shorter than these host times runs them back to back, so each time is host time.

    RINGATTN_LIBRARY=build-gpu/libringattn.so PYTHONPATH=python \\
        python3 bench/python_op_parts.py [--json FILE]
"""
import argparse
import json
import sys
import time

import torch


def best_us(fn, calls=2000, rounds=5):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--profile", help="write torch.profiler's table of 200 forward, then "
                        "autograd.grad calls (host time by op) here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/python_op_parts.py: no CUDA GPU", file=sys.stderr)
        return 1
    import ringattn
    from ringattn import _capi, _ops

    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, 128, 4, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    lib = _capi.library()
    scale = 64 ** -0.5
    o, lse = _ops._forward_impl(q, k, v, None, True, scale, 0, 0, 0, 0, False)
    dout = torch.randn_like(o)
    stream = torch.cuda.current_stream(dev).cuda_stream
    values, packed = _capi.tensor_values, _capi.tensor_bytes

    def params():
        return _capi.FORWARD.pack(*values(q), *values(k), *values(v), *values(o), *values(lse),
                                  scale, 1, 0, 0, 0, *_capi.mask_values(0, 0, None))

    fwd_params = params()
    delta = torch.empty(lse.shape, dtype=torch.float32, device=dev)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    bwd_params = _capi.BACKWARD.pack(
        *values(q), *values(k), *values(v), *values(dout), *values(lse), *values(delta),
        *values(dq), *values(dk), *values(dv), scale, 1, 0, 0, 0, 1, *_capi.NO_TENSOR,
        *_capi.NO_TENSOR, *_capi.mask_values(0, 0, None))
    o_d, dout_d, delta_d, dq_d = packed(o), packed(dout), packed(delta), packed(dq)

    def forward_backward():
        out = ringattn.attention(qg, kg, vg, causal=True)
        out.backward(dout)

    def forward_then_grad():  # no .grad accumulation: the op's own nodes alone
        out = ringattn.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    def backward_impl():  # the backward's Python body on this thread, outside autograd
        _ops._backward_impl(dout, None, q, k, v, o, lse, None, True, scale, 0, 0, 0, 0, False)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def identity_forward_then_grad():  # the engine and one Python node on CUDA, no library
        out = Identity.apply(qg)
        torch.autograd.grad(out, (qg,), dout)

    def sdpa_forward_then_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout.transpose(1, 2))

    def sdpa_forward():
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    def guard():
        with _ops._device(q):
            pass

    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
        parts = [
            ("ringattn.attention forward", lambda: ringattn.attention(q, k, v, causal=True)),
            ("ringattn.attention forward + backward", forward_backward),
            ("SDPA cuDNN forward", sdpa_forward),
            ("ringattn.attention forward, then autograd.grad", forward_then_grad),
            ("SDPA cuDNN forward, then autograd.grad", sdpa_forward_then_grad),
            ("autograd: an identity Function, then autograd.grad", identity_forward_then_grad),
            ("backward: its Python body, called directly", backward_impl),
            ("forward: _check", lambda: _ops._check(q, k, v)),
            ("forward: o and lse allocated", lambda: (torch.empty_like(o), torch.empty_like(lse))),
            ("forward: current stream", lambda: _ops._stream(q)),
            ("forward: device guard", guard),
            ("forward: one descriptor's values", lambda: values(q)),
            ("forward: parameters packed (5 descriptors)", params),
            ("forward: parameters from the call shape's template (what the op does)",
             lambda: _ops._forward_params(q, k, v, o, lse, None, True, scale, 0, 0, 0, 0)),
            ("forward: C API call, prepared", lambda: lib.forward(fwd_params, stream)),
            ("backward: dq allocated (fp32)", lambda: torch.empty(q.shape, dtype=torch.float32,
                                                                  device=dev)),
            ("backward: C API delta pass zeroing dq, prepared",
             lambda: lib.backward_prepare(o_d, dout_d, delta_d, stream, dq=dq_d)),
            ("backward: C API call, prepared", lambda: lib.backward(bwd_params, stream)),
            ("backward: dq rounded", lambda: dq.to(torch.bfloat16)),
            ("forward recording its autograd node (inputs need grad)",
             lambda: ringattn.attention(qg, kg, vg, causal=True)),
            ("SDPA cuDNN forward recording its autograd node", lambda: (
                torch.nn.functional.scaled_dot_product_attention(
                    qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=True))),
        ]
        rows = []
        for name, fn in parts:
            calls = 500 if ("backward" in name and "+" in name) or "grad" in name else 2000
            rows.append({"part": name, "host_us": best_us(fn, calls)})
            print(f"{rows[-1]['host_us']:8.1f} us  {name}", flush=True)
        # The op's two Python bodies timed where autograd runs them (the backward on the engine's
        # device thread), around each call, over forward_then_grad.
        spent = {"_forward_impl": 0.0, "_backward_impl": 0.0}
        originals = {name: getattr(_ops, name) for name in spent}

        def timed(name):
            original = originals[name]

            def call(*a):
                start = time.perf_counter()
                try:
                    return original(*a)
                finally:
                    spent[name] += time.perf_counter() - start
            return call

        for name in spent:
            setattr(_ops, name, timed(name))
        try:
            calls = 2000
            for _ in range(200):
                forward_then_grad()
            torch.cuda.synchronize()
            spent.update({name: 0.0 for name in spent})
            start = time.perf_counter()
            for _ in range(calls):
                forward_then_grad()
            whole = time.perf_counter() - start
            torch.cuda.synchronize()
        finally:
            for name, original in originals.items():
                setattr(_ops, name, original)
        for name, what in (("_forward_impl", "forward: its Python body inside autograd.Function"),
                           ("_backward_impl", "backward: its Python body on the engine's thread")):
            rows.append({"part": what + " (mean over forward, then autograd.grad)",
                         "host_us": spent[name] / calls * 1e6})
            print(f"{rows[-1]['host_us']:8.1f} us  {rows[-1]['part']}", flush=True)
        rows.append({"part": "forward, then autograd.grad, with the two bodies timed (mean)",
                     "host_us": whole / calls * 1e6})
        print(f"{rows[-1]['host_us']:8.1f} us  {rows[-1]['part']}", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(200):
                    forward_then_grad()
                torch.cuda.synchronize()
            with open(args.profile, "w") as f:
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "python_op_parts", "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "shape": "1 x 128 x 4 x 64, causal, bf16",
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
