#!/usr/bin/env bash
# gpu-check part bench-ring: ring attention on 2 GPUs. `ringattn-bench ring` times the ring, its
# transfers and its compute apart, and the local block on the whole sequence on one GPU;
# bench/ring_torch.py times PyTorch's context_parallel on the same shapes; bench/ring_compare.py
# puts them side by side. Usage: bench/ring.sh OUTDIR
#
# Writes OUTDIR/ring.json, OUTDIR/ring_torch.json and OUTDIR/ring_compare.json, in about 2.5 minutes
# on 2 H200: 32k and 128k tokens with both masks, 512k with the causal mask only (the full mask
# there would take minutes on its own), 16 query heads of 128 on 16 and 4 K/V heads (torch: 16).
# RING_FIT=1 then also runs `ringattn-bench ring --fit` into OUTDIR/ring_fit.json: the longest
# sequence that fits on 1 and on 2 GPUs, with one forward + backward at each (about 6 minutes
# more); RING_FIT=only runs just that. RINGATTN_BENCH names another ringattn-bench than
# build-gpu/'s. Every step runs even when one before it failed; the exit status is 1 when any did.
set -uo pipefail
out="${1:?usage: bench/ring.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
source bench/launch_env.sh
export RINGATTN_REVISION="${RINGATTN_REVISION:-$(tools/revision.sh)}"
bench="${RINGATTN_BENCH:-build-gpu/ringattn-bench}"
fit="${RING_FIT:-0}"
gpus=2 seqlens=32768,131072,524288 max_full_seq=131072
status=0

# The time limits stop a run that hangs (a rank left alone in a collective) within the budget:
# about 1.4x and 2.5x the expected times, 7.5 minutes together (the fit: 9.5 minutes).
if [[ "$fit" != only ]]; then
  echo "=== ringattn-bench ring"
  timeout 300 mpirun -np "$gpus" "$bench" ring --seqlens "$seqlens" --kv-heads 16,4 --causal both \
    --max-full-seq "$max_full_seq" --json "$out/ring.json" || status=1

  echo "=== torch context_parallel"
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" bench/ring_torch.py \
    --seqlens "$seqlens" --causal both --max-full-seq "$max_full_seq" --out "$out/ring_torch.json" || status=1

  python3 bench/ring_compare.py "$out/ring.json" "$out/ring_torch.json" --out "$out/ring_compare.json" ||
    status=1
fi

if [[ "$fit" == 1 || "$fit" == only ]]; then
  echo "=== ringattn-bench ring --fit"
  timeout 570 mpirun -np "$gpus" "$bench" ring --fit --json "$out/ring_fit.json" || status=1
fi
exit "$status"
