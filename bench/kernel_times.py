"""Kernel time per step of a training run, from libringattn_kernel_times.so's records.

The CSV files (tools/cuda/kernel_times.cpp: "unix_start,unix_end,device,stream,name") hold every
kernel of a process, and its memsets and copies ("[memset]", "[memcpy HtoD]", ...), which count as
a part of their own. The records that start within a run's timed window count: given directly, or
taken from ringattn-train's metrics.jsonl (the end of the last warm-up step to the end of the last
step) or from bench/torch_reference.py's JSON row (its timed_window_unix). Per step it gives the
kernels' summed time by part (attention backward, attention forward, GEMMs, the rest) and by
kernel, the time the GPU ran any kernel (the union of their spans) and the window's length, so
that two trainers are compared with one measurement.

  python3 bench/kernel_times.py summary CSV... (--window T0 T1 --steps N | --metrics METRICS.jsonl
      | --torch-json TORCH.json) [--label NAME] [--json OUT]
  python3 bench/kernel_times.py compare A.json B.json    the two summaries' parts side by side
"""
import argparse
import csv
import json
import re
import sys

import timed_steps

# The first pattern a kernel's name matches names its part (case-insensitive).
PARTS = [
    ("memset.memcpy", r"^\[mem(set|cpy)"),
    ("attention.backward",
     r"flash_backward|flash_dq|bprop|flash_bwd|fmha.*bwd|dot_do_o|convert_dq"),
    ("attention.forward", r"flash_forward|fprop|flash_fwd|fmha|sdpa|flash_attn"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|cublas"),
    ("other", r""),
]


def part_of(name):
    for part, pattern in PARTS:
        if re.search(pattern, name, re.IGNORECASE):
            return part
    return "other"


def read_kernels(paths):
    """(start, end, name) of every kernel in the files, Unix seconds; malformed lines skipped."""
    kernels = []
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.reader(f):
                if len(row) != 5:
                    continue
                try:  # the header and cut lines are not numbers
                    kernels.append((float(row[0]), float(row[1]), row[4]))
                except ValueError:
                    continue
    return kernels


def union_seconds(spans):
    """The length of the union of (start, end) spans."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def summarize(kernels, t0, t1, steps, top=15):
    """The per-step figures of the kernels that start in [t0, t1); None when the window is empty
    or holds no kernel."""
    inside = [k for k in kernels if t0 <= k[0] < t1]
    if not t1 > t0 or steps <= 0 or not inside:
        return None
    per_step = lambda seconds: round(1e3 * seconds / steps, 4)
    parts = {part: 0.0 for part, _ in PARTS}
    names = {}
    for start, end, name in inside:
        parts[part_of(name)] += end - start
        entry = names.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    ranked = sorted(names.items(), key=lambda item: -item[1][1])[:top]
    return {"window": [round(t0, 6), round(t1, 6)], "steps": steps,
            "step_ms": per_step(t1 - t0),
            "busy_ms_per_step": per_step(union_seconds([(s, e) for s, e, _ in inside])),
            "kernel_ms_per_step": per_step(sum(e - s for s, e, _ in inside)),
            "kernels_per_step": round(len(inside) / steps, 2),
            "parts_ms_per_step": {part: per_step(seconds) for part, seconds in parts.items()},
            "top": [{"name": name, "part": part_of(name),
                     "launches_per_step": round(n / steps, 2), "ms_per_step": per_step(seconds)}
                    for name, (n, seconds) in ranked]}


def metrics_window(path):
    """ringattn-train's timed window and step count from its metrics.jsonl."""
    window = timed_steps.ringattn_window(timed_steps.read_metrics(path))
    if window is None:
        raise SystemExit(f"bench/kernel_times.py: {path} has no timed step with a time (more "
                         f"than {timed_steps.WARMUP_STEPS} steps, each with \"time\")")
    return window


def torch_window(path):
    """bench/torch_reference.py's timed window and step count from its JSON (its first row with
    one)."""
    for row in json.load(open(path)).get("results", []):
        window = timed_steps.torch_window(row)
        if window is not None:
            return window
    raise SystemExit(f"bench/kernel_times.py: {path} has no row with timed_window_unix")


def show(label, s):
    print(f"{label}: {s['steps']} steps of {s['step_ms']:.2f} ms; kernels, memsets and copies "
          f"{s['kernel_ms_per_step']:.2f} ms a step ({s['kernels_per_step']:.0f} records), "
          f"GPU busy {s['busy_ms_per_step']:.2f} ms")
    for part, ms in s["parts_ms_per_step"].items():
        print(f"  {part:<20} {ms:10.3f} ms")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("summary")
    a.add_argument("csv", nargs="+")
    a.add_argument("--window", nargs=2, type=float, metavar=("T0", "T1"))
    a.add_argument("--steps", type=int)
    a.add_argument("--metrics")
    a.add_argument("--torch-json")
    a.add_argument("--label", default="run")
    a.add_argument("--top", type=int, default=15)
    a.add_argument("--json")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.command == "compare":
        x, y = json.load(open(args.a)), json.load(open(args.b))
        # The parts, then the totals: the same rows for both summaries.
        # (summaries written before memsets and copies were recorded lack their part: "-").
        rows = lambda s: dict(s["parts_ms_per_step"], **{"all GPU work": s["kernel_ms_per_step"],
                                                         "GPU busy": s["busy_ms_per_step"],
                                                         "step": s["step_ms"]})
        print(f"{'ms a step':<20} {x['label']:>12} {y['label']:>12} {'difference':>11}")
        ours, theirs = rows(x), rows(y)
        for name in list(ours) + [n for n in theirs if n not in ours]:
            a, b = ours.get(name), theirs.get(name)
            cell = lambda v: f"{v:12.3f}" if v is not None else f"{'-':>12}"
            diff = f"{a - b:+11.3f}" if a is not None and b is not None else f"{'-':>11}"
            print(f"{name:<20} {cell(a)} {cell(b)} {diff}")
        return 0
    sources = [args.window is not None, args.metrics is not None, args.torch_json is not None]
    if sum(sources) != 1 or (args.window is not None and not args.steps):
        p.error("give one of --window T0 T1 with --steps N, --metrics or --torch-json")
    if args.metrics:
        t0, t1, steps = metrics_window(args.metrics)
    elif args.torch_json:
        t0, t1, steps = torch_window(args.torch_json)
    else:
        (t0, t1), steps = args.window, args.steps
    s = summarize(read_kernels(args.csv), t0, t1, steps, args.top)
    if s is None:
        print(f"bench/kernel_times.py: no kernel of {', '.join(args.csv)} starts within "
              f"{t0:.3f}-{t1:.3f}", file=sys.stderr)
        return 1
    s["label"] = args.label
    show(args.label, s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
