#!/usr/bin/env bash
# gpu-check part bench-kernel_times: every kernel, memset and copy of ringattn-train's timed steps
# and of PyTorch's (bench/torch_reference.py) at one shape of the 188M model, recorded the same way
# for both by libringattn_kernel_times.so (CUPTI's activity records, which torch.profiler also
# reads), and summed a step by part: memsets and copies, attention backward, attention forward,
# GEMMs, the rest; also the time the GPU was busy and the step's length.
# Usage: bench/kernel_times.sh OUTDIR
#
#   KERNEL_TIMES_SHAPE  seq x batch (default 32768x1; 131072 and longer recompute)
#   TRAINER_STEPS       steps a run (default 12; the first 3 are warm-up)
#   RINGATTN_BUILD      the build (default build-gpu), with its ringattn_kernel_times target
#
# Writes OUTDIR/kernel-times/{ringattn,pytorch}.json (bench/kernel_times.py summary: by part and the
# 15 longest kernels) and compare.txt (the parts side by side), with each process's CSV.
set -uo pipefail
out="${1:?usage: bench/kernel_times.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/launch_env.sh
build="${RINGATTN_BUILD:-build-gpu}"
lib="$PWD/$build/libringattn_kernel_times.so"
if [[ ! -f $lib ]]; then
  echo "bench/kernel_times.sh: no $lib; build the target ringattn_kernel_times (it needs CUPTI)" >&2
  exit 1
fi
shape="${KERNEL_TIMES_SHAPE:-32768x1}"
seq="${shape%x*}" batch="${shape#*x}"
steps="${TRAINER_STEPS:-12}"
recompute=false; [[ $seq -ge 131072 ]] && recompute=true
kt="$out/kernel-times"
records() {  # NAME: the run wrote its kernels, or the script stops naming its log
  if ! compgen -G "$kt/$1.*.csv" >/dev/null; then
    echo "bench/kernel_times.sh: $1 wrote no kernel records ($kt/$1.<pid>.csv); the library's" \
      "message, if any, is in $kt/$1.log" >&2
    exit 1
  fi
}
rm -rf "${kt:?}"
mkdir -p "$kt"

echo "=== ringattn-train, seq $seq x batch $batch, recompute $recompute"
small_model_args "$seq" "$batch" "$recompute" 1 "$steps" "$kt/run"
RINGATTN_KERNEL_TIMES="$kt/ringattn" CUDA_INJECTION64_PATH="$lib" \
  mpiexec -n 1 -x RINGATTN_KERNEL_TIMES -x CUDA_INJECTION64_PATH "$build/ringattn-train" \
  "${small_model_args[@]}" >"$kt/ringattn.log" 2>&1 || { tail -5 "$kt/ringattn.log"; exit 1; }
rm -f "$kt/run"/ckpt-*.h5
records ringattn
python3 bench/kernel_times.py summary "$kt"/ringattn.*.csv --metrics "$kt/run/metrics.jsonl" \
  --label ringattn --json "$kt/ringattn.json" || exit 1

echo "=== PyTorch (bench/torch_reference.py), $shape"
RINGATTN_KERNEL_TIMES="$kt/pytorch" CUDA_INJECTION64_PATH="$lib" \
  python3 bench/torch_reference.py --config configs/small-32k.yaml --shapes "$shape" \
  --steps "$((steps - 3))" --warmup 3 --json "$kt/torch_reference.json" >"$kt/pytorch.log" 2>&1 ||
  { tail -5 "$kt/pytorch.log"; exit 1; }
records pytorch
python3 bench/kernel_times.py summary "$kt"/pytorch.*.csv --torch-json "$kt/torch_reference.json" \
  --label pytorch --json "$kt/pytorch.json" || exit 1

python3 bench/kernel_times.py compare "$kt/ringattn.json" "$kt/pytorch.json" | tee "$kt/compare.txt"
