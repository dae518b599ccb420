"""The local-block benchmark with its comparison, in one run on one GPU.

Runs `ringattn-bench attention` (CUDA events, median) and times PyTorch SDPA's flash
(FlashAttention-2) and cuDNN backends on the same grid the same way, then prints TFLOP/s and
ratios and writes everything to one JSON file.

    python3 bench/attention.py --bench build-gpu/ringattn-bench --out bench/results/attention.json
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


CONFIGURATION = dict(
    dtype="bf16", batch="16384/seq", hidden=2048,
    flops="4*b*h*s^2*d forward (half when causal), backward 2.5x",
    timing="CUDA events, median; every backward returns bf16 dQ, dK and dV (SDPA: "
           "torch.autograd.grad; ringattn: the rowsum(dO*O) pass zeroing the fp32 dQ accumulator, "
           "the block writing dK and dV rounded, dQ rounded); backward_add_ms: ringattn's ring "
           "contract, fp32 gradients zeroed and added into")


def median_ms(fn, warmup=3, repeats=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def time_sdpa(backend, seq, d, causal, dv=None):
    batch, heads, dv = max(1, 16384 // seq), 2048 // d, dv or d
    q, k, v = (torch.randn(batch, heads, seq, width, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for width in (d, d, dv))
    do = torch.randn(batch, heads, seq, dv, device="cuda", dtype=torch.bfloat16)
    repeats = 10 if seq >= 8192 else 20
    with sdpa_kernel([backend]):
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            fwd_ms = median_ms(fwd, repeats=repeats)
        except RuntimeError as error:  # backend does not take this shape
            return None, None, str(error).splitlines()[0]
        out = fwd()

        def bwd():
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        bwd_ms = median_ms(bwd, repeats=repeats)
    return fwd_ms, bwd_ms, None


def tflops(seq, d, causal, ms, factor=1.0, dv=None):
    batch, heads = max(1, 16384 // seq), 2048 // d
    # 2 b h s^2 (d_qk + d_v): S = QK^T and O = PV (4 b h s^2 d where the two agree)
    flop = 2.0 * batch * heads * seq * seq * (d + (dv or d)) * (0.5 if causal else 1.0) * factor
    return flop / (ms * 1e-3) / 1e12 if ms else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", required=True, help="path of ringattn-bench")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128",
                        help="comma-separated head dims D or DQK:DV (Q and K wider than V)")
    parser.add_argument("--revision", default=os.environ.get("RINGATTN_REVISION", "unknown"))
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()

    def run_bench(family=None):
        env = dict(os.environ)
        if family:
            env["RINGATTN_FLASH_FAMILY"] = family
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            subprocess.run([args.bench, "attention", "--seqlens", args.seqlens, "--head-dims",
                            args.head_dims, "--json", tmp.name], check=True, env=env)
            return json.load(open(tmp.name))

    mine = run_bench()
    # The sm_80 kernel family (mma.sync) in the same run: on a Hopper GPU the default is the
    # wgmma family, and these columns say what it gains.
    sm80 = {(r["seq"], r["head_dim"], r.get("v_head_dim", r["head_dim"]), r["causal"]): r
            for r in run_bench("sm80")["rows"]}

    rows = []

    def write(complete):
        # After every row too, so that a run cut short (a device call's time limit) keeps its rows.
        result = dict(benchmark="attention", gpu=torch.cuda.get_device_name(),
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      revision=args.revision, torch=torch.__version__, complete=complete,
                      configuration=CONFIGURATION, rows=rows)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    print(f"\n{'d':>7} {'mask':6} {'seq':>6} | {'ringattn fwd/bwd TF/s':>21} | {'sm80 fwd/bwd':>13} | "
          f"{'FA2 fwd/bwd':>13} | "
          f"{'cuDNN fwd/bwd':>13} | {'x FA2 fwd/bwd':>13} | {'x cuDNN fwd/bwd':>15}")
    for r in mine["rows"]:
        seq, d, causal = r["seq"], r["head_dim"], r["causal"]
        dv = r.get("v_head_dim", d)
        row = dict(r)
        other = sm80.get((seq, d, dv, causal), {})
        row["sm80_forward_tflops"] = other.get("forward_tflops")
        row["sm80_backward_tflops"] = other.get("backward_tflops")
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fwd_ms, bwd_ms, error = time_sdpa(backend, seq, d, causal, dv)
            row[f"{name}_forward_ms"], row[f"{name}_backward_ms"] = fwd_ms, bwd_ms
            row[f"{name}_forward_tflops"] = tflops(seq, d, causal, fwd_ms, dv=dv)
            row[f"{name}_backward_tflops"] = tflops(seq, d, causal, bwd_ms, 2.5, dv)
            row[f"{name}_error"] = error
            row[f"ratio_{name}_forward"] = fwd_ms / r["forward_ms"] if fwd_ms else None
            row[f"ratio_{name}_backward"] = bwd_ms / r["backward_ms"] if bwd_ms else None
        rows.append(row)

        def pair(a, b, width=13, fmt="{:.0f}"):
            text = "/".join("-" if x is None else fmt.format(x) for x in (a, b))
            return f"{text:>{width}}"
        dims = str(d) if dv == d else f"{d}:{dv}"
        print(f"{dims:>7} {'causal' if causal else 'none':6} {seq:6d} | "
              f"{pair(r['forward_tflops'], r['backward_tflops'], 21)} | "
              f"{pair(row['sm80_forward_tflops'], row['sm80_backward_tflops'])} | "
              f"{pair(row['flash_forward_tflops'], row['flash_backward_tflops'])} | "
              f"{pair(row['cudnn_forward_tflops'], row['cudnn_backward_tflops'])} | "
              f"{pair(row['ratio_flash_forward'], row['ratio_flash_backward'], 13, '{:.2f}')} | "
              f"{pair(row['ratio_cudnn_forward'], row['ratio_cudnn_backward'], 15, '{:.2f}')}")
        sys.stdout.flush()
        write(False)

    write(True)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
