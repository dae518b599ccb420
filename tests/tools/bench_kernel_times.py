"""bench/kernel_times.py against kernel records whose sums are known by construction.

Two processes' CSV files (as libringattn_kernel_times.so writes them: Unix seconds, mangled names in
double quotes, one with a comma and a doubled quote) hold kernels of four parts, and a memset and a
copy (a fifth part), before, inside and after a window of 4 steps, two of them overlapping (the
union differs from the sum), and lines that are not records. The per-step sums by part and by
name, the busy time, the launches and the window are computed here from the constructed records
and compared with the summary's JSON; the window comes once from --window, once from a
metrics.jsonl and once from a PyTorch row. A window holding no kernel gives no summary (exit 1),
and compare prints the parts of two summaries, with "-" where a summary from before memsets and
copies were recorded lacks their part.

  python3 tests/tools/bench_kernel_times.py bench/kernel_times.py
"""
import json
import os
import subprocess
import sys
import tempfile

from known_answers import Failures

T0, STEPS, STEP = 1764676800.0, 4, 0.25  # the window: [T0, T0 + STEPS * STEP)
KERNELS = [  # (start offset from T0, duration, name, file)
    (-0.05, 0.02, "_Z26flash_backward_sm90_kernelILi128EEvv", 0),  # before the window
    (0.010, 0.100, "_Z26flash_backward_sm90_kernelILi128EEvv", 0),
    (0.260, 0.100, "_Z26flash_backward_sm90_kernelILi128EEvv", 1),
    (0.120, 0.030, "_Z29flash_backward_prepare_kernelv", 0),
    (0.400, 0.040, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", 1),
    (0.500, 0.050, "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0),
    (0.530, 0.050, "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1),  # overlaps the one before
    (0.700, 0.010, 'triton_poi_fused_add, "x"_0', 0),
    (0.720, 0.015, "[memset]", 0),  # memory work: a part of its own, before the name patterns
    (0.800, 0.005, "[memcpy HtoD]", 1),
    (0.990, 0.020, "_Z16rmsnorm_forward_kernelv", 1),  # starts inside, ends after: counts
    (1.000, 0.030, "_Z16rmsnorm_forward_kernelv", 0),  # starts at the window's end: does not
]
PART = {"flash_backward": "attention.backward", "flash_fprop": "attention.forward",
        "nvjet": "gemm", "triton": "other", "rmsnorm": "other", "[mem": "memset.memcpy"}


def part(name):
    return next(p for key, p in PART.items() if key in name)


def main(script):
    failures = Failures()
    check = failures.check

    inside = [k for k in KERNELS if 0 <= k[0] < STEPS * STEP]
    want_parts = {"memset.memcpy": 0.0, "attention.backward": 0.0, "attention.forward": 0.0,
                  "gemm": 0.0, "other": 0.0}
    for _, duration, name, _ in inside:
        want_parts[part(name)] += duration
    spans = sorted((k[0], k[0] + k[1]) for k in inside)
    busy = 0.0
    reach = None
    for s, e in spans:
        busy += e - s if reach is None or s > reach else max(0.0, e - reach)
        reach = e if reach is None else max(reach, e)
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, f"run.{pid}.csv") for pid in (101, 102)]
        for i, path in enumerate(paths):
            with open(path, "w") as f:
                f.write("unix_start,unix_end,device,stream,name\n")
                f.write("not,a,record\n")
                for start, duration, name, file in KERNELS:
                    if file == i:
                        quoted = name.replace('"', '""')
                        f.write(f'{T0 + start:.9f},{T0 + start + duration:.9f},0,7,"{quoted}"\n')
        metrics = os.path.join(d, "metrics.jsonl")
        with open(metrics, "w") as f:  # steps end 0.25 s apart; the third ends at T0
            for i in range(3 + STEPS):
                f.write(json.dumps({"step": i + 1, "tokens_per_s": 1.0,
                                    "time": T0 + (i - 2) * STEP}) + "\n")
        torch_json = os.path.join(d, "torch.json")
        with open(torch_json, "w") as f:
            json.dump({"results": [{"seq": 64, "batch": 2, "timed_window_unix":
                                    [T0, T0 + STEPS * STEP], "timed_tokens": 64 * 2 * STEPS}]}, f)
        windows = {"window": ["--window", f"{T0:.6f}", f"{T0 + STEPS * STEP:.6f}", "--steps",
                              str(STEPS)],
                   "metrics": ["--metrics", metrics], "torch": ["--torch-json", torch_json]}
        for label, window in windows.items():
            out = os.path.join(d, f"summary-{label}.json")
            r = subprocess.run([sys.executable, script, "summary", *paths, *window, "--label",
                                label, "--json", out], capture_output=True, text=True)
            if r.returncode != 0:
                failures.append(f"{label}: exit {r.returncode}: {r.stderr.strip()}")
                continue
            s = json.load(open(out))
            check(f"{label} steps", s.get("steps"), STEPS)
            check(f"{label} step_ms", s.get("step_ms"), 1e3 * STEP)
            check(f"{label} launches", s.get("kernels_per_step"), len(inside) / STEPS, 1e-3)
            check(f"{label} kernel ms", s.get("kernel_ms_per_step"),
                  1e3 * sum(k[1] for k in inside) / STEPS, 1e-4)
            check(f"{label} busy ms", s.get("busy_ms_per_step"), 1e3 * busy / STEPS, 1e-4)
            for p, seconds in want_parts.items():
                check(f"{label} {p}", s.get("parts_ms_per_step", {}).get(p),
                      1e3 * seconds / STEPS, 1e-4)
            top = {t["name"]: t for t in s.get("top", [])}
            flash = top.get("_Z26flash_backward_sm90_kernelILi128EEvv", {})
            check(f"{label} flash launches", flash.get("launches_per_step"), 2 / STEPS, 1e-3)
            check(f"{label} flash ms", flash.get("ms_per_step"), 1e3 * 0.2 / STEPS, 1e-4)
            if 'triton_poi_fused_add, "x"_0' not in top:
                failures.append(f"{label}: the quoted name was not read back: {sorted(top)}")
        r = subprocess.run([sys.executable, script, "summary", *paths, "--window",
                            f"{T0 + 10:.3f}", f"{T0 + 11:.3f}", "--steps", "1"],
                           capture_output=True, text=True)
        if r.returncode != 1 or "no kernel" not in r.stderr:
            failures.append(f"empty window: exit {r.returncode}, {r.stderr.strip()!r}")
        r = subprocess.run([sys.executable, script, "compare",
                            os.path.join(d, "summary-window.json"),
                            os.path.join(d, "summary-torch.json")], capture_output=True, text=True)
        if r.returncode != 0 or "gemm" not in r.stdout or "+0.000" not in r.stdout:
            failures.append(f"compare: exit {r.returncode}: {r.stdout}{r.stderr}")
        # A summary from before memsets and copies were recorded: their row shows "-".
        old = json.load(open(os.path.join(d, "summary-window.json")))
        old["parts_ms_per_step"].pop("memset.memcpy", None)
        old_path = os.path.join(d, "summary-old.json")
        json.dump(old, open(old_path, "w"))
        new_path = os.path.join(d, "summary-torch.json")
        for first, second, column in ((old_path, new_path, 1), (new_path, old_path, 2)):
            r = subprocess.run([sys.executable, script, "compare", first, second],
                               capture_output=True, text=True)
            row = next((line.split() for line in r.stdout.splitlines()
                        if line.startswith("memset.memcpy")), [])
            if r.returncode != 0 or len(row) != 4 or row[column] != "-" or row[3] != "-":
                failures.append(f"compare with an older summary in column {column}: exit "
                                f"{r.returncode}: {r.stdout}{r.stderr}")

    return failures.report("bench/kernel_times.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
