#!/usr/bin/env bash
# gpu-check part bench-trainer: ringattn-train's throughput on the 188M shape (configs/small-32k.yaml
# on synthetic tokens) against the same model in plain PyTorch (bench/torch_reference.py), in the
# same run. Usage: bench/trainer.sh OUTDIR
#
#   shapes (seq x batch): 8192x4, 32768x1, 131072x1 (recompute) on one GPU; with two GPUs visible
#   also 32768x1 and 131072x1 (recompute) at cp = 2
#   TRAINER_STEPS (default 12) steps each; the first 3 are warm-up, the median of the others counts
#   TRAINER_SHAPES overrides the one-GPU list, TRAINER_TORCH=0 skips PyTorch
#   TRAINER_ROUNDS (default 1) rounds, each every ringattn-train run and then PyTorch's, so that
#                  both see the machine alike; a shape's figures are then the medians over the
#                  rounds and its ratio the median of the rounds' ratios (bench/trainer_results.py)
#   TRAINER_SET    more `--set key=value` for every ringattn-train run, space-separated
#   TRAINER_DOCUMENTS=MU,SIGMA  packed documents: ringattn-train reads text files of log-normal
#                  lengths (natural log mean MU, sigma SIGMA, at least 16 bytes; made here with
#                  ringattn-data, each file a document: causal attention within each, RoPE positions
#                  restarting at each, no loss across a boundary), and PyTorch gets the same through
#                  FlexAttention (bench/torch_reference.py --documents: lengths of the same law)
#   CUDA_VISIBLE_DEVICES limits the GPUs (the cp = 2 runs need two); RINGATTN_REVISION names the
#   revision in the JSON (default: tools/revision.sh, git's HEAD and the digest of the sources)
#
# Writes OUTDIR/trainer.json: for each run its tokens/s, MFU and peak device memory, PyTorch's
# for the same shape and the ratio; where nvidia-smi samples the GPUs (OUTDIR/power.csv, every
# 100 ms), also each run's and PyTorch's energy a token, mean power and SM clock over the timed
# steps (bench/power.py: at the power cap, tokens/s follows the energy a token); and how mpiexec
# bound the ranks (mpi_binding: unbound, "none", unless the caller set
# OMPI_MCA_hwloc_base_binding_policy). The exit status is non-zero when a ringattn-train run failed
# (the others still run and are written).
set -uo pipefail
out="${1:?usage: bench/trainer.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
source bench/launch_env.sh
build="${RINGATTN_BUILD:-build-gpu}"
steps="${TRAINER_STEPS:-12}"
rounds="${TRAINER_ROUNDS:-1}"
if ! [[ $rounds =~ ^[1-9][0-9]*$ ]]; then
  echo "bench/trainer.sh: TRAINER_ROUNDS is '$rounds'; expected a whole number of at least 1" >&2
  exit 2
fi
extra=()
for kv in ${TRAINER_SET:-}; do extra+=(--set "$kv"); done
shapes="${TRAINER_SHAPES:-8192x4,32768x1,131072x1}"
torch_documents=()
if [[ -n "${TRAINER_DOCUMENTS:-}" ]]; then
  if ! [[ $TRAINER_DOCUMENTS =~ ^[0-9.]+,[0-9.]+$ ]]; then
    echo "bench/trainer.sh: TRAINER_DOCUMENTS is '$TRAINER_DOCUMENTS'; expected MU,SIGMA (e.g. 7.2,1)" >&2
    exit 2
  fi
  # Twice the tokens of the longest run's steps, so that no run reads a document twice.
  need=0
  for shape in ${shapes//,/ }; do
    (( ${shape%x*} * ${shape#*x} * steps * 2 > need )) && need=$(( ${shape%x*} * ${shape#*x} * steps * 2 ))
  done
  documents="$out/documents"
  rm -rf "${documents:?}" && mkdir -p "$documents/text"
  python3 - "$documents/text" "$TRAINER_DOCUMENTS" "$need" <<'PY' || exit 2
import random, sys
folder, law, need = sys.argv[1], sys.argv[2], int(sys.argv[3])
mu, sigma = (float(x) for x in law.split(","))
random.seed(7)
total = index = 0
while total < need:
    n = max(16, int(random.lognormvariate(mu, sigma)))
    with open(f"{folder}/d{index:06d}.txt", "wb") as f:
        f.write(bytes(random.randrange(32, 127) for _ in range(n)))
    total, index = total + n, index + 1
print(f"{index} documents, {total} bytes")
PY
  "$build/ringattn-data" --out "$documents/text.h5" "$documents"/text/*.txt >"$documents/data.log" 2>&1 || {
    echo "bench/trainer.sh: ringattn-data failed; see $documents/data.log" >&2
    exit 2
  }
  extra+=(--set data.source=hdf5 --set data.train_path="$documents/text.train.h5"
          --set data.val_path="$documents/text.val.h5")
  torch_documents=(--documents "$TRAINER_DOCUMENTS")
fi
# The GPUs the runs may use: CUDA_VISIBLE_DEVICES's list when it is set, else every GPU.
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  gpus="$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)"
else
  gpus="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)"
fi
runs="$out/trainer-runs"
rm -rf "${runs:?}"  # the runs of an earlier call into OUTDIR would join the results
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
  small_model_args "$seq" "$batch" "$recompute" "$ranks" "$steps" "$runs/$name"
  mpiexec -n "$ranks" --oversubscribe "$build/ringattn-train" "${small_model_args[@]}" \
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
rm -f "$out"/trainer_torch-*.json
for ((round = 1; round <= rounds; ++round)); do
  suffix=""
  [[ $rounds -gt 1 ]] && suffix=".r$round" && echo "=== round $round of $rounds"
  for shape in "${one_gpu[@]}"; do
    seq="${shape%x*}" batch="${shape#*x}"
    recompute=false; [[ $seq -ge 131072 ]] && recompute=true
    run_ringattn "1gpu-${seq}x${batch}$suffix" 1 "$seq" "$batch" "$recompute"
  done
  if [[ ${gpus:-0} -ge 2 ]]; then
    run_ringattn "2gpu-32768x1$suffix" 2 32768 1 false
    run_ringattn "2gpu-131072x1$suffix" 2 131072 1 true
  fi
  # PyTorch runs each shape in a process of its own: after another shape in the same process,
  # its 32k x 1 step ran 2.5% slower on an H200 (133.3k against 136.5-137.0k tokens/s).
  if [[ "${TRAINER_TORCH:-1}" == 1 ]]; then
    for shape in "${one_gpu[@]}"; do
      echo "=== PyTorch reference (bench/torch_reference.py), $shape"
      python3 bench/torch_reference.py --config configs/small-32k.yaml --shapes "$shape" \
        --steps "$((steps - 3))" --warmup 3 "${torch_documents[@]}" \
        --json "$out/trainer_torch-$shape$suffix.json" 2>&1 |
        tail -2
    done
  fi
done

if [[ -n $sampler ]]; then
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  sampler=""
fi

PYTHONPATH="$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" python3 bench/trainer_results.py "$runs" "$out" \
  "$out/trainer.json" "${gpus:-0}" "$power_csv" || failed=1
exit $failed
