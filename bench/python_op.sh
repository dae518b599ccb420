#!/usr/bin/env bash
# gpu-check part bench-python_op: ringattn.attention from Python (the package in python/, over
# build-gpu's libringattn.so) against `ringattn-bench attention` and PyTorch SDPA's cuDNN and flash
# backends on one GPU: TFLOP/s, host overhead a call, and torch.compile(fullgraph=True)
# (bench/python_op.py). Usage: bench/python_op.sh OUTDIR
#
#   RINGATTN_BENCH_SEQLENS   the throughput part's sequence lengths (default 2048,8192,16384)
#
# Writes OUTDIR/python_op.json and OUTDIR/python_op.log.
set -euo pipefail
out="${1:?usage: bench/python_op.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The package from this tree over this build's library, without installing it.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export RINGATTN_LIBRARY="$PWD/build-gpu/libringattn.so"
python3 bench/python_op.py --bench build-gpu/ringattn-bench --out "$out/python_op.json" \
  ${RINGATTN_BENCH_SEQLENS:+--seqlens "$RINGATTN_BENCH_SEQLENS"} 2>&1 | tee "$out/python_op.log"
