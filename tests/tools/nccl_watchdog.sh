#!/usr/bin/env bash
# A hung peer on two GPUs: rank 1 of ringattn-gradcheck stops for good before its second ring
# exchange (RINGATTN_TEST_STALL_EXCHANGE=1:2), as a rank whose host hangs would. Rank 0's exchange
# then never completes; its collective watchdog (RINGATTN_NCCL_TIMEOUT_S=3) must say so, naming
# the rank and the exchange, within the timeout plus 2 s of the stall, and every rank must be gone
# within 5 s of that message (the watchdog aborts NCCL and ends rank 0; mpiexec ends rank 1).
#   nccl   the exchanges over NCCL (RINGATTN_EXCHANGE=nccl): the watched NCCL work times out;
#   copy   by the copy engines (RINGATTN_EXCHANGE=copy): rank 0's host wait for rank 1 times out.
#   tests/tools/nccl_watchdog.sh CASE GRADCHECK MPIEXEC SOURCE_DIR
# Exit 0: it behaved; 1: it did not (the output is printed); 77: fewer than two GPUs (skipped).
# A run still going 60 s after its start is a hang: every process is killed by PID.
set -uo pipefail
case_name="$1" gradcheck="$2" mpiexec="$3" here="$4"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if (( gpus < 2 )); then
  echo "skipped: needs 2 GPUs, found ${gpus:-0}"
  exit 77
fi
source "$here/bench/launch_env.sh"
case "$case_name" in
  nccl) exchange=nccl expect="rank 0: ring exchange 2 over NCCL (to rank 1, from rank 1) has not completed after" ;;
  copy) exchange=copy expect="rank 0: ring exchange 2 by the copy engines (waiting for rank 1) has not completed after" ;;
  *) echo "nccl_watchdog.sh: unknown case '$case_name'"; exit 2 ;;
esac
log="$(mktemp "${TMPDIR:-/tmp}/ringattn-watchdog.XXXXXX")"
launcher_pid=""
cleanup() {
  if [[ -n $launcher_pid ]]; then
    pkill -KILL -P "$launcher_pid" 2>/dev/null
    kill -KILL "$launcher_pid" 2>/dev/null
  fi
  rm -f "$log"
}
trap cleanup EXIT

now() { date +%s.%N; }
start=$(now)
"$mpiexec" -np 2 -x RINGATTN_NCCL_TIMEOUT_S=3 -x RINGATTN_TEST_STALL_EXCHANGE=1:2 \
  -x RINGATTN_EXCHANGE="$exchange" -x NCCL_NVLS_ENABLE=0 \
  "$gradcheck" --backend cuda --dtype bf16 --seq 4096 --heads 4 --head-dim 64 --causal \
  >"$log" 2>&1 &
launcher_pid=$!
stalled="" reported=""
while kill -0 "$launcher_pid" 2>/dev/null; do
  [[ -z $stalled ]] && grep -q "rank 1 stops for good before ring exchange 2" "$log" && stalled=$(now)
  [[ -z $reported ]] && grep -qF "$expect" "$log" && reported=$(now)
  if awk -v a="$(now)" -v b="$start" 'BEGIN { exit !(a - b > 60) }'; then
    echo "FAIL: still running 60 s after the start (a hang); output:"
    cat "$log"
    exit 1
  fi
  sleep 0.05
done
wait "$launcher_pid"
status=$?
ended=$(now)
launcher_pid=""
[[ -z $stalled ]] && grep -q "rank 1 stops for good before ring exchange 2" "$log" && stalled=$ended
[[ -z $reported ]] && grep -qF "$expect" "$log" && reported=$ended
failed=0
fail() { echo "FAIL: $*"; failed=1; }
(( status != 0 )) || fail "the job exited 0"
if [[ -z $stalled ]]; then
  fail "rank 1 never stalled (no RINGATTN_TEST_STALL_EXCHANGE message)"
elif [[ -z $reported ]]; then
  fail "no watchdog message '$expect'"
else
  to_report=$(awk -v a="$reported" -v b="$stalled" 'BEGIN { printf "%.2f", a - b }')
  to_end=$(awk -v a="$ended" -v b="$reported" 'BEGIN { printf "%.2f", a - b }')
  echo "stall to message: ${to_report} s (timeout 3 s); message to the end of every rank: ${to_end} s"
  awk -v t="$to_report" 'BEGIN { exit !(t <= 5) }' || fail "the message came ${to_report} s after the stall (timeout 3 s, allowed 5 s)"
  awk -v t="$to_end" 'BEGIN { exit !(t <= 5) }' || fail "the ranks ended ${to_end} s after the message (allowed 5 s)"
fi
if (( failed )); then
  echo "--- output (status $status):"
  cat "$log"
  exit 1
fi
echo "ok: status $status"
exit 0
