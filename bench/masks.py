"""Sliding windows and packed documents on one GPU: ringattn against FlexAttention, same run.

For each mask (causal; a causal window; packed documents of log-normal lengths; both) times the
forward and the forward + backward of `ringattn.attention` (the Python package over the C API)
and of PyTorch's FlexAttention (torch.compile'd, with the block mask built once outside the
timing), on the same bf16 inputs, and the dense causal SDPA (cuDNN) for scale. TFLOP/s count the
visible (query, key) pairs of each mask exactly (4 * pairs * head_dim forward, 2.5x backward), so
a kernel whose cost follows the visible work keeps its rate as the mask thins. Checks O of both
against each other first (bf16: max |difference| <= 2e-2).

    python3 bench/masks.py --out bench/results/masks.json [--seq 32768] [--device cuda]
"""
import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import ringattn  # noqa: E402


def median_ms(fn, device, warmup=3, repeats=10):
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def lognormal_starts(seq, mean, seed):
    """Document starts (global positions, first 0 left out) of log-normal lengths, sigma 1."""
    gen = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - 0.5
    starts, position = [], 0
    while True:
        length = max(1, int(torch.empty(1).log_normal_(mu, 1.0, generator=gen).item()))
        position += length
        if position >= seq:
            return starts
        starts.append(position)


def problem(seq, heads, d, window, doc_mean, device, dtype):
    """The inputs both this script and bench/masks_ab.py time: q, k, v and dO [1, seq, heads, d]
    (seed 5), the document starts (a list, and int64 on the device), and the masks as
    (name, causal window or 0, documents or not)."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    q, k, v, do = (torch.randn(1, seq, heads, d, generator=gen).to(device, dtype) for _ in range(4))
    starts = lognormal_starts(seq, doc_mean, 1)
    starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
    masks = [("causal", 0, False), (f"causal window {window}", window, False),
             (f"causal documents (mean {doc_mean})", 0, True),
             (f"causal documents + window {window}", window, True)]
    return (q, k, v, do), starts, starts_t, masks


def flex_mask_mod(window, doc_id):
    """FlexAttention's mask_mod of a causal mask with a window (0: none) and documents (doc_id:
    each position's document, None: one document), written from the definition."""
    def mask_mod(b, h, qi, ki):
        keep = ki <= qi
        if window:
            keep = keep & (qi - ki < window)
        if doc_id is not None:
            keep = keep & (doc_id[qi] == doc_id[ki])
        return keep
    return mask_mod


def visible_pairs(seq, causal, window, starts):
    """The (query, key) pairs the mask lets through, counted row by row."""
    bounds = starts + [seq]
    doc_start, doc_end, d = [0] * seq, [seq] * seq, 0
    begin = 0
    for end in bounds:
        for i in range(begin, end):
            doc_start[i], doc_end[i] = begin, end
        begin = end
    total = 0
    for i in range(seq):
        lo, hi = doc_start[i], doc_end[i]
        if causal:
            hi = min(hi, i + 1)
        if window:
            lo = max(lo, i - window + 1)
        total += max(0, hi - lo)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--doc-mean", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seq, heads, d = args.seq, args.heads, args.head_dim
    (q, k, v, do), starts, starts_t, masks = problem(seq, heads, d, args.window, args.doc_mean,
                                                     device, dtype)
    doc_id = torch.zeros(seq, dtype=torch.int64, device=device)
    if starts:
        doc_id[starts_t] = 1
        doc_id = doc_id.cumsum(0)
    rows = []
    print(f"seq {seq}, heads {heads}, head_dim {d}, {dtype}, {len(starts) + 1} documents; "
          f"TFLOP/s of visible pairs (4 pairs d forward, 2.5x backward)")
    print(f"{'mask':42} {'visible':>8} | {'ringattn fwd / f+b ms':>22} | {'flex fwd / f+b ms':>18} | "
          f"{'ringattn TF/s':>14} | {'flex TF/s':>11} | {'x flex fwd / f+b':>16}")
    for name, window, documents in masks:
        pairs = visible_pairs(seq, True, window, starts if documents else [])

        mask_mod = flex_mask_mod(window, doc_id if documents else None)
        # A fresh compile for each mask: its mask_mod is traced into the kernel.
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = create_block_mask(mask_mod, None, None, seq, seq, device=device)
        qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2).contiguous()
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        kw = dict(causal=True, window=(window, None) if window else None,
                  document_starts=starts_t if documents else None)

        def ring_fwd():
            with torch.no_grad():
                return ringattn.attention(qr, kr, vr, **kw)

        def ring_fb():
            o = ringattn.attention(qr, kr, vr, **kw)
            torch.autograd.grad(o, (qr, kr, vr), do)

        def flex_fwd():
            with torch.no_grad():
                return flex(qt.detach(), kt.detach(), vt.detach(), block_mask=block_mask)

        def flex_fb():
            o = flex(qt, kt, vt, block_mask=block_mask)
            torch.autograd.grad(o, (qt, kt, vt), dot)

        difference = (ring_fwd().float() - flex_fwd().transpose(1, 2).float()).abs().max().item()
        if not difference <= 2e-2:
            print(f"{name}: ringattn and FlexAttention differ by {difference}")
            sys.exit(1)
        r_f, r_fb = median_ms(ring_fwd, device), median_ms(ring_fb, device)
        f_f = median_ms(flex_fwd, device)
        f_fb = median_ms(flex_fb, device) if device == "cuda" else float("nan")  # no CPU backward
        flop_f, flop_fb = 4.0 * pairs * d * heads, 4.0 * pairs * d * heads * 3.5
        row = dict(mask=name, visible_pairs=pairs, ringattn_forward_ms=r_f,
                   ringattn_forward_backward_ms=r_fb, flex_forward_ms=f_f,
                   flex_forward_backward_ms=f_fb, max_abs_difference=difference,
                   ringattn_forward_tflops=flop_f / r_f / 1e9,
                   ringattn_forward_backward_tflops=flop_fb / r_fb / 1e9,
                   flex_forward_tflops=flop_f / f_f / 1e9,
                   flex_forward_backward_tflops=flop_fb / f_fb / 1e9,
                   ratio_forward=f_f / r_f, ratio_forward_backward=f_fb / r_fb)
        rows.append(row)
        print(f"{name:42} {pairs / seq / seq:8.4f} | {r_f:9.3f} / {r_fb:9.3f} | "
              f"{f_f:7.3f} / {f_fb:8.3f} | {row['ringattn_forward_tflops']:5.0f} / "
              f"{row['ringattn_forward_backward_tflops']:5.0f} | {row['flex_forward_tflops']:4.0f} / "
              f"{row['flex_forward_backward_tflops']:4.0f} | {row['ratio_forward']:7.2f} / "
              f"{row['ratio_forward_backward']:6.2f}")
        sys.stdout.flush()

    result = dict(benchmark="masks", gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  revision=os.environ.get("RINGATTN_REVISION", "unknown"), torch=torch.__version__,
                  configuration=dict(seq=seq, heads=heads, head_dim=d, dtype=str(dtype),
                                     documents=len(starts) + 1, window=args.window,
                                     timing="CUDA events, median of 10; forward + backward through "
                                            "autograd for both"),
                  rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
