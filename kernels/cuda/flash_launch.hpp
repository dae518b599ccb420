// Host entry points of the compiled kernel instantiations, one (dtype, head_dim, v_head_dim) per
// .cu file so that builds parallelise. Runtime flags (causal, combine, deterministic) pick among
// the kernel variants inside each file. Only flash_dispatch.cpp calls these.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/flash_params.hpp"
#include "ringattn/dtype.hpp"

namespace ringattn::cuda_detail {

// kHeadDim: the columns of Q and K (d_qk); kValueDim: those of V and O (d_v), kHeadDim but for
// the pairs of kernels/block_checks.hpp's kCudaBlockValueDims. `hopper`: the sm_90a family
// (flash_forward_sm90.cuh, flash_backward_sm90.cuh), which has kernels for d_qk == d_v in {64,
// 128} only; the caller checks that the GPU runs it, every other pair runs the sm_80 family.
template <DType kDtype, int kHeadDim, int kValueDim = kHeadDim>
void launch_forward(const FlashParams& params, bool combine, bool hopper, cudaStream_t stream);

// delta = rowsum(dO * O) (dO and O of kValueDim), then dK/dV (and dQ, with atomics unless
// deterministic).
template <DType kDtype, int kHeadDim, int kValueDim = kHeadDim>
void launch_backward_prepare(const FlashParams& params, cudaStream_t stream);
template <DType kDtype, int kHeadDim, int kValueDim = kHeadDim>
void launch_backward(const FlashParams& params, bool deterministic, bool hopper,
                     cudaStream_t stream);

}  // namespace ringattn::cuda_detail
