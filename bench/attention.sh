#!/usr/bin/env bash
# gpu-check part bench-attention: the local block against PyTorch SDPA (flash, cuDNN), and the
# correctness comparison with SDPA in fp64. Usage: bench/attention.sh OUTDIR. RINGATTN_BENCH_SEQLENS
# and RINGATTN_BENCH_HEAD_DIMS (e.g. 2048,8192 and 32,96,192:128) set the grid's axes.
set -euo pipefail
out="${1:?usage: bench/attention.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
python3 bench/compare_torch.py --lib build-gpu/libringattn.so --json "$out/compare_torch.json"
python3 bench/attention.py --bench build-gpu/ringattn-bench --out "$out/attention.json" \
  ${RINGATTN_BENCH_SEQLENS:+--seqlens "$RINGATTN_BENCH_SEQLENS"} \
  ${RINGATTN_BENCH_HEAD_DIMS:+--head-dims "$RINGATTN_BENCH_HEAD_DIMS"}
