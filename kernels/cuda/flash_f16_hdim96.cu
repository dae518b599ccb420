// Kernel instantiations for f16 inputs with head_dim 96.
#include "kernels/cuda/flash_launch.cuh"

RINGATTN_INSTANTIATE_FLASH(ringattn::DType::f16, 96);
