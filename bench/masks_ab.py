"""Side-by-side timing of two or more builds of ringattn's CUDA block on bench/masks.py's masks, in
one process on one GPU: each library (a libringattn.so) is loaded through the C API (bench's
ringattn_ctypes) and called on the same bf16 inputs, the libraries taking turns for --rounds
rounds so that they share the GPU's state. Masks: causal; causal with a window; causal within
packed documents (bench/masks.py's log-normal draw); documents and the window. Times (CUDA
events, median of 10 calls): the forward, and the backward alone (its delta pass that zeroes
dQ's accumulator, then the backward call; buffers made once), beside the delta pass alone. TFLOP/s count the visible pairs
(4 pairs d forward, 2.5x that backward); ratios are to the first library's mean.

Before timing, each library's O, LSE, dK and dV are compared with the first library's (max
|difference|, and whether they are bitwise equal): builds that classify the tiles alike and do
the same arithmetic give equal O, LSE, dK and dV (dQ's fp32 additions may come in another order).

    python3 bench/masks_ab.py --libraries A/libringattn.so B/libringattn.so [--json FILE]
"""
import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch

from masks import median_ms, problem, visible_pairs
from ringattn_ctypes import BackwardParams, Ringattn, describe


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", nargs="+", required=True)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--doc-mean", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (f32) to try the script")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("bench/masks_ab.py: no CUDA GPU", file=sys.stderr)
        return 1
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    libraries = [Ringattn(path) for path in args.libraries]
    seq, heads, d = args.seq, args.heads, args.head_dim
    (q, k, v, do), starts, starts_t, masks = problem(seq, heads, d, args.window, args.doc_mean,
                                                     device, dtype)
    scale = 1.0 / math.sqrt(d)
    print(f"seq {seq}, heads {heads}, head_dim {d}, {dtype}, {len(starts) + 1} documents; "
          f"{len(libraries)} libraries, {args.rounds} rounds; TFLOP/s of visible pairs")
    rows = []
    failed = False
    for name, window, documents in masks:
        pairs = visible_pairs(seq, True, window, starts if documents else [])
        kw = dict(causal=True, window=(window, 0) if window else None,
                  document_starts=starts_t if documents else None)
        calls, first = [], None
        for ra in libraries:
            o, lse = ra.forward(q, k, v, **kw)
            dq, dk, dv = ra.backward(q, k, v, o, lse, do, **kw)
            outputs = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
            if first is None:
                first = outputs
            comparison = {}
            for key, value in outputs.items():
                diff = (value.float() - first[key].float()).abs().max().item()
                comparison[key] = dict(max_abs_difference=diff,
                                       bitwise_equal=bool(torch.equal(value, first[key])))
            if any(not comparison[key]["bitwise_equal"] for key in ("o", "lse", "dk", "dv")):
                failed = True
            # The backward's buffers once; each timed call runs the delta pass (zeroing dQ) and
            # the backward, as ringattn.attention's backward does.
            delta = torch.empty_like(lse)
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=device)
            dk_acc, dv_acc = torch.empty_like(dq_acc), torch.empty_like(dq_acc)
            o_d, do_d, delta_d, dq_d = describe(o), describe(do), describe(delta), describe(dq_acc)
            params = BackwardParams(q=describe(q), k=describe(k), v=describe(v), dout=do_d,
                                    lse=describe(lse), delta=delta_d, dq=dq_d,
                                    dk=describe(dk_acc), dv=describe(dv_acc), scale=scale,
                                    causal=1, deterministic=0, q_start=0, k_start=0,
                                    **ra._mask(kw["window"], kw["document_starts"]))
            stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else None

            # (The descriptors hold raw pointers: the calls keep their tensors alive.)
            def prepare(ra=ra, o_d=o_d, do_d=do_d, delta_d=delta_d, dq_d=dq_d, stream=stream,
                        tensors=(o, lse, delta, dq_acc, dk_acc, dv_acc)):
                ra.library.backward_prepare(o_d, do_d, delta_d, stream, dq=dq_d)

            def backward(ra=ra, prepare=prepare, params=params, stream=stream):
                prepare()
                ra.library.backward(params, stream)

            calls.append((lambda ra=ra: ra.forward(q, k, v, **kw), backward, prepare, comparison))
        forward_ms = [[] for _ in libraries]
        backward_ms = [[] for _ in libraries]
        prepare_ms = [[] for _ in libraries]
        for _ in range(args.rounds):
            for i, (forward, backward, prepare, _) in enumerate(calls):
                forward_ms[i].append(median_ms(forward, device))
                backward_ms[i].append(median_ms(backward, device))
                prepare_ms[i].append(median_ms(prepare, device))
        flop_f = 4.0 * pairs * d * heads
        flop_b = 2.5 * flop_f
        base_f, base_b = statistics.mean(forward_ms[0]), statistics.mean(backward_ms[0])
        for i, path in enumerate(args.libraries):
            mean_f, mean_b = statistics.mean(forward_ms[i]), statistics.mean(backward_ms[i])
            row = dict(mask=name, library=path, visible_pairs=pairs, forward_ms=forward_ms[i],
                       backward_ms=backward_ms[i], delta_pass_ms=prepare_ms[i],
                       forward_tflops=flop_f / mean_f / 1e9,
                       backward_tflops=flop_b / mean_b / 1e9,
                       forward_speedup=base_f / mean_f, backward_speedup=base_b / mean_b,
                       forward_backward_speedup=(base_f + base_b) / (mean_f + mean_b),
                       against_first=calls[i][3])
            rows.append(row)
            equal = "".join(key if calls[i][3][key]["bitwise_equal"] else "-"
                            for key in ("o", "lse", "dk", "dv"))
            print(f"{name:36} lib {i}  fwd {mean_f:7.3f} ms {row['forward_tflops']:5.0f} TF/s "
                  f"x{row['forward_speedup']:.3f} | bwd {mean_b:7.3f} ms "
                  f"{row['backward_tflops']:5.0f} TF/s x{row['backward_speedup']:.3f} "
                  f"(delta pass {statistics.mean(prepare_ms[i]):.3f} ms) | "
                  f"f+b x{row['forward_backward_speedup']:.3f} | equal to lib 0: {equal} "
                  f"(dq {calls[i][3]['dq']['max_abs_difference']:.2e})")
        sys.stdout.flush()
    if args.json:
        result = dict(benchmark="masks_ab",
                      gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                          timespec="seconds"),
                      revision=os.environ.get("RINGATTN_REVISION", "unknown"),
                      configuration=dict(seq=seq, heads=heads, head_dim=d, dtype=str(dtype),
                                         documents=len(starts) + 1, window=args.window,
                                         rounds=args.rounds,
                                         timing="CUDA events, median of 10 a round"),
                      libraries=args.libraries, rows=rows)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if failed:
        print("bench/masks_ab.py: a library's O, LSE, dK or dV differs from the first's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
