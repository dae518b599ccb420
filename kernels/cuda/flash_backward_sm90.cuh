// The CUDA local block, backward, Hopper family (sm_90a): flash_backward.cuh's schedule with the
// five products of a step on warpgroup MMAs (wgmma).
//
// One CTA of two warpgroups owns 128 keys of one (batch, kv head); each warpgroup owns 64 of them
// (each warp 16) and keeps their fp32 dK and dV in registers while the CTA walks over every
// 64-row query tile of every query head of the GQA group. Q and dO tiles (and the rows' LSE and
// delta) stream through two shared-memory stages. Per step, each warpgroup:
//
//   S^T = K Q^T, dP^T = V dO^T      A = its K / V rows, B = Q / dO (both K-major in shared memory)
//   P^T, dS^T in registers          recomputed from LSE, masked, dS^T = P^T (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q      A = P^T / dS^T from registers, B = dO / Q read MN-major
//
// and, in the default mode, stages dS^T in shared memory for dQ = dS K (A = dS read M-major, B =
// K read MN-major), added into global fp32 with atomics: at head_dim 128 each warpgroup computes
// one 64-column half of dQ over all 128 keys, at head_dim 64 all of dQ over its own 64 keys. The
// deterministic mode leaves dQ to flash_dq_kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/flash_backward.cuh"
#include "kernels/cuda/flash_params.hpp"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/smem_tile.cuh"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace ringattn::cuda_detail {

template <int kHeadDim>
struct HopperBackwardTiles {
  static constexpr int kWarpGroups = 2;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kKeys = 64 * kWarpGroups;  // keys per CTA
  static constexpr int kRows = 64;                // query rows per step
  // K, V, two stages of Q and dO, dS^T, two stages of LSE and delta, and the slack that aligns
  // the tiles to the swizzle's 1024-byte period: 145 KiB at head_dim 128, 81 KiB at 64.
  static constexpr int kSmemBytes =
      (2 * kKeys + 4 * kRows) * kHeadDim * 2 + kKeys * kRows * 2 + 4 * kRows * 4 + 1024;
};

template <typename T, int kHeadDim, bool kCausal, bool kAtomicDq>
__global__ void __launch_bounds__(HopperBackwardTiles<kHeadDim>::kThreads, 1)
    flash_backward_sm90_kernel(const FlashParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = HopperBackwardTiles<kHeadDim>;
  constexpr int kKeys = Tiles::kKeys, kRows = Tiles::kRows, kThreads = Tiles::kThreads;
  constexpr int kDimSteps = kHeadDim / 16;  // k-steps of S^T and dP^T
  constexpr int kRowTiles = kRows / 8;      // n-tiles of S^T
  constexpr int kRowSteps = kRows / 16;     // k-steps of dV and dK
  using KvLayout = PanelSwizzle<kKeys, kHeadDim>;
  using RowLayout = PanelSwizzle<kRows, kHeadDim>;
  using DsLayout = PanelSwizzle<kKeys, kRows>;  // dS^T: [keys][rows], rows contiguous

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  T* k_tile = reinterpret_cast<T*>(smem);
  T* v_tile = k_tile + kKeys * kHeadDim;
  T* q_tiles = v_tile + kKeys * kHeadDim;         // [2][kRows * kHeadDim]
  T* do_tiles = q_tiles + 2 * kRows * kHeadDim;  // [2][kRows * kHeadDim]
  T* ds_tile = do_tiles + 2 * kRows * kHeadDim;  // [kKeys * kRows]
  float* lse_log2 = reinterpret_cast<float*>(ds_tile + kKeys * kRows);  // [2][kRows]
  float* delta = lse_log2 + 2 * kRows;                                  // [2][kRows]

  const int warp_group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  const int key0 = blockIdx.x * kKeys;
  const int kv_head = blockIdx.y, batch = blockIdx.z;
  const T* k = head_slice<T>(p.k, p.k_strides, batch, kv_head);
  const T* v = head_slice<T>(p.v, p.v_strides, batch, kv_head);

  // Row tiles that see some key of this CTA: causal hides rows before key0 - shift.
  int first_tile = 0;
  if (kCausal) first_tile = clamp_to(key0 - p.shift, 0, p.q_len) / kRows;
  const int row_tiles = (p.q_len + kRows - 1) / kRows - first_tile;
  const int steps = row_tiles > 0 ? row_tiles * p.group : 0;

  // Step i covers query head kv_head * group + i / row_tiles, row tile first_tile + i % row_tiles.
  auto issue_step = [&](int step, int stage) {
    const int head = kv_head * p.group + step / row_tiles;
    const int row_first = (first_tile + step % row_tiles) * kRows;
    const T* q = head_slice<T>(p.q, p.q_strides, batch, head);
    const T* g = head_slice<T>(p.dout, p.dout_strides, batch, head);
    load_tile_async<kRows, kHeadDim, kThreads, RowLayout>(q_tiles + stage * kRows * kHeadDim, q,
                                                          p.q_strides[1], row_first, p.q_len);
    load_tile_async<kRows, kHeadDim, kThreads, RowLayout>(do_tiles + stage * kRows * kHeadDim, g,
                                                          p.dout_strides[1], row_first, p.q_len);
    stage_row_statistics<kRows, kThreads>(p, batch, head, row_first, lse_log2 + stage * kRows,
                                          delta + stage * kRows);
  };

  const int key_limit = min(p.k_len, key0 + kKeys);
  load_tile_async<kKeys, kHeadDim, kThreads, KvLayout>(k_tile, k, p.k_strides[1], key0, key_limit);
  load_tile_async<kKeys, kHeadDim, kThreads, KvLayout>(v_tile, v, p.v_strides[1], key0, key_limit);
  if (steps > 0) issue_step(0, 0);
  cp_async_commit();

  float dk[kHeadDim / 8][4] = {};
  float dv[kHeadDim / 8][4] = {};
  const int wg_key = warp_group * 64;  // this warpgroup's first key within the CTA
  const int my_keys[2] = {key0 + wg_key + warp * 16 + group_row,
                          key0 + wg_key + warp * 16 + group_row + 8};
  // This warpgroup's 64 rows of K and V (A operands): kKeys * 128 bytes between panels.
  const T* k_rows = k_tile + wg_key * 64;
  const T* v_rows = v_tile + wg_key * 64;

  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    [[maybe_unused]] const int head = kv_head * p.group + step / row_tiles;
    const int row_first = (first_tile + step % row_tiles) * kRows;
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    // Every warpgroup has finished the previous step's wgmmas (waited for below): its stage and
    // dS^T may be overwritten.
    if (step + 1 < steps) issue_step(step + 1, stage ^ 1);
    cp_async_commit();
    const T* q_tile = q_tiles + stage * kRows * kHeadDim;
    const T* do_tile = do_tiles + stage * kRows * kHeadDim;

    // S^T = K Q^T and dP^T = V dO^T: k-step `dstep` reads columns [16 dstep, 16 dstep + 16).
    float s[kRowTiles][4], dp[kRowTiles][4];
    auto key_rows_times_rows = [&](float (&acc)[kRowTiles][4], const T* key_rows, const T* rows) {
#pragma unroll
      for (int dstep = 0; dstep < kDimSteps; ++dstep) {
        const int panel = dstep / 4, offset = (dstep % 4) * 16;
        const std::uint64_t b = k_major_descriptor(rows + panel * kRows * 64 + offset);
        const std::uint64_t a = k_major_descriptor(key_rows + panel * kKeys * 64 + offset);
        wgmma_ss<kRows, T>(acc, a, b, dstep > 0 ? 1 : 0);
      }
    };
    wgmma_fence();
    key_rows_times_rows(s, k_rows, q_tile);
    key_rows_times_rows(dp, v_rows, do_tile);
    wgmma_commit();
    wgmma_wait<0>();

    const bool diagonal = kCausal && static_cast<std::int64_t>(key0 + kKeys - 1) > row_first + p.shift;
    const bool partial = key0 + kKeys > p.k_len;
    probabilities_and_ds<kCausal>(s, dp, my_keys, row_first, quad_col, partial || diagonal,
                                  lse_log2 + stage * kRows, delta + stage * kRows, p);

    // P^T and dS^T as A fragments; dS^T also into shared memory for dQ (the rounded values the
    // MMAs use).
    std::uint32_t a_p[kRowSteps][4], a_ds[kRowSteps][4];
#pragma unroll
    for (int kstep = 0; kstep < kRowSteps; ++kstep) {
      probability_fragment<T>(a_p[kstep], s, kstep);
      probability_fragment<T>(a_ds[kstep], dp, kstep);
      if constexpr (kAtomicDq) {
        const DsLayout layout{};
        const int key = wg_key + warp * 16 + group_row, row = kstep * 16 + quad_col;
        *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key, row)) = a_ds[kstep][0];
        *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key + 8, row)) = a_ds[kstep][1];
        *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key, row + 8)) = a_ds[kstep][2];
        *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key + 8, row + 8)) = a_ds[kstep][3];
      }
    }

    // dV += P^T dO and dK += dS^T Q: k-step `kstep` covers rows [16 kstep, 16 kstep + 16), 2048
    // bytes into the panels; the panels of a row tile are kRows * 128 bytes apart.
    wgmma_fence();
#pragma unroll
    for (int kstep = 0; kstep < kRowSteps; ++kstep) {
      const std::uint64_t b_do = mn_major_descriptor(do_tile + kstep * 16 * 64, kRows);
      wgmma_rs_mn<kHeadDim, T>(dv, a_p[kstep], b_do, 1);
    }
#pragma unroll
    for (int kstep = 0; kstep < kRowSteps; ++kstep) {
      const std::uint64_t b_q = mn_major_descriptor(q_tile + kstep * 16 * 64, kRows);
      wgmma_rs_mn<kHeadDim, T>(dk, a_ds[kstep], b_q, 1);
    }
    wgmma_commit();

    if constexpr (kAtomicDq) {
      // dQ (64 rows x 64 columns a warpgroup) = dS K over `key_steps` 16-key steps from
      // `dq_key`; dS^T's 16-key steps are 2048 bytes apart, and so are K's within a panel.
      constexpr bool kSplitColumns = kHeadDim == 128;
      constexpr int kKeySteps = kSplitColumns ? kKeys / 16 : 64 / 16;
      const int dq_key = kSplitColumns ? 0 : wg_key;
      const int panel = kSplitColumns ? warp_group : 0;
      fence_proxy_async_shared();
      __syncthreads();
      float dq[8][4];
      wgmma_fence();
#pragma unroll
      for (int kstep = 0; kstep < kKeySteps; ++kstep) {
        const int key = dq_key + kstep * 16;
        // dS read M-major: its 64 rows are one panel, so the leading offset is unused.
        const std::uint64_t a_ds_t = wgmma_descriptor(ds_tile + key * kRows, 16, kSwizzleAtomBytes);
        const std::uint64_t b_k =
            mn_major_descriptor(k_tile + panel * kKeys * 64 + key * 64, kKeys);
        wgmma_ss_mn<64, T>(dq, a_ds_t, b_k, kstep > 0 ? 1 : 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      add_dq_atomic(p, batch, head, row_first + warp * 16 + group_row, panel * 64, quad_col, dq);
    } else {
      wgmma_wait<0>();
    }
  }

  add_key_gradients<kHeadDim>(p, batch, kv_head, my_keys, quad_col, dk, dv);
#endif  // sm_90a
}

}  // namespace ringattn::cuda_detail
