#!/usr/bin/env bash
# gpu-check part bench-profile_ops: Nsight Compute on the trainer's own kernels (everything but
# cuBLAS's GEMMs and the attention block) over one ringattn-train step of the 188M shape: per
# kernel its time, device bytes, warp instructions and SM throughput, so that the ops furthest
# from their memory floor show. Usage: bench/profile_ops.sh OUTDIR
#
#   PROFILE_OPS_SHAPE    seq x batch (default 8192x4)
#   PROFILE_OPS_KERNELS  ncu's kernel-name regex (default: the trainer's ops)
#
# Writes OUTDIR/profile_ops.csv (ncu's raw rows) and OUTDIR/profile_ops.json (per kernel name: the
# launches, their total time and, from the means, the achieved device bandwidth and the time at
# 4.3 TB/s, a device copy's rate on an H200). Clocks are left as the device sets them
# (--clock-control none). RINGATTN_BUILD names another build than build-gpu.
set -uo pipefail
out="${1:?usage: bench/profile_ops.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
source bench/launch_env.sh
build="${RINGATTN_BUILD:-build-gpu}"
shape="${PROFILE_OPS_SHAPE:-8192x4}"
kernels="${PROFILE_OPS_KERNELS:-regex:cross_entropy|rmsnorm|swiglu|rope|adamw|sum_of_squares|embedding|to_bf16|to_float|prepare|fill}"
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
status=0
# One step: its kernels are the steady state's (the GEMMs' algorithm choice is not profiled).
timeout 400 ncu --clock-control none --kernel-name-base function --kernel-name "$kernels" \
  --metrics "$metrics" --csv --page raw \
  "$build/ringattn-train" configs/small-32k.yaml --set data.source=retrieval \
  --set train.seq_len="${shape%x*}" --set train.batch_size="${shape#*x}" --set train.steps=1 \
  --set train.warmup_steps=1 --set train.eval_every=0 --set train.checkpoint_every=0 \
  --set run.dir="$out/profile_ops-run" --set run.backend=cuda > "$out/profile_ops.csv" 2>&1 || status=1
rm -f "$out/profile_ops-run"/ckpt-*.h5
python3 - "$out/profile_ops.csv" "$out/profile_ops.json" "$shape" <<'PY' || status=1
import csv, json, sys
path, out_path, shape = sys.argv[1:4]
lines = open(path).read().splitlines()
start = next(i for i, line in enumerate(lines) if '"Kernel Name"' in line)
rows = list(csv.reader(lines[start:]))
header = rows[0]
col = {name: header.index(name) for name in header}
wanted = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
          "smsp__inst_executed.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed"]
units = dict(zip(header, rows[1])) if len(rows) > 1 else {}
scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "msecond": 1e3, "ms": 1e3,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
kernels = {}
for row in rows[1:]:
    try:
        values = {m: float(row[col[m]].replace(",", "")) * scale.get(units.get(m, ""), 1.0)
                  for m in wanted}
    except (ValueError, IndexError):
        continue  # the units row, or a line that is not a kernel's
    k = kernels.setdefault(row[col["Kernel Name"]], {"launches": 0, **{m: 0.0 for m in wanted}})
    k["launches"] += 1
    for m in wanted:
        k[m] += values[m]
table = []
for name, k in kernels.items():
    n = k["launches"]
    us, bytes_ = k["gpu__time_duration.sum"], k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"]
    table.append({"kernel": name, "launches": n, "total_us": us, "mean_us": us / n,
                  "device_bytes_mean": bytes_ / n, "achieved_tb_s": bytes_ / us / 1e6 if us else 0.0,
                  "floor_us_mean": bytes_ / n / 4.3e6, "warp_instructions_mean": k["smsp__inst_executed.sum"] / n,
                  "sm_throughput_pct_mean": k["sm__throughput.avg.pct_of_peak_sustained_elapsed"] / n})
table.sort(key=lambda r: -r["total_us"])
json.dump({"benchmark": "ncu over one ringattn-train step", "shape": shape, "kernels": table},
          open(out_path, "w"), indent=1)
print(f"{'kernel':<40} {'n':>4} {'total us':>10} {'mean us':>9} {'floor us':>9} {'TB/s':>6} {'SM %':>6}")
for r in table:
    print(f"{r['kernel'][:40]:<40} {r['launches']:>4} {r['total_us']:>10.1f} {r['mean_us']:>9.1f} "
          f"{r['floor_us_mean']:>9.1f} {r['achieved_tb_s']:>6.2f} {r['sm_throughput_pct_mean']:>6.1f}")
PY
exit "$status"
