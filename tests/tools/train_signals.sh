#!/usr/bin/env bash
# Stop signals to ringattn-train on two CPU ranks, mid-run (steps of about 0.3 s):
#   ranks          SIGTERM to each rank, as a scheduler sends it: the step in flight is abandoned
#                  at a block boundary, the checkpoint is that of the last completed step (the last
#                  step in metrics.jsonl), the status is 143; resumed, the run's losses and
#                  gradient norms are those of an uninterrupted run, to every printed digit.
#   mpiexec        SIGTERM to mpiexec launched with --mca odls_base_sigkill_timeout 3: the ranks
#                  save the last completed step before OpenMPI's SIGKILL.
#   second_signal  two SIGTERMs to rank 0: the second ends it at once, and the job ends.
#   tests/tools/train_signals.sh CASE RINGATTN_TRAIN MPIEXEC SOURCE_DIR
# Exit 0: the case behaved; 1: it did not (what came is printed). Every process of a case is
# killed by its PID when the case runs past its time.
set -uo pipefail
case_name="$1" train="$2" mpiexec="$3" here="$4"
source "$here/bench/launch_env.sh"
work="$(mktemp -d "${TMPDIR:-/tmp}/ringattn-signals.XXXXXX")"
launcher_pid=""
cleanup() {
  if [[ -n $launcher_pid ]]; then
    pkill -KILL -P "$launcher_pid" 2>/dev/null
    kill -KILL "$launcher_pid" 2>/dev/null
  fi
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work" || exit 1
failed=0
fail() { echo "FAIL: $*"; failed=1; }
args=("$here/configs/tiny-cpu.yaml" --set train.seq_len=512 --set train.eval_every=0
      --set train.log_every=1)

# steps_in FILE: the step numbers of metrics.jsonl, one a line.
steps_in() { sed -n 's/^{"step": \([0-9]*\), "loss".*/\1/p' "$1" 2>/dev/null; }
# wait_for_steps N FILE: until metrics.jsonl holds N steps (20 s at most, while the job runs).
wait_for_steps() {
  for _ in $(seq 1 200); do
    if (( $(steps_in "$2" | wc -l) >= $1 )); then return 0; fi
    if ! kill -0 "$launcher_pid" 2>/dev/null; then return 1; fi
    sleep 0.1
  done
  return 1
}
# wait_exit PID SECONDS: waits for the launcher; sets status (124 when it ran past SECONDS).
wait_exit() {
  local deadline=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null; do
    if (( SECONDS >= deadline )); then status=124; return; fi
    sleep 0.1
  done
  wait "$1"
  status=$?
  launcher_pid=""
}
# check_stopped_at_last_step RUN_DIR LOG: the newest checkpoint is of the last completed step.
check_stopped_at_last_step() {
  last_step=$(steps_in "$1/metrics.jsonl" | tail -n 1)
  newest=$(ls "$1" | sed -n 's/^ckpt-\([0-9]*\)\.h5$/\1/p' | sort -n | tail -n 1)
  if [[ -z $last_step || -z $newest ]]; then
    fail "expected steps in metrics.jsonl and a checkpoint; found step '${last_step}', checkpoint '${newest}'"
  elif [[ $newest != "$last_step" ]]; then
    fail "the newest checkpoint is of step $newest but the last completed step is $last_step"
  fi
  if ! grep -qF "stop requested: " "$2"; then fail "the output lacks 'stop requested: '"; fi
}

case "$case_name" in
  ranks)
    steps=16
    "$mpiexec" -n 2 --oversubscribe "$train" "${args[@]}" --set train.steps=$steps \
      --set run.dir="$work/run" >out.log 2>&1 &
    launcher_pid=$!
    if ! wait_for_steps 3 run/metrics.jsonl; then fail "no 3 steps within 20 s"; fi
    ranks=$(pgrep -P "$launcher_pid" -f ringattn-train | tr '\n' ' ')
    if [[ $(wc -w <<<"$ranks") != 2 ]]; then fail "expected 2 rank processes; found '$ranks'"; fi
    kill -TERM $ranks
    wait_exit "$launcher_pid" 20
    if [[ $status == 124 ]]; then fail "still running 20 s after SIGTERM (a hang)"; fi
    if [[ $status == 0 ]]; then fail "exit status 0; expected nonzero (143 from the ranks)"; fi
    if ! grep -q "abandoned at a block boundary\|stopping after step" out.log; then
      fail "the output says neither where the step was abandoned nor after which step it stopped"
    fi
    check_stopped_at_last_step run out.log
    if (( last_step >= steps )); then fail "the run finished before the signal came (step $last_step)"; fi
    # Resumed to the end, against an uninterrupted run: every printed digit of each step.
    "$mpiexec" -n 2 --oversubscribe "$train" "${args[@]}" --set train.steps=$steps \
      --set run.dir="$work/run" --set run.resume=latest >resume.log 2>&1 ||
      fail "the resumed run failed: $(tail -n 5 resume.log)"
    grep -qF "at step $last_step" resume.log || fail "the resumed run did not start at step $last_step"
    "$mpiexec" -n 2 --oversubscribe "$train" "${args[@]}" --set train.steps=$steps \
      --set run.dir="$work/whole" >whole.log 2>&1 || fail "the uninterrupted run failed"
    fields() { grep '"loss"' "$1" | sed 's/, "tokens_per_s".*//' | awk -v k="$2" -F'[ ,]' '$2 > k'; }
    resumed=$(fields run/metrics.jsonl "$last_step" | sort -u -k2,2n)
    whole=$(fields whole/metrics.jsonl "$last_step")
    if [[ -z $whole || $resumed != "$whole" ]]; then
      fail "the resumed steps differ from the uninterrupted run's:"$'\n'"resumed:"$'\n'"$resumed"$'\n'"whole:"$'\n'"$whole"
    fi
    ;;
  mpiexec)
    "$mpiexec" --mca odls_base_sigkill_timeout 3 -n 2 --oversubscribe "$train" "${args[@]}" \
      --set train.steps=1000 --set run.dir="$work/run" >out.log 2>&1 &
    launcher_pid=$!
    if ! wait_for_steps 3 run/metrics.jsonl; then fail "no 3 steps within 20 s"; fi
    kill -TERM "$launcher_pid"
    # OpenMPI forwards SIGTERM after 3 s and sends SIGKILL 3 s later.
    wait_exit "$launcher_pid" 20
    if [[ $status == 124 ]]; then fail "still running 20 s after SIGTERM (a hang)"; fi
    grep -qF "a stop signal leaves 3 s before SIGKILL" out.log ||
      fail "the output lacks the kill timeout beside the checkpoint write time"
    check_stopped_at_last_step run out.log
    ;;
  second_signal)
    # Longer blocks (seq_len 2048), so that the second signal comes before the first one's stop
    # at a block boundary; 0.1 s apart, so that the kernel delivers both.
    "$mpiexec" -n 2 --oversubscribe "$train" "${args[@]}" --set train.seq_len=2048 \
      --set train.steps=1000 --set run.dir="$work/run" >out.log 2>&1 &
    launcher_pid=$!
    if ! wait_for_steps 1 run/metrics.jsonl; then fail "no step within 20 s"; fi
    rank0=$(pgrep -P "$launcher_pid" -f ringattn-train | head -n 1)
    kill -TERM "$rank0"; sleep 0.1; kill -TERM "$rank0"
    wait_exit "$launcher_pid" 15
    if [[ $status == 124 ]]; then fail "still running 15 s after two signals (a hang)"; fi
    if [[ $status == 0 ]]; then fail "exit status 0; expected nonzero"; fi
    grep -qF "a second stop signal: exiting now" out.log || fail "the output lacks 'a second stop signal: exiting now'"
    ;;
  *) echo "train_signals.sh: unknown case '$case_name'" >&2; exit 2 ;;
esac
echo "case $case_name: status ${status:-?}"
if [[ $failed -ne 0 ]]; then
  for log in out.log resume.log; do
    if [[ -f $log ]]; then echo "--- $log:"; tail -n 30 "$log"; fi
  done
fi
exit $failed
