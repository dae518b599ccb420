#!/usr/bin/env bash
# Installs what the build needs where it is missing (tools/deps.sh: Debian/Ubuntu packages, through
# apt-get), builds ringattn and runs the main job: ringattn-train with its embedded default, a small
# transformer on the synthetic retrieval task with ring attention over the context-parallel ranks:
# on a machine with NVIDIA GPUs (and a ringattn built with CUDA) one rank per GPU on the CUDA
# backend, 256 tokens and then a 16k context, elsewhere the tiny-cpu config on 2 CPU ranks. Arguments go to
# ringattn-train (e.g. --set train.steps=200, or a config file).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/deps.sh
tools/build.sh --quiet
# mpiexec as root where needed, NVLink multicast off, ranks unbound: OpenMPI would hold each of two
# ranks to one core with all of its threads (the CPU backend's, CUDA's, NCCL's); each CPU rank then
# takes its part of the cores itself (parallel/host_threads.hpp).
source bench/launch_env.sh
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# On Ctrl-C or SIGTERM, OpenMPI passes the signal on to the ranks after this many seconds and
# SIGKILLs them as many seconds later (its default, 1 s, leaves no time for a checkpoint). The
# ranks stop at the next block boundary and save the last completed step; the trainer prints a
# checkpoint's write time beside this timeout before step 1, and warns where it is too short.
export OMPI_MCA_odls_base_sigkill_timeout="${OMPI_MCA_odls_base_sigkill_timeout:-10}"
# A progress bar when this script writes to a terminal, plain lines otherwise.
if [[ -t 1 ]]; then export RINGATTN_PROGRESS=1; else export RINGATTN_PROGRESS=0; fi
ranks=2
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  if [[ ${gpus:-0} -gt 0 ]] && grep -q '#define RINGATTN_WITH_CUDA 1' build/include/ringattn/config.h 2>/dev/null; then
    ranks=$gpus
  fi
fi
exec mpiexec -n "$ranks" --oversubscribe build/ringattn-train "$@"
