# Sourced (from the repository root) by tools/main.sh and the bench scripts that launch ranks:
# NCCL's NVLink multicast off unless the caller chose (the reference machines leave it off),
# mpiexec allowed to run as root (the GPU machines' user), and ranks left unbound unless the caller
# chose (OpenMPI would hold each of up to two ranks, with its CUDA and NCCL threads, to one core;
# PyTorch, which the benchmarks compare against, runs unbound). Also small_model_args, the
# ringattn-train arguments of the 188M model's timed runs.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export OMPI_MCA_hwloc_base_binding_policy="${OMPI_MCA_hwloc_base_binding_policy:-none}"
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# small_model_args SEQ BATCH RECOMPUTE CP STEPS RUN_DIR: sets the array small_model_args to
# configs/small-32k.yaml on the synthetic retrieval task at that shape, on the CUDA backend, with
# 2 warm-up steps of the schedule, a log line every step, no evaluation and no checkpoints.
small_model_args() {
  small_model_args=(configs/small-32k.yaml --set data.source=retrieval --set train.seq_len="$1"
    --set train.batch_size="$2" --set train.recompute="$3" --set parallel.cp="$4"
    --set train.steps="$5" --set train.warmup_steps=2 --set train.log_every=1
    --set train.eval_every=0 --set train.checkpoint_every=0 --set run.dir="$6"
    --set run.backend=cuda)
}
