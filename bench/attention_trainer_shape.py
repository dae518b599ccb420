"""Times the attention calls of one ringattn-train step alone: one causal forward and one
backward of batch 4, 8192 tokens (or --batch, --seq), 8 heads of 128, bf16, through the C API,
with Q/K/V contiguous and as views of a packed QKV row (fp32 gradients in a packed row, as the
trainer has them), and PyTorch SDPA's cuDNN and flash backends on the same shape (--torch).

    python3 bench/attention_trainer_shape.py --lib build-gpu/libringattn.so [--batch B --seq S]
        [--torch] [--json FILE]

"backward kernel" is flash_backward alone (adding into gradients that are not cleared between
runs); "prepare+zero+backward" adds the delta pass and zeroing the gradients, as a single-rank
ring backward did before it wrote dK/dV without zeroing them. PyTorch's backward includes its own
delta pass and dQ conversion. Medians of CUDA-event timings (15 after 3 warm-ups).
"""
import argparse
import ctypes
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import median_ms
from ringattn_ctypes import BackwardParams, ForwardParams, Ringattn, describe

H, D = 8, 128  # the trainer's heads and head size


def stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def calls(ra, packed, B, S):
    """Forward, backward, prepare and prepare + zero + backward of one problem, as functions."""
    if packed:
        qkv = torch.randn(B, S, 3 * H, D, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:2 * H], qkv[:, :, 2 * H:]
        grads = [torch.zeros(B, S, 3 * H, D, device="cuda", dtype=torch.float32)]
        dq, dk, dv = grads[0][:, :, :H], grads[0][:, :, H:2 * H], grads[0][:, :, 2 * H:]
    else:
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        grads = [torch.zeros(B, S, H, D, device="cuda", dtype=torch.float32) for _ in range(3)]
        dq, dk, dv = grads
    o = torch.empty(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, H, S, device="cuda")
    fp = ForwardParams(ctypes.sizeof(ForwardParams), describe(q), describe(k), describe(v),
                       describe(o), describe(lse), 1 / math.sqrt(D), 1, 0, 0, 0)

    def forward():
        ra._check(ra.lib.ringattn_attention_forward(ctypes.byref(fp), stream()))
    forward()
    do = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    delta = torch.empty(B, H, S, device="cuda")
    o_d, do_d, delta_d = describe(o), describe(do), describe(delta)

    def prepare():
        ra._check(ra.lib.ringattn_attention_backward_prepare(
            ctypes.byref(o_d), ctypes.byref(do_d), ctypes.byref(delta_d), stream()))
    prepare()
    bp = BackwardParams(ctypes.sizeof(BackwardParams), describe(q), describe(k), describe(v), do_d,
                        describe(lse), delta_d, describe(dq), describe(dk), describe(dv),
                        1 / math.sqrt(D), 1, 0, 0, 0)

    def backward():
        ra._check(ra.lib.ringattn_attention_backward(ctypes.byref(bp), stream()))

    def whole():
        prepare()
        for g in grads:
            g.zero_()
        backward()
    return forward, backward, prepare, whole


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", required=True)
    parser.add_argument("--torch", action="store_true", help="also time PyTorch SDPA")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--json")
    args = parser.parse_args()
    B, S = args.batch, args.seq
    FLOP_FORWARD = 4.0 * B * H * S * S * D * 0.5
    FLOP_BACKWARD = 2.5 * FLOP_FORWARD
    ra = Ringattn(args.lib)
    results = {"gpu": torch.cuda.get_device_name(), "shape": [B, S, H, D], "causal": True, "ms": {}}

    def report(name, ms, flop):
        results["ms"][name] = ms
        print(f"{name:44s} {ms:8.3f} ms  {flop / ms / 1e9:7.1f} TFLOP/s", flush=True)

    for packed in (False, True):
        tag = "packed" if packed else "contiguous"
        forward, backward, prepare, whole = calls(ra, packed, B, S)
        report(f"{tag} forward", median_ms(forward, 3, 15), FLOP_FORWARD)
        report(f"{tag} backward kernel", median_ms(backward, 3, 15), FLOP_BACKWARD)
        report(f"{tag} prepare", median_ms(prepare, 3, 15), FLOP_BACKWARD)
        report(f"{tag} prepare+zero+backward", median_ms(whole, 3, 15), FLOP_BACKWARD)
        torch.cuda.empty_cache()
    if args.torch:
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            with sdpa_kernel([backend]):
                def forward():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                report(f"torch {backend.name} forward", median_ms(forward, 3, 15), FLOP_FORWARD)
                out = forward()

                def backward():
                    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                report(f"torch {backend.name} backward", median_ms(backward, 3, 15), FLOP_BACKWARD)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
