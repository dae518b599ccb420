// The CUDA local block, backward, Hopper family (sm_90a) at the head dims whose dK and dV do not
// both fit in one warpgroup's registers: 192, 256 and 192/128 (d_qk != d_v).
//
// One CTA owns 64 keys of one (batch, kv head) and walks over every 64-row query tile of every
// query head of the GQA group, like flash_backward_sm90_kernel; its two consumer warpgroups split
// a step's five products by the gradient they keep rather than by keys:
//
//   value warpgroup   S^T = K Q^T, P^T from LSE (masked), hands P^T over, dV += P^T dO
//   key warpgroup     dP^T = V dO^T, takes P^T, dS^T = P^T (dP^T - delta), dK += dS^T Q
//
// Each holds one fp32 gradient of 64 keys (d / 2 registers a thread: 128 at 256) and does
// d_qk + d_v columns of products a step, whatever the two widths. P^T goes from one to the other
// through shared memory in its register-fragment order (thread t writes what thread t reads: no
// layout, no conflicts), in f16 whatever the inputs' dtype (P^T lies in [0, 1], where f16 keeps
// three more bits than bf16), so that dS^T = P^T (dP^T - delta) carries less of P^T's rounding
// than the rounded bf16 P^T of dV's product would give it; both A operands of the gradients'
// products stay in registers. The third warpgroup copies K and V once and the Q and dO tiles of
// each step into two stages with TMA, and in the default mode computes dQ = dS K from the key
// warpgroup's dS^T (dq_warpgroup_steps), adding it by TMA reductions where the shared memory has
// room for a step's fp32 block (192, 192/128), else with atomics (256).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/flash_backward.cuh"
#include "kernels/cuda/flash_backward_sm90.cuh"
#include "kernels/cuda/flash_params.hpp"
#include "kernels/cuda/tma_ptx.cuh"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace ringattn::cuda_detail {

template <int kHeadDim, int kValueDim, bool kTmaDq = false>
struct HopperWideBackwardTiles {
  static_assert(kHeadDim % 64 == 0 && kValueDim % 64 == 0, "whole 64-column panels");
  static constexpr int kThreads = 384;  // value, key, and copying / dQ warpgroups
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  // With dQ's warpgroup (fewest spills by ptxas -v: none at 192 and 192/128; 24 bytes in the
  // causal kernel at 256, whose dQ adds with atomics).
  static constexpr int kDqConsumerRegisters = kHeadDim > 192 ? 208 : 200;
  static constexpr int kDqGroupRegisters = kHeadDim > 192 ? 88 : 104;
  static constexpr int kLaunchRegisters = 168;  // 64K over 384 threads, in steps of 8
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * kLaunchRegisters &&
                    2 * kDqConsumerRegisters + kDqGroupRegisters <= 3 * kLaunchRegisters,
                "registers beyond the CTA's allocation");
  static constexpr int kKeys = 64;  // keys per CTA
  static constexpr int kRows = 64;  // query rows per step
  static constexpr int kStages = 2;
  static constexpr int kDsBuffers = 2;
  static constexpr int kKeyTileBytes = kKeys * kHeadDim * 2;
  static constexpr int kValueTileBytes = kKeys * kValueDim * 2;
  static constexpr int kStageBytes = kRows * (kHeadDim + kValueDim) * 2;  // Q and dO of a step
  static constexpr int kDsBytes = kKeys * kRows * 2;
  static constexpr int kExchangeBytes = kKeys * kRows * 2;  // P^T, one step
  // Each consumer warp's statistic (LSE in log2 units or delta) of a step, two buffers.
  static constexpr int kStatisticsBytes = 8 * 2 * kRows * 4;
  static constexpr int kDqStageBytes = kTmaDq ? kHeadDim * kRows * 4 : 0;
  // K/V; full and empty of a stage; full and empty of a dS^T buffer; full and empty of P^T
  static constexpr int kBarriers = 1 + 2 * kStages + 2 * kDsBuffers + 2;
  // 221 KiB at 192 with kTmaDq, 197 KiB at 192/128 with kTmaDq, 221 KiB at 256 without; with
  // the rows that see every key under a local mask (two ints).
  static constexpr int kSmemBytes = kKeyTileBytes + kValueTileBytes + kStages * kStageBytes +
                                    kDsBuffers * kDsBytes + kExchangeBytes + kDqStageBytes +
                                    kStatisticsBytes + 8 * kBarriers + 8 + 1024;
  static constexpr bool kFits = kSmemBytes <= 227 * 1024;
};

// kAtomicDq: the default mode, dQ added here (kTmaDq: by TMA reductions through dq_map, else with
// atomics); otherwise flash_dq_kernel computes it.
template <typename T, int kHeadDim, int kValueDim, bool kCausal, bool kAtomicDq, bool kTmaDq>
__global__ void __launch_bounds__(384, 1)
    flash_backward_sm90_wide_kernel(const FlashParams p, const __grid_constant__ CUtensorMap k_map,
                                    const __grid_constant__ CUtensorMap v_map,
                                    const __grid_constant__ CUtensorMap q_map,
                                    const __grid_constant__ CUtensorMap do_map,
                                    const __grid_constant__ CUtensorMap dq_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kAtomicDq || !kTmaDq, "TMA reductions are the default mode's");
  using Tiles = HopperWideBackwardTiles<kHeadDim, kValueDim, kTmaDq>;
  static_assert(Tiles::kFits, "more shared memory than an sm_90 CTA can have");
  constexpr int kKeys = Tiles::kKeys, kRows = Tiles::kRows, kStages = Tiles::kStages;
  constexpr int kRowTiles = kRows / 8;   // n-tiles of S^T and dP^T
  constexpr int kRowSteps = kRows / 16;  // k-steps of dV and dK
  using ExchangeT = __half;              // P^T's dtype in the exchange
  constexpr int kThirdGroupRegisters =
      kAtomicDq ? Tiles::kDqGroupRegisters : Tiles::kProducerRegisters;
  constexpr int kConsumerRegisters =
      kAtomicDq ? Tiles::kDqConsumerRegisters : Tiles::kConsumerRegisters;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  T* k_tile = reinterpret_cast<T*>(smem);              // [kHeadDim / 64 panels][kKeys][64]
  T* v_tile = k_tile + kKeys * kHeadDim;               // [kValueDim / 64 panels][kKeys][64]
  T* q_tiles = v_tile + kKeys * kValueDim;             // [kStages][panels][kRows][64]
  T* do_tiles = q_tiles + kStages * kRows * kHeadDim;  // [kStages][panels][kRows][64]
  T* ds_tiles = do_tiles + kStages * kRows * kValueDim;  // [kDsBuffers][kKeys * kRows]
  // P^T of a step: uint4 j * 128 + t holds k-step j's A fragment of consumer thread t.
  uint4* exchange = reinterpret_cast<uint4*>(ds_tiles + Tiles::kDsBuffers * kKeys * kRows);
  float* dq_stages = reinterpret_cast<float*>(exchange + Tiles::kExchangeBytes / 16);
  float* statistics = dq_stages + Tiles::kDqStageBytes / 4;  // [consumer warp][2][kRows]
  std::uint64_t* kv_full =
      reinterpret_cast<std::uint64_t*>(statistics + Tiles::kStatisticsBytes / 4);
  std::uint64_t* rows_full = kv_full + 1;
  std::uint64_t* rows_empty = rows_full + kStages;
  std::uint64_t* ds_full = rows_empty + kStages;
  std::uint64_t* ds_empty = ds_full + Tiles::kDsBuffers;
  std::uint64_t* p_full = ds_empty + Tiles::kDsBuffers;
  std::uint64_t* p_empty = p_full + 1;
  // Under a local mask, the rows [first, last) that see every key, for tile_needs_mask: read from
  // shared memory at each step (held in registers across the loop they cost the consumers spills
  // at 256).
  int* full_rows = reinterpret_cast<int*>(p_empty + 1);

  const int warp_group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  const GridPlace place = grid_place<kCausal>(p.schedule_group);
  const int key0 = place.order * kKeys;
  const int kv_head = place.y, batch = place.z;
  const BackwardRows visible = backward_rows<kCausal, false, kRows, kKeys>(p, batch, key0, 0);
  const int first_tile = visible.first_tile, row_tiles = visible.row_tiles;
  const int steps = row_tiles > 0 ? row_tiles * p.group : 0;
  const StepWalk first_step{kv_head * p.group, 0};
  const auto step_rows = [&](const StepWalk& at) { return (first_tile + at.tile) * kRows; };

  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 1);
    for (int stage = 0; stage < kStages; ++stage) {
      mbarrier_init(rows_full + stage, 1);
      mbarrier_init(rows_empty + stage, 8);  // one arrival per consumer warp
    }
    for (int buffer = 0; buffer < Tiles::kDsBuffers; ++buffer) {
      mbarrier_init(ds_full + buffer, 4);   // one per warp of the key warpgroup
      mbarrier_init(ds_empty + buffer, 4);  // one per warp of the dQ warpgroup
    }
    // Every thread of a warpgroup arrives at the exchange's barriers: an arrival releases only
    // its own thread's shared-memory accesses.
    mbarrier_init(p_full, 128);   // the value warpgroup's threads
    mbarrier_init(p_empty, 128);  // the key warpgroup's
    mbarrier_init_fence();
    full_rows[0] = visible.full_rows.first;
    full_rows[1] = visible.full_rows.last;
  }
  __syncthreads();

  if (warp_group == 2) {
    warpgroup_registers_decrease<kThirdGroupRegisters>();
    if (steps == 0) return;
    backward_copy_and_dq_steps<T, kKeys, kRows, kHeadDim, kValueDim, kHeadDim, kStages,
                               Tiles::kDsBuffers, kAtomicDq, kTmaDq>(
        p, BackwardMaps{k_map, v_map, q_map, do_map, dq_map}, batch, kv_head, key0, steps,
        first_step, row_tiles, step_rows, k_tile, v_tile, q_tiles, do_tiles, ds_tiles, dq_stages,
        kv_full, rows_full, rows_empty, ds_full, ds_empty);
    return;
  }

  warpgroup_registers_increase<kConsumerRegisters>();
  const bool value_group = warp_group == 0;
  const int my_keys[2] = {key0 + warp * 16 + group_row, key0 + warp * 16 + group_row + 8};
  uint4* my_exchange = exchange + threadIdx.x % 128;
  // Lane l holds its warp's statistic (the value warpgroup's LSE in log2 units, the key
  // warpgroup's delta) of rows l and l + 32 of a step until it stages them in buffer step % 2 of
  // its warp's copy, loaded a step ahead (see flash_backward_sm90_kernel).
  float* warp_statistics = statistics + (threadIdx.x / 32) * 2 * kRows;
  float next[2];
  StepWalk loading = first_step;
  const auto read_statistics = [&] {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float lse, delta;
      load_row_statistics(p, batch, loading.head, step_rows(loading) + lane + 32 * half, lse,
                          delta);
      next[half] = value_group ? lse_in_log2(lse) : delta;
    }
    loading.advance(row_tiles);
  };
  const auto stage_statistics = [&](int step) {
    float* buffer = warp_statistics + (step % 2) * kRows;
#pragma unroll
    for (int half = 0; half < 2; ++half) buffer[lane + 32 * half] = next[half];
    __syncwarp();
    if (step + 1 < steps) read_statistics();
  };
  if (steps > 0) {
    read_statistics();
    stage_statistics(0);
    mbarrier_wait(kv_full, 0);
  }

  if (value_group) {
    float dv[kValueDim / 8][4] = {};
    const std::uint64_t k_rows = uniform_descriptor(k_major_descriptor(k_tile));
    StepWalk at = first_step;
    for (int step = 0; step < steps; ++step, at.advance(row_tiles)) {
      const int stage = step % kStages;
      const int row_first = step_rows(at);
      const T* q_tile = q_tiles + stage * kRows * kHeadDim;
      const T* do_tile = do_tiles + stage * kRows * kValueDim;
      mbarrier_wait(rows_full + stage, (step / kStages) & 1);

      float s[kRowTiles][4];
      wgmma_fence();
      wgmma_rows_times_rows<kRows, kHeadDim, kKeys, kRows, T>(s, k_rows,
                                                               k_major_descriptor(q_tile));
      wgmma_commit();
      FragmentRows<kRowTiles> lse_rows;
      lse_rows.load(warp_statistics + (step % 2) * kRows, quad_col);
      wgmma_wait<0>();
      pin_registers(s);
      const IndexRange full = p.local ? IndexRange{full_rows[0], full_rows[1]} : IndexRange{0, 0};
      const bool masked = tile_needs_mask<kCausal, false>(p, full, row_first, kRows, key0, kKeys);
      probabilities<kCausal>(s, my_keys, row_first, quad_col, masked, lse_rows, p, batch);
      std::uint32_t a_p[kRowSteps][4], shared_p[kRowSteps][4];
#pragma unroll
      for (int kstep = 0; kstep < kRowSteps; ++kstep) {
        probability_fragment<T>(a_p[kstep], s, kstep);
        probability_fragment<ExchangeT>(shared_p[kstep], s, kstep);
      }

      // P^T to the key warpgroup once it has taken the step before's.
      mbarrier_wait(p_empty, (step & 1) ^ 1);
#pragma unroll
      for (int kstep = 0; kstep < kRowSteps; ++kstep) {
        my_exchange[kstep * 128] = make_uint4(shared_p[kstep][0], shared_p[kstep][1],
                                              shared_p[kstep][2], shared_p[kstep][3]);
      }
      mbarrier_arrive(p_full);

      add_fragments_times_rows<kValueDim, kRows>(dv, a_p, do_tile);
      if (step + 1 < steps) stage_statistics(step + 1);
      wgmma_wait<0>();
      pin_registers(dv);
      if (lane == 0) mbarrier_arrive(rows_empty + stage);
    }
    if (steps > 0 || p.overwrite_key_gradients) {
      // dV alone: the key array is never read.
      add_key_gradients<T, kHeadDim, kValueDim, 1, kHeadDim / 8, kValueDim / 8, false, true>(
          p, batch, kv_head, my_keys, quad_col,
          reinterpret_cast<const float(&)[kHeadDim / 8][4]>(dv), dv);
    }
    return;
  }

  float dk[kHeadDim / 8][4] = {};
  const std::uint64_t v_rows = uniform_descriptor(k_major_descriptor(v_tile));
  StepWalk at = first_step;
  for (int step = 0; step < steps; ++step, at.advance(row_tiles)) {
    const int stage = step % kStages;
    const T* q_tile = q_tiles + stage * kRows * kHeadDim;
    const T* do_tile = do_tiles + stage * kRows * kValueDim;
    mbarrier_wait(rows_full + stage, (step / kStages) & 1);
    // The dQ warpgroup has read this step's dS^T buffer two steps ago (waited for with no product
    // in flight, as in flash_backward_sm90_kernel).
    const int ds_buffer = step % Tiles::kDsBuffers;
    if constexpr (kAtomicDq) {
      mbarrier_wait(ds_empty + ds_buffer, ((step / Tiles::kDsBuffers) & 1) ^ 1);
    }

    float dp[kRowTiles][4];
    wgmma_fence();
    wgmma_rows_times_rows<kRows, kValueDim, kKeys, kRows, T>(dp, v_rows,
                                                              k_major_descriptor(do_tile));
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(dp);

    std::uint32_t a_p[kRowSteps][4], a_ds[kRowSteps][4];
    mbarrier_wait(p_full, step & 1);
#pragma unroll
    for (int kstep = 0; kstep < kRowSteps; ++kstep) {
      const uint4 fragment = my_exchange[kstep * 128];
      a_p[kstep][0] = fragment.x;
      a_p[kstep][1] = fragment.y;
      a_p[kstep][2] = fragment.z;
      a_p[kstep][3] = fragment.w;
    }
    mbarrier_arrive(p_empty);
    FragmentRows<kRowTiles> delta_rows;
    delta_rows.load(warp_statistics + (step % 2) * kRows, quad_col);
    ds_from_fragments<ExchangeT>(dp, a_p, delta_rows);

    // dS^T as A fragments, and (kAtomicDq) into shared memory for the dQ warpgroup.
    T* ds_tile = ds_tiles + ds_buffer * kKeys * kRows;
#pragma unroll
    for (int kstep = 0; kstep < kRowSteps; ++kstep) {
      probability_fragment<T>(a_ds[kstep], dp, kstep);
      if constexpr (kAtomicDq) {
        store_ds_fragment<kKeys, kRows>(ds_tile, warp * 16 + group_row, kstep * 16 + quad_col,
                                        a_ds[kstep]);
      }
    }
    if constexpr (kAtomicDq) {
      fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) mbarrier_arrive(ds_full + ds_buffer);
    }
    add_fragments_times_rows<kHeadDim, kRows>(dk, a_ds, q_tile);
    if (step + 1 < steps) stage_statistics(step + 1);
    wgmma_wait<0>();
    pin_registers(dk);
    if (lane == 0) mbarrier_arrive(rows_empty + stage);
  }
  if (steps > 0 || p.overwrite_key_gradients) {
    // dK alone: the value array is never read.
    add_key_gradients<T, kHeadDim, kValueDim, 1, kHeadDim / 8, kValueDim / 8, true, false>(
        p, batch, kv_head, my_keys, quad_col, dk,
        reinterpret_cast<const float(&)[kValueDim / 8][4]>(dk));
  }
#endif  // sm_90a
}

}  // namespace ringattn::cuda_detail
