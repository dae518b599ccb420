"""GPU power over a run's timed steps, from the samples `bench/trainer.sh` takes with nvidia-smi.

Where the GPU runs at its power cap (an H200's 700 W through a long-context training step), its
clock follows the power it draws, and tokens/s follows the energy each token takes: this gives
that energy, mean power, the SM clock and how often the cap held it.

The samples file holds nvidia-smi's lines of

  nvidia-smi --query-gpu=timestamp,index,power.draw,clocks.sm,clocks_event_reasons.active \\
             --format=csv,noheader,nounits -lms 100

(the timestamp in the machine's local time, as nvidia-smi writes it). A window is two Unix times
(seconds) from the same machine: ringattn-train's metrics.jsonl "time" of the step before the
first timed one and of the last, or bench/torch_reference.py's "timed_window_unix".

  python3 bench/power.py SAMPLES --gpus 0[,1...] --window T0 T1 --tokens N   prints the JSON
"""
import argparse
import datetime
import json
import sys

SW_POWER_CAP = 0x4  # clocks_event_reasons: the clock held down by the power limit
MIN_SAMPLES = 3  # per GPU, for a summary
EDGE_SECONDS = 0.35  # the most time without a sample at either end of the window (100 ms sampling)


def read_samples(path):
    """The samples as (unix time, gpu index, watts, sm MHz, event reasons); lines that are not
    samples (a message, a cut last line, "[N/A]") are skipped."""
    samples = []
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            if len(fields) != 5:
                continue
            try:
                t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((t, int(fields[1]), float(fields[2]), float(fields[3]),
                                int(fields[4], 16)))
            except ValueError:
                continue
    return samples


def window_summary(samples, gpus, t0, t1, tokens):
    """The GPUs' power between Unix times t0 and t1 for `tokens` tokens: their summed mean power,
    the energy (that power over the window), millijoules a token, the mean SM clock and the share
    of samples with the power cap active; None when t1 <= t0, or a GPU has fewer than MIN_SAMPLES
    samples in the window or none within EDGE_SECONDS of one of its ends (the samples do not
    cover it)."""
    if not t1 > t0 or tokens <= 0:
        return None
    per_gpu = {g: [s for s in samples if s[1] == g and t0 <= s[0] <= t1] for g in gpus}
    if not gpus or any(len(v) < MIN_SAMPLES or min(s[0] for s in v) > t0 + EDGE_SECONDS
                       or max(s[0] for s in v) < t1 - EDGE_SECONDS for v in per_gpu.values()):
        return None
    watts = sum(sum(s[2] for s in v) / len(v) for v in per_gpu.values())
    every = [s for v in per_gpu.values() for s in v]
    joules = watts * (t1 - t0)
    return {"gpus": list(gpus), "seconds": round(t1 - t0, 3),
            "samples": min(len(v) for v in per_gpu.values()),
            "mean_watts": round(watts, 1), "joules": round(joules, 2),
            "mj_per_token": round(1e3 * joules / tokens, 4),
            "mean_sm_mhz": round(sum(s[3] for s in every) / len(every)),
            "power_cap_share": round(sum(1 for s in every if s[4] & SW_POWER_CAP) / len(every),
                                     3)}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("samples")
    p.add_argument("--gpus", required=True, help="comma-separated nvidia-smi indices")
    p.add_argument("--window", nargs=2, type=float, required=True, metavar=("T0", "T1"))
    p.add_argument("--tokens", type=float, required=True)
    a = p.parse_args(argv)
    gpus = [int(x) for x in a.gpus.split(",")]
    summary = window_summary(read_samples(a.samples), gpus, a.window[0], a.window[1], a.tokens)
    if summary is None:
        print(f"bench/power.py: no summary: the samples of GPU(s) {a.gpus} do not cover "
              f"{a.window[0]:.3f}-{a.window[1]:.3f} (at least {MIN_SAMPLES} each, one within "
              f"{EDGE_SECONDS} s of either end), or the window is empty", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
