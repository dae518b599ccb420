#!/usr/bin/env bash
# The driver of the fault-injection suite (ctest -L faults): runs one case of one category's table
# (tests/faults/CATEGORY.sh) in a fresh temporary directory and asserts its outcome:
#   - the exit status: nonzero (or the exact status the case names), and never that of a crash (a
#     signal, >= 128, unless the case itself sends one) nor a text of one ("terminate called",
#     "Segmentation fault", ...);
#   - the message: every expected text in the output, the first one on exactly `expect_count` lines
#     (1 where every rank met the fault alike and the program says it once), or on a line
#     "rank R: ..." of every rank R below `expect_ranks` where each rank says it;
#   - the time: done within `time_limit_s` (20 s), and, after a rank was killed, within
#     `after_kill_s`. A case still running at `hang_s` (60 s) is a hang: every process of its
#     session (the command is started with setsid, so its ranks stay in it whatever process group
#     they take) is killed by PID and the case fails; so does a case that leaves any process behind.
#
#   tests/faults/run_case.sh CATEGORY CASE BUILD_DIR SOURCE_DIR
#
# BUILD_DIR holds the programs (ringattn-train, ...); RINGATTN_FAULTS_CAPI, RINGATTN_FAULTS_TOKENS
# and RINGATTN_FAULTS_MPIEXEC name the helper programs and mpiexec (tests/CMakeLists.txt sets them;
# the defaults suit a build of this tree by hand). Exit 0: the case behaved; 1: it did not (what
# came is printed); 2: a usage error or an unknown case.
# shellcheck disable=SC2034,SC2317  # what the tables use looks unused to shellcheck
set -uo pipefail

if [[ $# -ne 4 ]]; then
  echo "usage: run_case.sh CATEGORY CASE BUILD_DIR SOURCE_DIR" >&2
  exit 2
fi
category=$1 case_name=$2 build=$(cd "$3" && pwd) source=$(cd "$4" && pwd)
faults="$source/tests/faults"
if [[ ! -f $faults/$category.sh ]]; then
  echo "run_case.sh: no table $faults/$category.sh" >&2
  exit 2
fi
source "$source/bench/launch_env.sh"

work=$(mktemp -d "${TMPDIR:-/tmp}/ringattn-fault.XXXXXX")
trap 'cd /; rm -rf "$work"' EXIT
cd "$work" || exit 2

# ---- what the tables use ---------------------------------------------------------------------

train="$build/ringattn-train"
capi=${RINGATTN_FAULTS_CAPI:-$build/tests/ringattn_faults_capi}
tokens=${RINGATTN_FAULTS_TOKENS:-$build/tests/ringattn_faults_tokens}
mpiexec=${RINGATTN_FAULTS_MPIEXEC:-mpiexec}
tiny_yaml="$source/configs/tiny-cpu.yaml"
np2=("$mpiexec" -n 2 --oversubscribe)
# The tiny CPU config, named (so that a GPU on the machine does not change a case), short, without
# evaluation, its run directory in the case's directory; tiny1 on one rank (parallel.cp 1).
tiny=("$tiny_yaml" --set train.steps=12 --set train.eval_every=0 --set run.dir="$work/run")
tiny1=("${tiny[@]}" --set parallel.cp=1)
# The fastest real run: one rank, 16 tokens, one sequence a step.
quick=("$tiny_yaml" --set parallel.cp=1 --set train.warmup_steps=0 --set train.eval_every=0
       --set train.seq_len=16 --set train.batch_size=1)

# setup_failed TEXT: the case's preparation went wrong (not the product): report and stop.
setup_failed() {
  echo "SETUP FAILED ($category.$case_name): $*"
  exit 1
}

# derive_config OUT SED_SCRIPT: tiny-cpu.yaml edited by sed; the edit must change the file.
derive_config() {
  sed "$2" "$tiny_yaml" >"$1" || setup_failed "sed '$2'"
  ! cmp -s "$tiny_yaml" "$1" || setup_failed "sed '$2' left $tiny_yaml as it was"
}

# make_checkpoint RUN_DIR [ARGS...]: a real checkpoint RUN_DIR/ckpt-1.h5 of one step of the quick
# run (ARGS change its model, or its steps: ckpt-STEPS.h5), made by ringattn-train on one rank.
make_checkpoint() {
  local dir=$1
  shift
  "$train" "${quick[@]}" --set train.steps=1 --set run.dir="$dir" "$@" >"$dir.log" 2>&1 ||
    setup_failed "ringattn-train could not make a checkpoint in $dir: $(tail -3 "$dir.log")"
  compgen -G "$dir/ckpt-*.h5" >/dev/null || setup_failed "no checkpoint in $dir"
}

# make_tokens OUT COUNT [KEY=VALUE...]: an HDF5 token dataset (tests/faults/make_tokens.c).
make_tokens() {
  "$tokens" "$@" || setup_failed "ringattn_faults_tokens $*"
}

# text_dataset OUT BYTES: OUT.train.h5 of BYTES bytes of text, made by ringattn-data.
text_dataset() {
  head -c "$2" "$source/README.md" >"$1.txt"
  [[ $(stat -c %s "$1.txt") -eq $2 ]] || setup_failed "README.md has fewer than $2 bytes"
  "$build/ringattn-data" --val-fraction 0 --out "$1" "$1.txt" >/dev/null ||
    setup_failed "ringattn-data --out $1"
}

# flip_byte FILE OFFSET: inverts the bits of one byte of FILE.
flip_byte() {
  local byte
  byte=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf '%b' "\\0$(printf %03o $((255 - byte)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

# rank_pid RANK: the PID of the MPI rank RANK among the case's processes ("" if none yet).
rank_pid() {
  local pid
  for pid in $(ps -o pid= -s "$session"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1"; then
      echo "$pid"
      return
    fi
  done
}

# wait_for_output TEXT: waits (15 s at most) until the output holds TEXT; false if it never did.
wait_for_output() {
  local tries
  for ((tries = 0; tries < 150; ++tries)); do
    grep -qF -- "$1" out.log && return 0
    kill -0 "$session" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# kill_rank_when TEXT RANK SIGNAL (a `during` hook): once the output holds TEXT, sends SIGNAL to
# rank RANK (or, for RANK "launcher", to mpiexec itself) and notes the time.
kill_rank_when() {
  local pid
  wait_for_output "$1" || { failures+=("the output never held '$1', so nothing was killed"); return; }
  if [[ $2 == launcher ]]; then pid=$session; else pid=$(rank_pid "$2"); fi
  [[ -n $pid ]] || { failures+=("no process of rank $2 found"); return; }
  kill "-$3" "$pid"
  killed_ms=$(now_ms)
  echo "# sent SIG$3 to $2 (PID $pid) at $(((killed_ms - start_ms) / 1000)) s" >>"$work/notes"
}

# sends_signal N: the case itself kills a process with signal N: mpiexec may end with 128 + N and
# say that a rank "exited on signal N"; any other signal a rank dies of is still a crash.
sends_signal() {
  allow_status=$((128 + $1))
  local texts=() text
  for text in "${crash_texts[@]}"; do [[ $text != "exited on signal" ]] && texts+=("$text"); done
  for text in 4 6 7 8 11; do [[ $text != "$1" ]] && texts+=("exited on signal $text "); done
  crash_texts=("${texts[@]}")
}

# kill_rank_after SECONDS RANK SIGNAL (a `during` hook), for programs whose output stays in their
# buffers until they end: SECONDS after the start, with both ranks running, sends SIGNAL to rank
# RANK and notes the time.
kill_rank_after() {
  local pid tries
  sleep "$1"
  for ((tries = 0; tries < 50; ++tries)); do
    pid=$(rank_pid "$2")
    [[ -n $pid && -n $(rank_pid $((1 - $2))) ]] && break
    sleep 0.1
  done
  [[ -n $pid ]] || { failures+=("no process of rank $2 found"); return; }
  kill "-$3" "$pid"
  killed_ms=$(now_ms)
  echo "# sent SIG$3 to rank $2 (PID $pid) at $(((killed_ms - start_ms) / 1000)) s" >>"$work/notes"
}

now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }

# ---- the case --------------------------------------------------------------------------------

command=()           # what runs (under setsid)
expect=()            # texts the output must hold; the first one counted
expect_count=1       # lines holding expect[0] ("" to skip the count)
expect_ranks=0       # >0: each rank below it prints "rank R: ...expect[0]..."
absent=()            # texts the output must not hold
expect_status=nonzero  # or a number
allow_status=""      # a status >= 128 that this case causes on purpose (it sends the signal)
time_limit_s=20
hang_s=60
after_kill_s=10      # how long the other ranks may take to end after a kill
during=()            # a command (with arguments) run while the case runs
after=""             # a function run after the case, to check what it left (appends to failures)
vm_limit_kb=""       # ulimit -v for the command, for cases that would take all memory
crash_texts=("terminate called" "Segmentation fault" "core dumped" "double free" "stack smashing"
             "Floating point exception" "Illegal instruction" "Bus error" "AddressSanitizer"
             "exited on signal" "Signal: " "Assertion")

# shellcheck source=/dev/null
source "$faults/$category.sh"
if ! define_case "$case_name"; then
  echo "run_case.sh: no case '$case_name' in $faults/$category.sh" >&2
  exit 2
fi
[[ ${#command[@]} -gt 0 ]] || setup_failed "the case sets no command"
[[ ${#expect[@]} -gt 0 ]] || setup_failed "the case expects no message"

# ---- run it ----------------------------------------------------------------------------------

failures=()
killed_ms=""
start_ms=$(now_ms)
(
  [[ -n $vm_limit_kb ]] && ulimit -v "$vm_limit_kb"
  exec setsid "${command[@]}"
) >out.log 2>&1 </dev/null &
# This script has no job control, so the subshell is no process group leader and setsid makes its
# PID the session: every process the command starts stays in that session (OpenMPI puts each rank
# in a process group of its own, so a process group would not hold them).
session=$!

# kill_session SIGNAL: sends SIGNAL to every process of the case's session, by PID; prints them.
kill_session() {
  local pids
  read -r -d '' -a pids < <(ps -o pid= -s "$session")
  [[ ${#pids[@]} -gt 0 ]] && kill "-$1" "${pids[@]}" 2>/dev/null
  echo "${pids[*]}"
}

# The watchdog: at hang_s it notes the hang and kills the session (SIGTERM, then SIGKILL). It waits
# in `read -t` on a FIFO for the word that the case ended: it is never killed (a subshell killed
# before it has reset the traps it inherits would run this script's EXIT trap).
mkfifo "$work/watchdog"
exec {watchdog_fd}<>"$work/watchdog"
(
  read -r -t "$hang_s" -u "$watchdog_fd" && exit 0
  kill_session TERM >"$work/hung"
  sleep 2
  kill_session KILL >/dev/null
) &
watchdog=$!

[[ ${#during[@]} -gt 0 ]] && "${during[@]}"
wait "$session" 2>/dev/null  # not bash's "Killed" line of a case that kills mpiexec
status=$?
end_ms=$(now_ms)
echo ended >&"$watchdog_fd"
wait "$watchdog"
exec {watchdog_fd}>&-
hung=""
[[ -f $work/hung ]] && hung="$(cat "$work/hung")"
elapsed_ms=$((end_ms - start_ms))
seconds="$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))"

# Processes of the case still running once it ended (ranks orphaned by a killed mpiexec, ranks
# mpiexec took down and has not reaped): given 5 s to go (mpiexec's SIGKILL of the ranks it stops
# comes 1 s after its SIGTERM), or after_kill_s from a kill; then killed, and the case fails.
grace_ms=5000
[[ -n $killed_ms ]] && grace_ms=$((killed_ms + after_kill_s * 1000 - end_ms))
left=""
while :; do
  left=$(ps -o pid=,args= -s "$session")
  [[ -z $left ]] && break
  (($(now_ms) - end_ms > grace_ms)) && break
  sleep 0.1
done
gone_ms=$(now_ms)
if [[ -n $left ]]; then
  kill_session KILL >/dev/null
  failures+=("processes still running $(((gone_ms - end_ms) / 1000)) s after the case ended (killed now): ${left//$'\n'/; }")
fi

# ---- check it --------------------------------------------------------------------------------

if [[ -n $hung ]]; then
  failures+=("still running after $hang_s s (a hang); killed the PIDs of its session: $hung")
elif [[ $expect_status == nonzero && $status -eq 0 ]]; then
  failures+=("exit status 0; expected nonzero (the fault was accepted)")
elif [[ $expect_status != nonzero && $status -ne $expect_status ]]; then
  failures+=("exit status $status; expected $expect_status")
fi
if [[ -z $hung && $status -ge 128 && $status != "$allow_status" ]]; then
  failures+=("exit status $status: ended by signal $((status - 128)) (a crash)")
fi
for text in "${crash_texts[@]}"; do
  if grep -qF -- "$text" out.log; then failures+=("the output holds '$text' (a crash)"); fi
done
if ((elapsed_ms > time_limit_s * 1000)); then
  failures+=("took $seconds s; expected under $time_limit_s s")
fi
if [[ -n $killed_ms ]] && ((gone_ms - killed_ms > after_kill_s * 1000)); then
  failures+=("the last process ended $(((gone_ms - killed_ms) / 1000)) s after the kill; expected under $after_kill_s s")
fi
[[ -n $killed_ms ]] && echo "# every process gone $((gone_ms - killed_ms)) ms after the kill" >>notes
for text in "${expect[@]}"; do
  if ! grep -qF -- "$text" out.log; then failures+=("the output lacks '$text'"); fi
done
if [[ -n $expect_count ]]; then
  found=$(grep -cF -- "${expect[0]}" out.log)
  if [[ $found -ne $expect_count ]]; then
    failures+=("'${expect[0]}' printed on $found lines; expected $expect_count")
  fi
fi
for ((rank = 0; rank < expect_ranks; ++rank)); do
  if ! grep "^rank $rank: " out.log | grep -qF -- "${expect[0]}"; then
    failures+=("rank $rank printed no line 'rank $rank: ...${expect[0]}'")
  fi
done
for text in "${absent[@]}"; do
  if grep -qF -- "$text" out.log; then failures+=("the output holds '$text', which it should not"); fi
done
[[ -n $after ]] && $after

echo "case $category.$case_name: exit $status in $seconds s"
[[ -f notes ]] && cat notes
if [[ ${#failures[@]} -eq 0 ]]; then
  exit 0
fi
printf 'FAIL: %s\n' "${failures[@]}"
printf -- '--- command:'
printf ' %q' "${command[@]}"
printf '\n'
echo "--- output:"
cat out.log
exit 1
