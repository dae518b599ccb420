// The CUDA local block, forward, Hopper family (sm_90a): the same algorithm and epilogue as
// flash_forward.cuh, with both products on warpgroup MMAs (wgmma) that read K and V straight from
// shared memory.
//
// One CTA of two warpgroups owns 128 query rows of one (batch, head); each warpgroup owns 64 of
// them (each warp 16) and keeps their fp32 O and softmax statistics in registers. K and V tiles
// of 128 keys stream through two shared-memory stages by cp.async: the next tile's copies run
// while the current one is multiplied. Per tile, S = Q K^T is one chain of head_dim / 16 wgmmas
// with both operands in shared memory (K-major); after the online softmax in registers, the
// probabilities become A fragments in registers and O += P V is a chain of 8 wgmmas whose B, V,
// is read MN-major (its contiguous dimension is head_dim). The two warpgroups run their
// softmax and their MMAs independently between the per-tile barriers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/flash_forward.cuh"
#include "kernels/cuda/flash_params.hpp"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/smem_tile.cuh"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace ringattn::cuda_detail {

template <int kHeadDim>
struct HopperForwardTiles {
  static constexpr int kWarpGroups = 2;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kRows = 64 * kWarpGroups;  // query rows per CTA
  static constexpr int kKeys = 128;               // keys per K/V stage
  // Q, then two stages of K and V (160 KiB at head_dim 128, 80 KiB at 64), plus the slack that
  // aligns the tiles to the swizzle's 1024-byte period.
  static constexpr int kSmemBytes = (kRows + 4 * kKeys) * kHeadDim * 2 + 1024;
};

template <typename T, int kHeadDim, bool kCausal, bool kCombine>
__global__ void __launch_bounds__(HopperForwardTiles<kHeadDim>::kThreads, 1)
    flash_forward_sm90_kernel(const FlashParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = HopperForwardTiles<kHeadDim>;
  constexpr int kRows = Tiles::kRows, kKeys = Tiles::kKeys, kThreads = Tiles::kThreads;
  constexpr int kDimSteps = kHeadDim / 16;  // k-steps of Q K^T
  constexpr int kKeyTiles = kKeys / 8;      // n-tiles of S
  constexpr float kNegInf = -kInfinity;
  using QLayout = PanelSwizzle<kRows, kHeadDim>;
  using KvLayout = PanelSwizzle<kKeys, kHeadDim>;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  T* q_tile = reinterpret_cast<T*>(smem);
  T* k_tiles = q_tile + kRows * kHeadDim;  // [2][kKeys * kHeadDim]
  T* v_tiles = k_tiles + 2 * kKeys * kHeadDim;

  const int warp_group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  const int row0 = blockIdx.x * kRows;
  const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / p.group;

  const T* q = head_slice<T>(p.q, p.q_strides, batch, head);
  const T* k = head_slice<T>(p.k, p.k_strides, batch, kv_head);
  const T* v = head_slice<T>(p.v, p.v_strides, batch, kv_head);

  const int key_end = visible_key_end<kCausal>(p, row0, kRows);
  const int key_tiles = (key_end + kKeys - 1) / kKeys;

  if (key_tiles > 0) {
    load_tile_async<kRows, kHeadDim, kThreads, QLayout>(q_tile, q, p.q_strides[1], row0, p.q_len);
    load_tile_async<kKeys, kHeadDim, kThreads, KvLayout>(k_tiles, k, p.k_strides[1], 0, key_end);
    load_tile_async<kKeys, kHeadDim, kThreads, KvLayout>(v_tiles, v, p.v_strides[1], 0, key_end);
  }
  cp_async_commit();

  float acc[kHeadDim / 8][4] = {};
  float row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.f, 0.f};
  const int my_rows[2] = {row0 + warp_group * 64 + warp * 16 + group_row,
                          row0 + warp_group * 64 + warp * 16 + group_row + 8};
  // This warpgroup's 64 rows of Q: the panels start kRows * 128 bytes apart.
  const T* q_rows = q_tile + warp_group * 64 * 64;

  for (int tile = 0; tile < key_tiles; ++tile) {
    const int stage = tile & 1;
    const T* k_tile = k_tiles + stage * kKeys * kHeadDim;
    const T* v_tile = v_tiles + stage * kKeys * kHeadDim;
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    // Every warpgroup has finished reading the other stage (its wgmmas were waited for).
    if (tile + 1 < key_tiles) {
      const int next = (stage ^ 1) * kKeys * kHeadDim;
      load_tile_async<kKeys, kHeadDim, kThreads, KvLayout>(k_tiles + next, k, p.k_strides[1],
                                                           (tile + 1) * kKeys, key_end);
      load_tile_async<kKeys, kHeadDim, kThreads, KvLayout>(v_tiles + next, v, p.v_strides[1],
                                                           (tile + 1) * kKeys, key_end);
    }
    cp_async_commit();

    // S = Q K^T: k-step `step` reads columns [16 step, 16 step + 16), 32 bytes into its panel.
    float s[kKeyTiles][4];
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < kDimSteps; ++step) {
      const int panel = step / 4, offset = (step % 4) * 16;
      const std::uint64_t a = k_major_descriptor(q_rows + panel * kRows * 64 + offset);
      const std::uint64_t b = k_major_descriptor(k_tile + panel * kKeys * 64 + offset);
      wgmma_ss<kKeys, T>(s, a, b, step > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();

    const int key0 = tile * kKeys;
    const bool partial = key0 + kKeys > p.k_len;
    const bool diagonal = kCausal && static_cast<std::int64_t>(key0 + kKeys - 1) > row0 + p.shift;
    if (partial || diagonal) mask_scores<kCausal>(s, key0, my_rows, quad_col, p);
    online_softmax(s, acc, row_max, row_sum, p.scale_log2);

    // O += P V: k-step `kstep` covers keys [16 kstep, 16 kstep + 16), 2048 bytes into the panels;
    // V's 64-column panels are kKeys * 128 bytes apart.
    std::uint32_t probabilities[kKeys / 16][4];
#pragma unroll
    for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
      probability_fragment<T>(probabilities[kstep], s, kstep);
    }
    wgmma_fence();
#pragma unroll
    for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
      const std::uint64_t b = mn_major_descriptor(v_tile + kstep * 16 * 64, kKeys);
      wgmma_rs_mn<kHeadDim, T>(acc, probabilities[kstep], b, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
  }

  store_forward_rows<T, kHeadDim, kCombine>(p, batch, head, my_rows, acc, row_max, row_sum, lane);
#endif  // sm_90a
}

}  // namespace ringattn::cuda_detail
