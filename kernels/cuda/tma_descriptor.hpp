// Tensor maps (TMA descriptors) for the Hopper kernels: one per strided [batch, len, heads,
// head_dim] input of FlashParams, made on the host before a launch.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace ringattn::cuda_detail {

// Describes the 16-bit view at `base` (strides in elements: batch, row, head; unit stride along
// head_dim) for copies of boxes of [box_rows, 64] elements into the 128-byte swizzle; rows past
// `len` read as zeros. Returns false when the driver cannot describe the view (no TMA entry point,
// or strides it cannot take); the caller then uses a kernel that does not need one. The first
// such refusal in a process is reported once on stderr, naming `name`, the view and the driver's
// answer, since the kernel taken instead is slower.
bool make_row_tile_map(CUtensorMap& map, const char* name, const void* base,
                       const std::int64_t (&strides)[3], int batch, int len, int heads,
                       int head_dim, int box_rows);

// The same for an fp32 view (dQ's accumulator) in boxes of [box_rows, 32] elements (128 bytes,
// the swizzle's width), for element-wise fp32 reductions into it. Returns false, silently, when
// the driver cannot describe the view; the caller then adds with atomics.
bool make_fp32_row_tile_map(CUtensorMap& map, void* base, const std::int64_t (&strides)[3],
                            int batch, int len, int heads, int head_dim, int box_rows);

}  // namespace ringattn::cuda_detail
