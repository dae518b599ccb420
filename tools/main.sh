#!/usr/bin/env bash
# Builds ringattn and runs the main job: ringattn-train with its embedded default (the tiny-cpu
# config: a small transformer on the synthetic retrieval task, context-parallel over 2 CPU
# ranks with ring attention). Arguments go to ringattn-train (e.g. --set train.steps=200, or a
# config file). The trainer's GPU backend is not built yet: GPUs, when present, stay unused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/build.sh --quiet
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# A progress bar when this script writes to a terminal, plain lines otherwise.
if [[ -t 1 ]]; then export RINGATTN_PROGRESS=1; else export RINGATTN_PROGRESS=0; fi
# One thread a rank: the two ranks share the machine's cores.
export RINGATTN_NUM_THREADS="${RINGATTN_NUM_THREADS:-$(( ($(nproc) + 1) / 2 ))}"
exec mpiexec -n 2 --oversubscribe build/ringattn-train "$@"
