#!/usr/bin/env bash
# The CPU backend's threads a rank as ringattn-train's startup line states them
# (parallel/host_threads.hpp), against counts worked out here from the machine:
#   unbound, 2 ranks          max(1, min(CPUs this shell may use, online CPUs / 2))
#   taskset to one CPU        1 (the rank's affinity mask)
#   RINGATTN_NUM_THREADS=3    3 (the variable wins)
# Usage: tests/train/threads_a_rank.sh RINGATTN_TRAIN MPIEXEC CONFIG
set -uo pipefail
train="${1:?usage: threads_a_rank.sh RINGATTN_TRAIN MPIEXEC CONFIG}" mpiexec="$2" config="$3"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0
threads_of() {  # RANKS [ENV...]: the count on the startup line
  local ranks="$1"
  shift
  env -u RINGATTN_NUM_THREADS "$@" "$mpiexec" -n "$ranks" --oversubscribe --bind-to none "$train" \
    "$config" --set parallel.cp="$ranks" --set train.steps=1 --set train.warmup_steps=0 \
    --set train.eval_every=0 --set train.checkpoint_every=0 --set run.dir="$tmp/run$RANDOM" \
    2>&1 | sed -n 's/.*backend cpu fp32 (\([0-9]*\) threads\{0,1\} a rank).*/\1/p' | head -1
}
expect() {  # WHAT EXPECTED GOT: threads a rank
  if [[ "$3" == "$2" ]]; then
    echo "ok: $1: $3 (expected $2)"
  else
    echo "FAILED: $1: ${3:-no count on the startup line} (expected $2)"
    failures=$((failures + 1))
  fi
}
online="$(getconf _NPROCESSORS_ONLN)" allowed="$(nproc)"
part=$((online / 2)); [[ $allowed -lt $part ]] && part=$allowed; [[ $part -lt 1 ]] && part=1
expect "2 unbound ranks ($allowed CPUs allowed, $online online)" "$part" "$(threads_of 2)"
expect "1 rank held to CPU 0 by taskset" 1 "$(threads_of 1 taskset -c 0)"
expect "RINGATTN_NUM_THREADS=3" 3 "$(threads_of 1 RINGATTN_NUM_THREADS=3)"
exit $((failures > 0))
