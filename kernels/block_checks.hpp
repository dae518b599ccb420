// What the local block of each memory takes, checkable without running it: one place for the
// rules that the CUDA dispatch applies before a launch and that a ring checks on every rank before
// its first transfer (a rank failing inside the ring would leave its peers waiting).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "ringattn/config.h"
#include "ringattn/tensor.hpp"

namespace ringattn::detail {

// The head dims this build of the CUDA block has kernels for (RINGATTN_CUDA_HEAD_DIMS, all of
// kAllCudaBlockHeadDims by default), the one list every check and message names. The dispatch
// table (kernels/cuda/flash_dispatch.cpp) instantiates each for bf16 and f16, and each pair of
// kCudaBlockValueDimPairs below, and checks at compile time that it holds exactly these.
inline constexpr std::int64_t kCudaBlockHeadDims[] = {RINGATTN_CUDA_HEAD_DIMS_LIST};
inline constexpr std::int64_t kAllCudaBlockHeadDims[] = {RINGATTN_ALL_CUDA_HEAD_DIMS_LIST};

bool cuda_block_takes_head_dim(std::int64_t head_dim);
// kCudaBlockHeadDims for a message: "32, 64, 96, 128, 192 or 256".
std::string cuda_block_head_dims_text();

// Q and K of head_dim columns (d_qk), V and O of v_head_dim (d_v).
struct HeadDimPair {
  std::int64_t head_dim, v_head_dim;
};
// The pairs with a V of its own width (d_v != d_qk) that the CUDA block has kernels for
// (multi-head latent attention's 192/128, on the sm_80 family on every GPU), each built with its
// head_dim (RINGATTN_CUDA_HEAD_DIMS): those of this build and those of a build with every head dim.
inline constexpr std::array<HeadDimPair, 1> kAllCudaBlockValueDimPairs = {{{192, 128}}};
#if RINGATTN_CUDA_HEAD_DIM_192
inline constexpr std::array<HeadDimPair, 1> kCudaBlockValueDimPairs = {{{192, 128}}};
#else
inline constexpr std::array<HeadDimPair, 0> kCudaBlockValueDimPairs = {};
#endif

// head_dim with v_head_dim is one of kCudaBlockValueDimPairs.
bool cuda_block_takes_value_dim(std::int64_t head_dim, std::int64_t v_head_dim);
// kCudaBlockValueDimPairs for a message: "head_dim 192 with v_head_dim 128" (empty without any).
std::string cuda_block_value_dims_text();

// Input dtypes and head dims: f32/f64 (any head_dim, any v_head_dim) on the host (CPU block),
// bf16/f16 on the device (CUDA block) with one head_dim of kCudaBlockHeadDims for Q, K and V, or
// a pair of kCudaBlockValueDimPairs (head_dim 192 with v_head_dim 128). A head dim without kernels
// is ErrorKind::unsupported: "head_dim 48 is not supported; the CUDA block takes 32, 64, 96, 128,
// 192 or 256" (one that a build left out says so), and so is any other v_head_dim than head_dim
// on the device: "v has head_dim 64 but q and k have 128; the CUDA block takes one head_dim for
// q, k and v (32, 64, 96, 128, 192 or 256), or head_dim 192 with v_head_dim 128; ..." (a pair
// that a build left out says so).
void check_block_dtype(DType dtype, std::int64_t head_dim, std::int64_t v_head_dim, Memory memory,
                       const char* where);
// The same where V has the head_dim of Q and K.
void check_block_dtype(DType dtype, std::int64_t head_dim, Memory memory, const char* where);
// On the device, the layout of one tensor: unit stride along head_dim, rows in 16-byte units for
// 16-bit tensors and 8-byte units for fp32 ones, aligned data. Host tensors and rank-3 row
// statistics have no layout rule.
void check_block_layout(const TensorView& t, const char* name, const char* where);

}  // namespace ringattn::detail
