#!/usr/bin/env bash
# gpu-check part bench-trainer: ringattn-train's throughput on the 188M shape (configs/small-32k.yaml
# on synthetic tokens) against the same model in plain PyTorch (bench/torch_reference.py), in the
# same run. Usage: bench/trainer.sh OUTDIR
#
#   shapes (seq x batch): 8192x4, 32768x1, 131072x1 (recompute) on one GPU; with two GPUs visible
#   also 32768x1 and 131072x1 (recompute) at cp = 2
#   TRAINER_STEPS (default 12) steps each; the first 3 are warm-up, the median of the others counts
#   TRAINER_SHAPES overrides the one-GPU list, TRAINER_TORCH=0 skips PyTorch
#   TRAINER_SET    more `--set key=value` for every ringattn-train run, space-separated
#   CUDA_VISIBLE_DEVICES limits the GPUs (the cp = 2 runs need two); RINGATTN_REVISION names the
#   revision in the JSON (default: tools/revision.sh, git's HEAD and the digest of the sources)
#
# Writes OUTDIR/trainer.json: for each run its tokens/s, MFU and peak device memory, PyTorch's
# for the same shape and the ratio; where nvidia-smi samples the GPUs (OUTDIR/power.csv, every
# 100 ms), also each run's and PyTorch's energy a token, mean power and SM clock over the timed
# steps (bench/power.py: at the power cap, tokens/s follows the energy a token). The exit status
# is non-zero when a ringattn-train run failed (the others still run and are written).
set -uo pipefail
out="${1:?usage: bench/trainer.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
build="${RINGATTN_BUILD:-build-gpu}"
steps="${TRAINER_STEPS:-12}"
extra=()
for kv in ${TRAINER_SET:-}; do extra+=(--set "$kv"); done
shapes="${TRAINER_SHAPES:-8192x4,32768x1,131072x1}"
# The GPUs the runs may use: CUDA_VISIBLE_DEVICES's list when it is set, else every GPU.
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  gpus="$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)"
else
  gpus="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)"
fi
runs="$out/trainer-runs"
mkdir -p "$runs"

# Power, SM clock and clock event reasons of every GPU every 100 ms through all runs, for each
# run's energy a token over its timed steps (bench/power.py); none where nvidia-smi cannot sample.
power_csv="$out/power.csv"
rm -f "$power_csv"
sampler=""
if [[ ${gpus:-0} -ge 1 ]] && command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,index,power.draw,clocks.sm,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 100 >"$power_csv" 2>/dev/null &
  sampler=$!
  trap '[[ -z $sampler ]] || kill "$sampler" 2>/dev/null' EXIT
fi

run_ringattn() {  # NAME RANKS SEQ BATCH RECOMPUTE
  local name="$1" ranks="$2" seq="$3" batch="$4" recompute="$5"
  echo "=== ringattn-train $name: seq $seq x batch $batch, $ranks GPU(s), recompute $recompute"
  rm -rf "${runs:?}/$name"
  mpiexec -n "$ranks" --oversubscribe "$build/ringattn-train" configs/small-32k.yaml \
    --set data.source=retrieval --set train.seq_len="$seq" --set train.batch_size="$batch" \
    --set train.recompute="$recompute" --set parallel.cp="$ranks" --set train.steps="$steps" \
    --set train.warmup_steps=2 --set train.log_every=1 --set train.eval_every=0 \
    --set train.checkpoint_every=0 --set run.dir="$runs/$name" --set run.backend=cuda \
    "${extra[@]}" 2>&1 | tee "$runs/$name.log" | grep -v '^step [0-9]*/' | tail -5
  local status=${PIPESTATUS[0]}
  grep '^step' "$runs/$name.log" | tail -2
  rm -f "$runs/$name"/ckpt-*.h5  # the run's final checkpoint (GiBs) is not part of the results
  if [[ $status -ne 0 ]]; then
    echo "bench/trainer.sh: ringattn-train $name exited with status $status; see $runs/$name.log" >&2
    failed=1
  fi
}
failed=0

IFS=, read -r -a one_gpu <<<"$shapes"
for shape in "${one_gpu[@]}"; do
  seq="${shape%x*}" batch="${shape#*x}"
  recompute=false; [[ $seq -ge 131072 ]] && recompute=true
  run_ringattn "1gpu-${seq}x${batch}" 1 "$seq" "$batch" "$recompute"
done
if [[ ${gpus:-0} -ge 2 ]]; then
  run_ringattn "2gpu-32768x1" 2 32768 1 false
  run_ringattn "2gpu-131072x1" 2 131072 1 true
fi

# PyTorch runs each shape in a process of its own: after another shape in the same process, its
# 32k x 1 step ran 2.5% slower on an H200 (133.3k against 136.5-137.0k tokens/s), so a shared
# process would understate it.
rm -f "$out"/trainer_torch-*.json
if [[ "${TRAINER_TORCH:-1}" == 1 ]]; then
  for shape in "${one_gpu[@]}"; do
    echo "=== PyTorch reference (bench/torch_reference.py), $shape"
    python3 bench/torch_reference.py --config configs/small-32k.yaml --shapes "$shape" \
      --steps "$((steps - 3))" --warmup 3 --json "$out/trainer_torch-$shape.json" 2>&1 | tail -2
  done
fi

if [[ -n $sampler ]]; then
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  sampler=""
fi

PYTHONPATH="$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" python3 - "$runs" "$out" \
    "$out/trainer.json" "${gpus:-0}" "$power_csv" <<'EOF' || failed=1
import glob, json, os, shutil, statistics, subprocess, sys, datetime
import power
runs, out_dir, out_path, visible, power_csv = sys.argv[1:6]
samples = power.read_samples(power_csv) if os.path.isfile(power_csv) else []
# The nvidia-smi indices of the GPUs the runs use, in CUDA's order (a run on k GPUs uses the
# first k): 0, 1, ...; or CUDA_VISIBLE_DEVICES's list, unless it names GPUs otherwise (UUIDs).
indices = list(range(int(visible)))
if "CUDA_VISIBLE_DEVICES" in os.environ:
    listed = [x.strip() for x in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
    indices = [int(x) for x in listed] if all(x.isdigit() for x in listed) else None
def energy(count, window, tokens):
    if not samples or indices is None or count > len(indices) or window is None:
        return None
    return power.window_summary(samples, indices[:count], window[0], window[1], tokens)
torch = {}
for torch_path in sorted(glob.glob(os.path.join(out_dir, "trainer_torch-*.json"))):
    for r in json.load(open(torch_path)).get("results", []):
        torch[(r["seq"], r["batch"])] = r
results = []
for name in sorted(os.listdir(runs)):
    path = os.path.join(runs, name, "metrics.jsonl")
    if not os.path.isfile(path):
        continue
    steps = [json.loads(l) for l in open(path) if '"tokens_per_s"' in l]
    gpus, shape = name.split("-", 1)
    seq, batch = (int(x) for x in shape.split("x"))
    row = {"run": name, "gpus": int(gpus[0]), "seq": seq, "batch": batch, "steps": len(steps)}
    timed = steps[3:] or steps
    if timed:
        row["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in timed)
        row["mfu"] = statistics.median(s.get("mfu", 0.0) or 0.0 for s in timed)
        row["peak_memory_mib"] = max(s["peak_memory_mib"] for s in steps)
        row["final_loss"] = steps[-1]["loss"]
        # From the end of the last untimed step to the end of the last (ringattn-train's "time").
        if len(steps) > 3 and all("time" in s for s in steps):
            row["power"] = energy(row["gpus"], (steps[2]["time"], steps[-1]["time"]),
                                  seq * batch * len(timed))
    t = torch.get((seq, batch))
    if t is not None:
        row["torch"] = {k: t.get(k) for k in ("tokens_per_s", "mfu", "peak_mib", "status", "recompute")}
        row["torch"]["power"] = energy(1, t.get("timed_window_unix"), t.get("timed_tokens", 0))
        if t.get("tokens_per_s") and row.get("tokens_per_s"):
            # per GPU for the ring runs: PyTorch runs the whole sequence on one GPU
            row["ratio_to_torch"] = row["tokens_per_s"] / t["tokens_per_s"]
    results.append(row)
    mj = lambda p: f" {p['mj_per_token']:.2f} mJ/token" if p else ""
    print(f"{name:>18}: {row.get('tokens_per_s', 0):>10.0f} tokens/s  mfu {100 * row.get('mfu', 0):5.1f}%"
          f"  peak {row.get('peak_memory_mib', 0):8.0f} MiB" + mj(row.get("power"))
          + (f"  torch {t['tokens_per_s']:.0f} tokens/s{mj(row['torch']['power'])}"
             f"  ratio {row['ratio_to_torch']:.2f}"
             if t is not None and "ratio_to_torch" in row else ""))
rev = os.environ.get("RINGATTN_REVISION") or subprocess.run(
    ["tools/revision.sh"], capture_output=True, text=True).stdout.strip()
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip().splitlines() if shutil.which("nvidia-smi") else []
json.dump({"gpu": gpu[0] if gpu else "", "gpus": int(visible), "date": datetime.date.today().isoformat(),
           "revision": rev, "config": "configs/small-32k.yaml on synthetic tokens",
           "results": results}, open(out_path, "w"), indent=1)
EOF
exit $failed
