#!/usr/bin/env bash
# gpu-check part bench-trainer_fit: the longest context ringattn-train can train on one GPU and on
# two (cp = 2), for the 188M shape of configs/small-32k.yaml with recomputation (and, on two,
# the AdamW moments sharded over the GPUs: train.shard_optimizer).
# Usage: bench/trainer_fit.sh OUTDIR
#
# A step at the longest length takes minutes (attention is quadratic in it), so the search does not
# run there. Every buffer of a step is allocated up front and is linear in the local tokens (the
# ring's workspace lives in lent buffers), so the device memory in use is a line in the length:
# the script measures it at two lengths for each GPU count (TRAINER_FIT_STEPS steps each, default
# 3), fits the line and solves it for the device's memory less TRAINER_FIT_MARGIN_GIB (default 2),
# rounded down to a multiple of 16384 * 2 * cp. TRAINER_FIT_LENGTHS_1 and _2 override the two
# lengths (defaults 65536,131072 and 131072,262144). RINGATTN_BUILD names another build than
# build-gpu/.
#
# Writes OUTDIR/trainer_fit.json: per GPU count the measured peaks, the slope (bytes a token of the
# whole sequence) and intercept, the predicted longest length; and the ratio of the two.
set -uo pipefail
out="${1:?usage: bench/trainer_fit.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/launch_env.sh
build="${RINGATTN_BUILD:-build-gpu}"
steps="${TRAINER_FIT_STEPS:-3}"
runs="$out/trainer-fit-runs"
mkdir -p "$runs"
status=0

for cp in 1 2; do
  lengths_var="TRAINER_FIT_LENGTHS_$cp"
  default_lengths=$([[ $cp == 1 ]] && echo 65536,131072 || echo 131072,262144)
  IFS=, read -r -a lengths <<<"${!lengths_var:-$default_lengths}"
  for seq in "${lengths[@]}"; do
    name="cp${cp}-${seq}"
    echo "=== ringattn-train $name"
    rm -rf "${runs:?}/$name"
    timeout 300 mpiexec -n "$cp" --oversubscribe "$build/ringattn-train" configs/small-32k.yaml \
      --set data.source=retrieval --set train.seq_len="$seq" --set train.batch_size=1 \
      --set train.recompute=true --set train.shard_optimizer=true --set parallel.cp="$cp" \
      --set train.steps="$steps" \
      --set train.warmup_steps=1 --set train.log_every=1 --set train.eval_every=0 \
      --set train.checkpoint_every=0 --set run.dir="$runs/$name" --set run.backend=cuda \
      >"$runs/$name.log" 2>&1 || { status=1; tail -5 "$runs/$name.log"; }
    grep '^step' "$runs/$name.log" | tail -1
    rm -f "$runs/$name"/ckpt-*.h5  # the run's final checkpoint (GiBs) is not part of the results
  done
done

python3 - "$runs" "$out/trainer_fit.json" "${TRAINER_FIT_MARGIN_GIB:-2}" <<'EOF' || status=1
import json, os, subprocess, sys, datetime
runs, out_path, margin_gib = sys.argv[1], sys.argv[2], float(sys.argv[3])
total_mib = float(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()[0])
usable_mib = total_mib - 1024 * margin_gib
result = {"date": datetime.date.today().isoformat(),
          "revision": os.environ.get("RINGATTN_REVISION") or subprocess.run(
              ["tools/revision.sh"], capture_output=True, text=True).stdout.strip(),
          "config": "configs/small-32k.yaml, batch 1, recompute, synthetic tokens",
          "device_memory_mib": total_mib, "margin_gib": margin_gib, "gpus": {}}
for cp in (1, 2):
    points = []
    for name in sorted(os.listdir(runs)):
        path = os.path.join(runs, name, "metrics.jsonl")
        if not name.startswith(f"cp{cp}-") or not os.path.isfile(path):
            continue
        peaks = [json.loads(l)["peak_memory_mib"] for l in open(path) if '"peak_memory_mib"' in l]
        if peaks:
            points.append((int(name.split("-")[1]), max(peaks)))
    points.sort()
    entry = {"measured": [{"seq": s, "peak_mib": p} for s, p in points]}
    if len(points) >= 2:
        (s1, p1), (s2, p2) = points[0], points[-1]
        slope = (p2 - p1) / (s2 - s1)  # MiB a token of the whole sequence
        intercept = p1 - slope * s1
        unit = 16384 * 2 * cp
        longest = int((usable_mib - intercept) / slope) // unit * unit
        entry.update({"bytes_per_token": slope * 2**20, "intercept_mib": intercept,
                      "predicted_longest_seq": longest})
        print(f"{cp} GPU(s): {slope * 2**20 / 1024:.1f} KiB a token, {intercept:.0f} MiB fixed; "
              f"longest predicted: {longest} tokens")
    result["gpus"][str(cp)] = entry
one = result["gpus"].get("1", {}).get("predicted_longest_seq")
two = result["gpus"].get("2", {}).get("predicted_longest_seq")
if one and two:
    result["ratio_2_to_1"] = two / one
    print(f"2 GPUs / 1 GPU: {two / one:.2f}")
json.dump(result, open(out_path, "w"), indent=1)
print("wrote", out_path)
EOF
exit $status
