# Sourced (from the repository root) by the bench scripts that launch ranks: NCCL's NVLink
# multicast off unless the caller chose (the reference machines leave it off), mpiexec allowed
# to run as root (the GPU machines' user), and ranks left unbound unless the caller chose (OpenMPI
# would hold each of up to two ranks, with its CUDA and NCCL threads, to one core; PyTorch, which
# the benchmarks compare against, runs unbound).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export OMPI_MCA_hwloc_base_binding_policy="${OMPI_MCA_hwloc_base_binding_policy:-none}"
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
