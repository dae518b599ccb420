#!/usr/bin/env bash
# gpu-check part bench-attention: the local block against PyTorch SDPA (flash, cuDNN), and the
# correctness comparison with SDPA in fp64. Usage: bench/attention.sh OUTDIR
set -euo pipefail
out="${1:?usage: bench/attention.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
python3 bench/compare_torch.py --lib build-gpu/libringattn.so --json "$out/compare_torch.json"
python3 bench/attention.py --bench build-gpu/ringattn-bench --out "$out/attention.json" \
  ${RINGATTN_BENCH_SEQLENS:+--seqlens "$RINGATTN_BENCH_SEQLENS"}
