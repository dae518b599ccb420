// What the local block of each memory takes, checkable without running it: one place for the
// rules that the CUDA dispatch applies before a launch and that a ring checks on every rank before
// its first transfer (a rank failing inside the ring would leave its peers waiting).
#pragma once

#include <cstdint>

#include "ringattn/tensor.hpp"

namespace ringattn::detail {

// Input dtypes and head dims: f32/f64 on the host (CPU block), bf16/f16 with head_dim 64 or 128
// on the device (CUDA block).
void check_block_dtype(DType dtype, std::int64_t head_dim, Memory memory, const char* where);
// On the device, the layout of one tensor: unit stride along head_dim, rows in 16-byte units for
// 16-bit tensors and 8-byte units for fp32 ones, aligned data. Host tensors and rank-3 row
// statistics have no layout rule.
void check_block_layout(const TensorView& t, const char* name, const char* where);

}  // namespace ringattn::detail
