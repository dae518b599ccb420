#!/usr/bin/env bash
# gpu-check part bench-profile_backward: Nsight Compute on one launch of the Hopper backward (bf16,
# d 128, causal, TMA dQ) inside `ringattn-bench attention` at 8k tokens: where its warps stall,
# overall and per SASS instruction. Usage: bench/profile_backward.sh OUTDIR
#
# Writes OUTDIR/profile_backward.ncu-rep, profile_backward_details.txt (the sections' tables) and
# profile_backward_sass.csv (per instruction: warp stall samples by reason). Clocks are left as the
# device sets them (--clock-control none). RINGATTN_BENCH names another ringattn-bench than
# build-gpu/'s; PROFILE_SEQ another length (default 8192).
set -uo pipefail
out="${1:?usage: bench/profile_backward.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
bench="${RINGATTN_BENCH:-build-gpu/ringattn-bench}"
seq="${PROFILE_SEQ:-8192}"
# The demangled name of the causal, atomic-dQ, TMA-dQ instantiation at head_dim 128.
kernel='regex:flash_backward_sm90_kernel<__nv_bfloat16, .int.128, .bool.1, .bool.1, .bool.1'
status=0
timeout 240 ncu --clock-control none --kernel-name-base demangled --kernel-name "$kernel" --launch-skip 2 --launch-count 1 \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SourceCounters --import-source no \
  --export "$out/profile_backward" --force-overwrite \
  "$bench" attention --seqlens "$seq" --head-dims 128 > "$out/profile_backward.log" 2>&1 || status=1
if [[ -f "$out/profile_backward.ncu-rep" ]]; then
  ncu --import "$out/profile_backward.ncu-rep" --page details > "$out/profile_backward_details.txt" 2>&1 ||
    status=1
  ncu --import "$out/profile_backward.ncu-rep" --page source --csv --print-source sass \
    > "$out/profile_backward_sass.csv" 2>&1 || status=1
fi
tail -5 "$out/profile_backward.log"
exit "$status"
