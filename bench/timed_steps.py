"""A training run's timed steps on the wall clock, to match against samplers (nvidia-smi's power
in bench/power.py, CUPTI's kernel records in bench/kernel_times.py): from ringattn-train's
metrics.jsonl ("time": the end of each step, Unix seconds) or from a bench/torch_reference.py row
("timed_window_unix", "timed_tokens")."""
import json

WARMUP_STEPS = 3  # the untimed first steps of a ringattn-train run in the benchmarks


def read_metrics(path):
    """The step lines of a metrics.jsonl (those with tokens/s), in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if '"tokens_per_s"' in line]


def ringattn_window(steps):
    """(t0, t1, steps timed): from the end of the last warm-up step to the end of the last step;
    None without a timed step or where a step has no time."""
    if len(steps) <= WARMUP_STEPS or not all("time" in s for s in steps):
        return None
    return steps[WARMUP_STEPS - 1]["time"], steps[-1]["time"], len(steps) - WARMUP_STEPS


def torch_window(row):
    """(t0, t1, steps timed) of a bench/torch_reference.py row; None where it has no window."""
    window = row.get("timed_window_unix")
    if not window or not row.get("timed_tokens"):
        return None
    return window[0], window[1], round(row["timed_tokens"] / (row["seq"] * row["batch"]))
