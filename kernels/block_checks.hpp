// What the local block of each memory takes, checkable without running it: one place for the
// rules that the CUDA dispatch applies before a launch and that a ring checks on every rank before
// its first transfer (a rank failing inside the ring would leave its peers waiting).
#pragma once

#include <cstdint>
#include <string>

#include "ringattn/config.h"
#include "ringattn/tensor.hpp"

namespace ringattn::detail {

// The head dims this build of the CUDA block has kernels for (RINGATTN_CUDA_HEAD_DIMS, all of
// kAllCudaBlockHeadDims by default), the one list every check and message names. The dispatch
// table (kernels/cuda/flash_dispatch.cpp) instantiates each for bf16 and f16, and checks at
// compile time that it holds exactly these.
inline constexpr std::int64_t kCudaBlockHeadDims[] = {RINGATTN_CUDA_HEAD_DIMS_LIST};
inline constexpr std::int64_t kAllCudaBlockHeadDims[] = {RINGATTN_ALL_CUDA_HEAD_DIMS_LIST};

bool cuda_block_takes_head_dim(std::int64_t head_dim);
// kCudaBlockHeadDims for a message: "32, 64, 96, 128, 192 or 256".
std::string cuda_block_head_dims_text();

// Input dtypes and head dims: f32/f64 (any head_dim, any v_head_dim) on the host (CPU block),
// bf16/f16 with one head_dim of kCudaBlockHeadDims for Q, K and V on the device (CUDA block). A
// head dim without kernels is ErrorKind::unsupported: "head_dim 48 is not supported; the CUDA
// block takes 32, 64, 96, 128, 192 or 256" (one that a build left out says so), and so is a v_head_dim other than head_dim on the device, naming both.
void check_block_dtype(DType dtype, std::int64_t head_dim, std::int64_t v_head_dim, Memory memory,
                       const char* where);
// The same where V has the head_dim of Q and K.
void check_block_dtype(DType dtype, std::int64_t head_dim, Memory memory, const char* where);
// On the device, the layout of one tensor: unit stride along head_dim, rows in 16-byte units for
// 16-bit tensors and 8-byte units for fp32 ones, aligned data. Host tensors and rank-3 row
// statistics have no layout rule.
void check_block_layout(const TensorView& t, const char* name, const char* where);

}  // namespace ringattn::detail
