"""ringattn's CUDA block against PyTorch on the same inputs, through the C API.

For each case, O and dQ/dK/dV of ringattn (bf16 inputs) and of bf16 SDPA are compared with SDPA in
fp64 on the same (rounded) inputs. ringattn passes when its error is at most twice bf16 SDPA's own
error plus 1e-5 (the FlashAttention criterion with PyTorch as the low-precision baseline).

    python3 bench/compare_torch.py --lib build-gpu/libringattn.so [--json FILE]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

from ringattn_ctypes import Ringattn


def sdpa(q, k, v, causal):
    # SDPA wants [B, H, S, D]; GQA through enable_gqa.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def grads(q, k, v, do, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = sdpa(q, k, v, causal)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True)
    parser.add_argument("--json")
    args = parser.parse_args()
    ra = Ringattn(args.lib)
    torch.manual_seed(torch.seed())
    cases = [(2, 1000, 8, 2, 64, False), (2, 1000, 8, 2, 64, True), (1, 2048, 16, 16, 128, True),
             (1, 4097, 8, 1, 128, False), (4, 127, 4, 4, 128, True)]
    rows, ok = [], True
    print(f"{'case':34} {'out':3} {'ringattn err':>12} {'bf16 SDPA err':>13} {'bound':>10}  verdict")
    for b, s, hq, hkv, d, causal in cases:
        q = torch.randn(b, s, hq, d, device="cuda").bfloat16()
        k = torch.randn(b, s, hkv, d, device="cuda").bfloat16()
        v = torch.randn(b, s, hkv, d, device="cuda").bfloat16()
        do = torch.randn(b, s, hq, d, device="cuda").bfloat16()
        ref = grads(q.double(), k.double(), v.double(), do.double(), causal)
        low = grads(q, k, v, do, causal)
        o, lse = ra.forward(q, k, v, causal=causal)
        mine = (o,) + ra.backward(q, k, v, o, lse, do, causal=causal)
        torch.cuda.synchronize()
        name = f"b{b} s{s} h{hq}/{hkv} d{d} {'causal' if causal else 'full'}"
        for label, x, lo, r in zip(("O", "dQ", "dK", "dV"), mine, low, ref):
            err = (x.double() - r).abs().max().item()
            low_err = (lo.double() - r).abs().max().item()
            bound = 2 * low_err + 1e-5
            passed = err <= bound
            ok &= passed
            rows.append(dict(case=name, output=label, ringattn_error=err, sdpa_bf16_error=low_err,
                             bound=bound, passed=passed))
            print(f"{name:34} {label:3} {err:12.3e} {low_err:13.3e} {bound:10.3e}  {'ok' if passed else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="compare_torch", gpu=torch.cuda.get_device_name(),
                           torch=torch.__version__, ringattn=ra.version(), rows=rows), f, indent=1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
