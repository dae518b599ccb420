"""bench/trainer_results.py against runs whose results are known by construction.

Three shapes: 32768x1 over three rounds, 8192x4 in one, 131072x1 with one round left of two.
Each round's ringattn-train steps have tokens/s chosen here (the first three, the warm-up, far
off), PyTorch's rows their own (round 2 of 32k has none), and one GPU draws a constant power
through the samples. The expected medians,
ratios, energy a token and the row of a single round are computed here from those values and
compared with the script's JSON. The ratio of the rounds' medians differs from the median of the
rounds' ratios here, so taking the wrong one fails.

  python3 tests/tools/bench_trainer_results.py bench/trainer_results.py
"""
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

from known_answers import Failures

WATTS = 650.0


def stamp(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def write_run(runs, name, tokens_per_s, peak, loss, t0, seq, batch):
    """A metrics.jsonl whose steps end 0.5 s apart from t0; returns its timed window."""
    os.makedirs(os.path.join(runs, name))
    times = [t0 + 0.5 * (i + 1) for i in range(len(tokens_per_s))]
    with open(os.path.join(runs, name, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"event": "start", "seq": seq}) + "\n")  # a line without tokens/s
        for i, tps in enumerate(tokens_per_s):
            f.write(json.dumps({"step": i + 1, "loss": loss + i, "tokens_per_s": tps,
                                "mfu": tps / 1e6, "peak_memory_mib": peak - (i == 0),
                                "time": times[i]}) + "\n")
    return times[2], times[-1]


def main(script):
    failures = Failures()
    check = failures.check

    base = float(int(datetime.datetime(2026, 12, 2, 12, 0, 0).timestamp()))
    with tempfile.TemporaryDirectory() as d:
        runs = os.path.join(d, "runs")
        os.makedirs(runs)
        # 32k x 1: per round the timed steps' tokens/s (their median), and PyTorch's tokens/s.
        ours = {1: [100.0, 105.0, 110.0], 2: [130.0, 120.0, 125.0], 3: [140.0, 150.0, 145.0]}
        theirs = {1: 100.0, 3: 160.0}  # round 2: none
        windows, t = {}, base
        for r, timed in ours.items():
            steps = [1.0, 2.0, 3.0] + timed  # the warm-up steps do not count
            windows[r] = write_run(runs, f"1gpu-32768x1.r{r}", steps, 1000.0 + r, 5.0 * r, t,
                                   32768, 1)
            if r in theirs:
                window = [t + 10.0, t + 14.0]
                windows[("torch", r)] = window
                with open(os.path.join(d, f"trainer_torch-32768x1.r{r}.json"), "w") as f:
                    json.dump({"results": [{"seq": 32768, "batch": 1,
                                            "tokens_per_s": theirs[r], "mfu": 0.4,
                                            "peak_mib": 900.0 + r, "status": "ok",
                                            "recompute": False, "timed_window_unix": window,
                                            "timed_tokens": 32768 * 8}]}, f)
            t += 20.0
        single = [9.0, 9.0, 9.0, 300.0, 310.0, 320.0, 330.0]
        windows["8k"] = write_run(runs, "1gpu-8192x4", single, 2000.0, 1.0, t, 8192, 4)
        with open(os.path.join(d, "trainer_torch-8192x4.json"), "w") as f:
            json.dump({"results": [{"seq": 8192, "batch": 4, "tokens_per_s": 250.0,
                                    "status": "ok"}]}, f)
        # One round left of several (round 1 wrote no metrics): that round's row, named plainly.
        os.makedirs(os.path.join(runs, "1gpu-131072x1.r1"))
        windows["128k"] = write_run(runs, "1gpu-131072x1.r2", single, 3000.0, 2.0, t, 131072, 1)
        os.makedirs(os.path.join(runs, "not-a-run"))  # ignored
        power_csv = os.path.join(d, "power.csv")
        with open(power_csv, "w") as f:
            for k in range(int((t + 10.0 - base) / 0.1)):
                f.write(f"{stamp(base + 0.1 * k)}, 0, {WATTS:.2f}, 1700, 0x0000000000000004\n")
        out = os.path.join(d, "trainer.json")
        env = dict(os.environ, RINGATTN_REVISION="test", OMPI_MCA_hwloc_base_binding_policy="none")
        env.pop("CUDA_VISIBLE_DEVICES", None)
        r = subprocess.run([sys.executable, script, runs, d, out, "1", power_csv],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print(f"exit {r.returncode}: {r.stdout}{r.stderr}")
            return 1
        written = json.load(open(out))
        if written.get("mpi_binding") != "none":
            failures.append(f"the ranks' binding: {written.get('mpi_binding')!r} (expected 'none')")
        rows = {row["run"]: row for row in written["results"]}
        if sorted(rows) != ["1gpu-131072x1", "1gpu-32768x1", "1gpu-8192x4"]:
            print(f"rows {sorted(rows)} (expected 1gpu-131072x1, 1gpu-32768x1, 1gpu-8192x4)")
            return 1
        row = rows["1gpu-131072x1"]
        if "rounds" in row or "torch" in row:
            failures.append("128k: one round's row has a rounds list or a PyTorch row")
        check("128k tokens/s", row.get("tokens_per_s"), statistics.median(single[3:]))

        row = rows["1gpu-32768x1"]
        medians = {r: statistics.median(v) for r, v in ours.items()}
        ratios = [medians[r] / theirs[r] for r in theirs]
        check("32k tokens/s", row.get("tokens_per_s"), statistics.median(medians.values()))
        check("32k ratio (the median of the rounds' ratios)", row.get("ratio_to_torch"),
              statistics.median(ratios))
        check("32k PyTorch tokens/s", (row.get("torch") or {}).get("tokens_per_s"),
              statistics.median(theirs.values()))
        check("32k peak memory (the largest)", row.get("peak_memory_mib"), 1003.0)
        check("32k final loss (the last round's)", row.get("final_loss"), 15.0 + 5)
        check("32k PyTorch peak (the largest)", (row.get("torch") or {}).get("peak_mib"), 903.0)
        if len(row.get("rounds", [])) != 3:
            failures.append(f"32k rounds: {len(row.get('rounds', []))} (expected 3)")
        else:
            for r, part in zip((1, 2, 3), row["rounds"]):
                check(f"32k round {r} tokens/s", part.get("tokens_per_s"), medians[r])
                if r in theirs:
                    check(f"32k round {r} ratio", part.get("ratio_to_torch"),
                          medians[r] / theirs[r])
                    t0, t1 = windows[("torch", r)]
                    check(f"32k round {r} PyTorch mJ/token",
                          ((part.get("torch") or {}).get("power") or {}).get("mj_per_token"),
                          1e3 * WATTS * (t1 - t0) / (32768 * 8), 1e-4)
                elif "ratio_to_torch" in part or "torch" in part:
                    failures.append(f"32k round {r}: a PyTorch row where none was written")
                t0, t1 = windows[r]
                check(f"32k round {r} mJ/token", (part.get("power") or {}).get("mj_per_token"),
                      1e3 * WATTS * (t1 - t0) / (32768 * 3), 1e-4)
        check("32k mJ/token (the median)", (row.get("power") or {}).get("mj_per_token"),
              statistics.median(1e3 * WATTS * (w[1] - w[0]) / (32768 * 3)
                                for w in (windows[1], windows[2], windows[3])), 1e-4)

        row = rows["1gpu-8192x4"]
        if "rounds" in row:
            failures.append("8k: a single round has a rounds list")
        check("8k tokens/s", row.get("tokens_per_s"), statistics.median(single[3:]))
        check("8k ratio", row.get("ratio_to_torch"), statistics.median(single[3:]) / 250.0)
        check("8k steps", row.get("steps"), len(single))
        check("8k mfu", row.get("mfu"), statistics.median(single[3:]) / 1e6)
        t0, t1 = windows["8k"]
        check("8k mJ/token", (row.get("power") or {}).get("mj_per_token"),
              1e3 * WATTS * (t1 - t0) / (8192 * 4 * 4), 1e-4)
        if (row.get("torch") or {}).get("power") is not None:
            failures.append("8k: a PyTorch energy without a timed window")

    return failures.report("bench/trainer_results.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
