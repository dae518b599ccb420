// Kernel instantiations for f16 inputs with head_dim 192 for Q and K and 128 for V and O
// (multi-head latent attention), built with head_dim 192 (RINGATTN_CUDA_HEAD_DIMS).
#include "kernels/cuda/flash_launch.cuh"

RINGATTN_INSTANTIATE_FLASH_VALUE_DIM(ringattn::DType::f16, 192, 128);
