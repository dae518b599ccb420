# Sourced (from the repository root) by the bench scripts that launch ranks: NCCL's NVLink
# multicast off unless the caller chose (the reference machines leave it off), and mpiexec allowed
# to run as root (the GPU machines' user).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
