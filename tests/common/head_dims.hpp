// The CUDA block's head dims as this build has them (RINGATTN_CUDA_HEAD_DIMS through
// ringattn/config.h), spelled out here independently of the library's own message code, and head
// dims that no build has kernels for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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

}  // namespace ringattn::test
