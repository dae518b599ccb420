// Shared-memory tiles of 16-bit rows with a 16-byte XOR swizzle, filled by cp.async.
//
// A row of head_dim 16-bit values is head_dim / 8 chunks of 16 bytes. ldmatrix reads one chunk
// from each of 8 consecutive rows; unswizzled, a row pitch of 128 or 256 bytes puts all 8 in the
// same banks. Storing chunk c of row r at chunk c ^ (r % 8) spreads them over all 32 banks, for
// the plain and the transposed loads alike. It needs at least 8 chunks a row (head_dim >= 64).
#pragma once

#include <cstdint>

#include "kernels/cuda/mma_ptx.cuh"

namespace ringattn::cuda_detail {

template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int col) {
  static_assert(kHeadDim % 64 == 0, "the swizzle needs 8 or more 16-byte chunks a row");
  return row * kHeadDim + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
}

template <int kHeadDim>
struct RowSwizzle {
  __device__ __forceinline__ int operator()(int row, int col) const {
    return swizzled<kHeadDim>(row, col);
  }
};

// Copies rows [first, first + kRows) of a [len, head_dim] slice with row stride `row_stride`
// (elements) into a tile laid out by `Layout` (element offset of (row, col); the row swizzle
// above by default); rows at or past `len` are zero-filled. Asynchronous: commit and wait with
// cp_async_commit / cp_async_wait.
template <int kRows, int kHeadDim, int kThreads, typename Layout = RowSwizzle<kHeadDim>,
          typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* base, std::int64_t row_stride,
                                                int first, int len) {
  constexpr int kChunks = kHeadDim / 8;
  const Layout layout{};
  for (int index = threadIdx.x; index < kRows * kChunks; index += kThreads) {
    const int row = index / kChunks, col = (index % kChunks) * 8;
    const bool valid = first + row < len;
    const T* source = base + (valid ? static_cast<std::int64_t>(first + row) * row_stride + col : 0);
    cp_async_16(tile + layout(row, col), source, valid);
  }
}

}  // namespace ringattn::cuda_detail
