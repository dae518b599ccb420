"""bench/trainer.sh's results: its ringattn-train runs and PyTorch's, one row a shape, into JSON.

  python3 bench/trainer_results.py RUNS OUTDIR OUT_JSON VISIBLE_GPUS POWER_CSV

RUNS holds one directory per ringattn-train run, named GPUSgpu-SEQxBATCH, or GPUSgpu-SEQxBATCH.rN
for round N of several (TRAINER_ROUNDS), each with its metrics.jsonl. OUTDIR holds PyTorch's
results, trainer_torch-SEQxBATCH.json or trainer_torch-SEQxBATCH.rN.json
(bench/torch_reference.py --json). A run's tokens/s and MFU are the medians over its steps after
the first 3, its energy a token comes from the power samples over those steps (bench/power.py),
and its ratio is to PyTorch's tokens/s of the same shape and round. With several rounds a row's
numbers are the medians of its rounds' (its ratio the median of the rounds' ratios, peak memory
the largest, the final loss the last round's), and "rounds" lists each round's row.
"""
import datetime
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import power
from timed_steps import WARMUP_STEPS, read_metrics, ringattn_window, torch_window

RUN_NAME = re.compile(r"^(\d+)gpu-(\d+)x(\d+)(?:\.r(\d+))?$")
TORCH_NAME = re.compile(r"^trainer_torch-(\d+)x(\d+)(?:\.r(\d+))?\.json$")
# Over rounds: the largest (memory), the last round's (the rest that is not a median).
LARGEST = {"peak_memory_mib", "peak_mib"}
LAST = {"final_loss", "run", "gpus", "seq", "batch", "status", "recompute"}


def combine(rows, top=True):
    """One row from the rounds' rows of a shape (see the module's text); a single row as it is."""
    if len(rows) == 1:
        return rows[0]
    out = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        values = [r[key] for r in rows if r.get(key) is not None]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if not values:
            out[key] = None
        elif all(isinstance(v, dict) for v in values):
            out[key] = combine(values, top=False)
        elif key in LARGEST and numbers:
            out[key] = max(values)
        elif key in LAST or not numbers:
            out[key] = values[-1]
        else:
            out[key] = statistics.median(values)
    if top:
        out["rounds"] = rows
    return out


def run_row(name, steps, torch_row, energy):
    """A ringattn-train run's row from its metrics.jsonl lines (with tokens/s) and PyTorch's row
    of the same shape and round (or None); energy(gpus, window, tokens) gives a power summary."""
    gpus, seq, batch = (int(x) for x in RUN_NAME.match(name).group(1, 2, 3))
    row = {"run": name, "gpus": gpus, "seq": seq, "batch": batch, "steps": len(steps)}
    timed = steps[WARMUP_STEPS:] or steps
    if timed:
        row["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in timed)
        row["mfu"] = statistics.median(s.get("mfu", 0.0) or 0.0 for s in timed)
        row["peak_memory_mib"] = max(s["peak_memory_mib"] for s in steps)
        row["final_loss"] = steps[-1]["loss"]
        window = ringattn_window(steps)
        if window is not None:
            row["power"] = energy(gpus, window[:2], seq * batch * window[2])
    if torch_row is not None:
        t = torch_row
        row["torch"] = {k: t.get(k) for k in ("tokens_per_s", "mfu", "peak_mib", "status",
                                              "recompute")}
        window = torch_window(t)
        row["torch"]["power"] = energy(1, window[:2], t["timed_tokens"]) if window else None
        if t.get("tokens_per_s") and row.get("tokens_per_s"):
            # per GPU for the ring runs: PyTorch runs the whole sequence on one GPU
            row["ratio_to_torch"] = row["tokens_per_s"] / t["tokens_per_s"]
    return row


def describe(row):
    mj = lambda p: f" {p['mj_per_token']:.2f} mJ/token" if p else ""
    line = (f"{row['run']:>18}: {row.get('tokens_per_s', 0):>10.0f} tokens/s  "
            f"mfu {100 * row.get('mfu', 0):5.1f}%  peak {row.get('peak_memory_mib', 0):8.0f} MiB"
            + mj(row.get("power")))
    if "ratio_to_torch" in row:
        line += (f"  torch {row['torch']['tokens_per_s']:.0f} tokens/s"
                 f"{mj(row['torch'].get('power'))}  ratio {row['ratio_to_torch']:.3f}")
    if "rounds" in row:
        ratios = [f"{r['ratio_to_torch']:.3f}" for r in row["rounds"] if "ratio_to_torch" in r]
        line += f"  (median of {len(row['rounds'])} rounds"
        line += f", ratios {' '.join(ratios)})" if ratios else ")"
    return line


def main(argv):
    runs, out_dir, out_path, visible, power_csv = argv
    samples = power.read_samples(power_csv) if os.path.isfile(power_csv) else []
    # The nvidia-smi indices of the GPUs the runs use, in CUDA's order (a run on k GPUs uses the
    # first k): 0, 1, ...; or CUDA_VISIBLE_DEVICES's list, unless it names GPUs otherwise (UUIDs).
    indices = list(range(int(visible)))
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        listed = [x.strip() for x in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
        indices = [int(x) for x in listed] if all(x.isdigit() for x in listed) else None

    def energy(count, window, tokens):
        if not samples or indices is None or count > len(indices):
            return None
        return power.window_summary(samples, indices[:count], window[0], window[1], tokens)

    torch = {}  # (seq, batch, round) -> PyTorch's row
    for path in sorted(glob.glob(os.path.join(out_dir, "trainer_torch-*.json"))):
        m = TORCH_NAME.match(os.path.basename(path))
        if m is None:
            continue
        for r in json.load(open(path)).get("results", []):
            torch[(r["seq"], r["batch"], int(m.group(3) or 1))] = r
    shapes = {}  # the run's name without its round -> [(round, row)]
    for name in sorted(os.listdir(runs)):
        m = RUN_NAME.match(name)
        path = os.path.join(runs, name, "metrics.jsonl")
        if m is None or not os.path.isfile(path):
            continue
        steps = read_metrics(path)
        round_ = int(m.group(4) or 1)
        row = run_row(name, steps, torch.get((int(m.group(2)), int(m.group(3)), round_)), energy)
        shapes.setdefault(name.split(".r")[0], []).append((round_, row))
    results = []
    for key in sorted(shapes):
        row = combine([r for _, r in sorted(shapes[key], key=lambda x: x[0])])
        row["run"] = key  # also where one round is left of several
        results.append(row)
        print(describe(row))
    rev = os.environ.get("RINGATTN_REVISION") or subprocess.run(
        ["tools/revision.sh"], capture_output=True, text=True).stdout.strip()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines() \
        if shutil.which("nvidia-smi") else []
    with open(out_path, "w") as f:
        json.dump({"gpu": gpu[0] if gpu else "", "gpus": int(visible),
                   "date": datetime.date.today().isoformat(), "revision": rev,
                   "config": "configs/small-32k.yaml on synthetic tokens",
                   # How mpiexec bound the ranks (bench/launch_env.sh leaves them unbound).
                   "mpi_binding": os.environ.get("OMPI_MCA_hwloc_base_binding_policy")
                   or "OpenMPI's default",
                   "results": results},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
