#!/usr/bin/env bash
# Runs a command with only the GPU of this rank's node-local rank visible:
#   mpiexec -n N tests/one_gpu_per_rank.sh COMMAND [ARGS...]
# Each process then sees one device and cannot reach its neighbours' memory directly, which the
# exchange path tests use to take away the copy engines.
set -euo pipefail
local_rank="${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${SLURM_LOCALID:-}}}"
if [[ -z "$local_rank" ]]; then
  echo "one_gpu_per_rank.sh: no node-local rank in the environment (OMPI_COMM_WORLD_LOCAL_RANK," \
       "MPI_LOCALRANKID or SLURM_LOCALID)" >&2
  exit 2
fi
export CUDA_VISIBLE_DEVICES="$local_rank"
exec "$@"
