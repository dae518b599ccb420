// Shared-memory tiles of 16-bit rows with a 16-byte XOR swizzle, filled by cp.async.
//
// A row of head_dim 16-bit values (the tile's width: d_qk for Q and K, d_v for V and dO) is
// head_dim / 8 chunks of 16 bytes. ldmatrix reads one chunk from each of 8 consecutive rows (the
// first a multiple of 8); unswizzled, a row pitch of 128 or 256 bytes puts all 8 in the same banks. With a pitch that is a multiple of 128 bytes (head_dim
// 64, 128, 192, 256), chunk c of row r is stored at chunk c ^ (r % 8) of its group of 8, which
// spreads the 8 reads over all 32 banks. With a pitch of 128 k + 64 bytes (head_dim 32, 96), odd
// rows already start half a bank cycle later, so chunk c is stored at c ^ ((r / 2) % 4) of its
// group of 4: the pair (r % 2, (r / 2) % 4) then names one of 8 16-byte bank slots for each row.
// The same holds for the plain and the transposed loads.
#pragma once

#include <cstdint>

#include "kernels/cuda/mma_ptx.cuh"

namespace ringattn::cuda_detail {

// The most dynamic shared memory a CTA of the sm_80 family may opt in to on its smallest target,
// compute capability 8.0 (A100: 163 KiB; sm_90 allows 227 KiB): every tile struct asserts its
// bytes against it.
constexpr int kMaxDynamicSmemBytes = 163 * 1024;

template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int col) {
  static_assert(kHeadDim % 32 == 0, "the swizzle needs rows of whole 64-byte halves of a bank cycle");
  const int chunk = col >> 3;
  if constexpr (kHeadDim % 64 == 0) {
    return row * kHeadDim + (((chunk ^ row) & 7) | (chunk & ~7)) * 8 + (col & 7);
  } else {
    return row * kHeadDim + (chunk ^ ((row >> 1) & 3)) * 8 + (col & 7);
  }
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
