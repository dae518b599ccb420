// Kernel instantiations for bf16 inputs with head_dim 256.
#include "kernels/cuda/flash_launch.cuh"

RINGATTN_INSTANTIATE_FLASH(ringattn::DType::bf16, 256);
