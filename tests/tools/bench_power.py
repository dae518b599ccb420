"""bench/power.py against samples whose summary is known by construction: two GPUs sampled every
100 ms for 10 s in nvidia-smi's line format (local-time stamps, hexadecimal event reasons), with
lines that are not samples among them; the window's mean power, energy, energy a token, clock and
power-cap share are computed here from the constructed values and compared with the script's
output. A window with too few samples, one the samples do not reach the end of and a GPU never
sampled give no summary.

  python3 tests/tools/bench_power.py bench/power.py
"""
import datetime
import json
import os
import subprocess
import sys
import tempfile

from known_answers import Failures


def stamp(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def main(script):
    base = float(int(datetime.datetime(2026, 12, 2, 12, 0, 0).timestamp()))
    t0, t1, tokens = base + 1.95, base + 6.05, 123456
    lines, inside = ["Failed to initialize NVML: example message"], {0: [], 1: []}
    for k in range(100):
        t = base + 0.1 * k
        watts0 = (500.0 if k % 2 == 0 else 700.0) if t0 <= t <= t1 else 100.0
        mhz0 = 1500.0 + 10 * k
        reasons0 = 0x4 if k % 4 == 0 else 0x1
        watts1, mhz1 = (300.0 if t0 <= t <= t1 else 90.0), 1980.0
        lines.append(f"{stamp(t)}, 0, {watts0:.2f}, {mhz0:.0f}, 0x{reasons0:016x}")
        lines.append(f"{stamp(t)}, 1, {watts1:.2f}, {mhz1:.0f}, 0x0000000000000000")
        if k == 50:
            lines.append(f"{stamp(t)}, 0, [N/A], 1500, 0x0000000000000000")
        if t0 <= t <= t1:
            inside[0].append((watts0, mhz0, reasons0))
            inside[1].append((watts1, mhz1, 0))
    lines.append(f"{stamp(base + 10)}, 0, 6")  # a line cut off when the sampler stopped
    failures = Failures()
    check = failures.check

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "power.csv")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

        def run(gpus, a, b):
            return subprocess.run([sys.executable, script, path, "--gpus", gpus, "--window",
                                   f"{a:.3f}", f"{b:.3f}", "--tokens", str(tokens)],
                                  capture_output=True, text=True)

        for gpus in ([0], [0, 1]):
            r = run(",".join(map(str, gpus)), t0, t1)
            if r.returncode != 0:
                failures.append(f"gpus {gpus}: exit {r.returncode}: {r.stderr.strip()}")
                continue
            got = json.loads(r.stdout)
            watts = sum(sum(s[0] for s in inside[g]) / len(inside[g]) for g in gpus)
            every = [s for g in gpus for s in inside[g]]
            joules = watts * (t1 - t0)
            check(f"gpus {gpus} samples", got["samples"], 41)
            check(f"gpus {gpus} mean_watts", got["mean_watts"], watts, 1e-3)
            check(f"gpus {gpus} joules", got["joules"], joules, 1e-3)
            check(f"gpus {gpus} mj_per_token", got["mj_per_token"], 1e3 * joules / tokens, 1e-3)
            check(f"gpus {gpus} mean_sm_mhz", got["mean_sm_mhz"],
                  round(sum(s[1] for s in every) / len(every)))
            check(f"gpus {gpus} power_cap_share", got["power_cap_share"],
                  sum(1 for s in every if s[2] & 0x4) / len(every), 1e-2)
            print(f"gpus {gpus}: {r.stdout.strip()}")

        # Two samples of each GPU in the window: fewer than the summary needs.
        r = run("0,1", base + 3.05, base + 3.25)
        if r.returncode == 0 or "GPU(s) 0,1" not in r.stderr:
            failures.append(f"a window of two samples: exit {r.returncode}, stderr "
                            f"{r.stderr.strip()!r} (expected a failure naming GPU(s) 0,1)")
        # A window that runs 2 s past the last sample: not covered.
        r = run("0", t0, base + 11.9)
        if r.returncode == 0:
            failures.append("a window past the samples' end: a summary was printed")
        # A GPU that was not sampled.
        r = run("2", t0, t1)
        if r.returncode == 0:
            failures.append("GPU 2, never sampled: a summary was printed")

    return failures.report("bench/power.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
