#!/usr/bin/env bash
# gpu-check part bench-gradcheck: ringattn-gradcheck on 2 GPUs at long sequences, over both
# exchange paths: bf16, causal, zigzag, 16 heads of 128, against the fp32 streaming GPU reference.
# Usage: bench/gradcheck.sh OUTDIR
#
#   131072 tokens with the default exchanges (RINGATTN_EXCHANGE=auto: the copy engines, its
#   exchanges being 256 and 512 MiB); 32768 tokens with `copy` (auto would take NCCL for its 64
#   and 128 MiB) and with `nccl`. GRADCHECK_RUNS="SEQ:EXCHANGE ..." runs others instead.
#
# On 2 H200 a 131072-token run takes about 5.5 minutes (the reference alone 3), a 32768-token one
# under a minute. Writes OUTDIR/gradcheck-SEQ-EXCHANGE.json and the tables in OUTDIR's log. Each
# run has a time limit (8 minutes from 65536 tokens on, else 3); every run runs even when one
# before it failed; the exit status is 1 when any failed. RINGATTN_GRADCHECK names another
# ringattn-gradcheck than build-gpu/'s.
set -uo pipefail
out="${1:?usage: bench/gradcheck.sh OUTDIR}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
source bench/launch_env.sh
gradcheck="${RINGATTN_GRADCHECK:-build-gpu/ringattn-gradcheck}"
status=0
for run in ${GRADCHECK_RUNS:-131072:auto 32768:copy 32768:nccl}; do
  seq="${run%:*}" exchange="${run#*:}"
  limit=180
  [[ $seq -ge 65536 ]] && limit=480
  echo "=== ringattn-gradcheck seq $seq, RINGATTN_EXCHANGE=$exchange"
  RINGATTN_EXCHANGE="$exchange" timeout "$limit" mpirun -np 2 "$gradcheck" --backend cuda --dtype bf16 \
    --seq "$seq" --heads 16 --head-dim 128 --causal --json "$out/gradcheck-$seq-$exchange.json" ||
    status=1
done
exit "$status"
