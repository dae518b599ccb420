// The CUDA block's head dims as this build has them (RINGATTN_CUDA_HEAD_DIMS through
// ringattn/config.h), spelled out here independently of the library's own message code, and head
// dims that no build has kernels for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ringattn/config.h"

namespace ringattn::test {

inline constexpr std::int64_t kBuiltCudaHeadDims[] = {RINGATTN_CUDA_HEAD_DIMS_LIST};
inline constexpr std::int64_t kNoCudaHeadDims[] = {16, 48, 80, 160, 320};

// "32, 64, 96, 128, 192 or 256": how the messages list kBuiltCudaHeadDims.
inline std::string built_cuda_head_dims_text() {
  constexpr std::size_t kCount = sizeof(kBuiltCudaHeadDims) / sizeof(kBuiltCudaHeadDims[0]);
  std::string text;
  for (std::size_t i = 0; i < kCount; ++i) {
    if (i > 0) text += i + 1 == kCount ? " or " : ", ";
    text += std::to_string(kBuiltCudaHeadDims[i]);
  }
  return text;
}

// Head dim 192 for Q and K with 128 for V and O (multi-head latent attention): the one pair of a V
// of its own width that the CUDA block has kernels for, built with head dim 192.
inline constexpr std::int64_t kCudaPairHeadDim = 192, kCudaPairValueDim = 128;
inline constexpr bool kBuiltCudaValueDimPair = RINGATTN_CUDA_HEAD_DIM_192 != 0;

// Q and K of head_dim columns, V and O of v_head_dim.
struct CudaDims {
  std::int64_t head_dim, v_head_dim;
};

// What this build's CUDA block takes: every built head dim with itself, then 192/128 where built.
inline std::vector<CudaDims> built_cuda_dims() {
  std::vector<CudaDims> dims;
  for (const std::int64_t d : kBuiltCudaHeadDims) dims.push_back({d, d});
  if (kBuiltCudaValueDimPair) dims.push_back({kCudaPairHeadDim, kCudaPairValueDim});
  return dims;
}

// The refusal of head_dim d with v_head_dim dv (dv != d, not the pair above) on the device:
// "v has head_dim 64 but q and k have 128; the CUDA block takes one head_dim for q, k and v (32,
// 64, 96, 128, 192 or 256), or head_dim 192 with v_head_dim 128; other v_head_dims run on the CPU
// block only" (without the pair where the build left it out).
inline std::string cuda_value_dim_refusal(std::int64_t d, std::int64_t dv) {
  return "v has head_dim " + std::to_string(dv) + " but q and k have " + std::to_string(d) +
         "; the CUDA block takes one head_dim for q, k and v (" + built_cuda_head_dims_text() +
         ")" + (kBuiltCudaValueDimPair ? ", or head_dim 192 with v_head_dim 128" : "") +
         "; other v_head_dims run on the CPU block only";
}

// The refusal of the pair above by a build without head dim 192.
inline std::string cuda_value_dim_pair_left_out() {
  return "head_dim 192 with v_head_dim 128 was left out of this build (RINGATTN_CUDA_HEAD_DIMS); "
         "the CUDA block here takes one head_dim for q, k and v (" +
         built_cuda_head_dims_text() +
         "), and a build with all takes head_dim 192 with v_head_dim 128 too";
}

}  // namespace ringattn::test
