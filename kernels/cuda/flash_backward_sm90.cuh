// The CUDA local block, backward, Hopper family (sm_90a): flash_backward.cuh's schedule with the
// five products of a step on warpgroup MMAs (wgmma), fed by TMA copies.
//
// One CTA owns 128 keys of one (batch, kv head): two consumer warpgroups of 64 keys each (every
// warp 16), which keep their fp32 dK and dV in registers while the CTA walks over every 64-row
// query tile of every query head of the GQA group, and a third warpgroup. One of its threads
// copies K and V once and the Q and dO tiles of each step into a ring of shared-memory stages with
// TMA (rows past the end as zeros); full / empty mbarriers per stage hand each buffer over, so the
// consumers never wait for a load they did not need. Each consumer warp stages the rows' LSE and
// delta itself: loaded two steps ahead into registers as stored (nothing waits for the loads until
// the next step), converted and written to its own shared-memory copy while dK's product runs,
// and read from there into registers before the MMAs whose results they meet. Per step, each
// consumer warpgroup:
//
//   S^T = K Q^T, dP^T = V dO^T      A = its K / V rows, B = Q / dO (both K-major in shared memory)
//   P^T, dS^T in registers          recomputed from LSE, masked, dS^T = P^T (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q      A = P^T / dS^T from registers, B = dO / Q read MN-major
//
// (in that order, each product its own group, so that P^T is computed while dP^T runs and dS^T
// while dV runs). In the default mode the consumers also store dS^T in shared memory (two buffers
// with full / empty mbarriers), and the third warpgroup computes dQ = dS K from both warpgroups'
// halves (A = dS read M-major, B = K read MN-major), 32 columns at a time, stages each step's
// 64-row fp32 block in shared memory and adds it into global dQ with TMA reductions (or, where the
// driver cannot describe dQ as a tensor map, atomics from the registers). The consumers thus never
// wait for each other or for dQ: each runs its steps' dependent chain while the other's products
// keep the tensor cores busy. The dQ warpgroup's registers come from the consumers: to fit, dS^T
// is computed from P^T as rounded for dV's product, so that the fp32 P^T is dead once its
// fragments are built. The deterministic mode leaves dQ to flash_dq_kernel.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/flash_backward.cuh"
#include "kernels/cuda/flash_params.hpp"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/tma_ptx.cuh"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace ringattn::cuda_detail {

// kTmaDq: dQ is staged in shared memory and added into global memory by TMA reductions (the
// default mode where the driver can describe dQ), which costs 32 KiB: two Q / dO stages then at
// head_dim 128 instead of three.
// Q, K, V and dO sit in shared memory as whole 64-column panels (kWidth): at head dims 32 and 96
// the last panel holds the zeros TMA writes past the view's width, which add nothing to any product
// and make gradient columns that are never stored.
template <int kHeadDim, bool kTmaDq = false>
struct HopperBackwardTiles {
  static constexpr int kWidth = (kHeadDim + 63) / 64 * 64;
  static constexpr int kConsumerGroups = 2;
  static constexpr int kThreads = 128 * kConsumerGroups + 128;  // and the copying / dQ warpgroup
  // Registers a thread: the copying warpgroup's and the consumers' when dQ is left to
  // flash_dq_kernel; the dQ warpgroup's (which copies too) and the consumers' otherwise.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kDqConsumerRegisters = kWidth == 128 ? 224 : 200;
  static constexpr int kDqGroupRegisters = kWidth == 128 ? 56 : 104;
  // setmaxnreg moves registers within the CTA's allocation: 168 a thread at launch (64K over 384
  // threads, in steps of 8); an increase beyond what the decreases freed would wait forever.
  static constexpr int kLaunchRegisters = 168;
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * kLaunchRegisters &&
                    2 * kDqConsumerRegisters + kDqGroupRegisters <= 3 * kLaunchRegisters,
                "registers beyond the CTA's allocation");
  static constexpr int kKeys = 64 * kConsumerGroups;  // keys per CTA
  static constexpr int kRows = 64;                    // query rows per step
  static constexpr int kStages = kWidth <= 64 ? 4 : (kTmaDq ? 2 : 3);
  // dS^T buffers: the consumers write one step's while the dQ warpgroup reads the step before's.
  static constexpr int kDsBuffers = 2;
  static constexpr int kKeyTileBytes = kKeys * kWidth * 2;  // K or V
  static constexpr int kRowTileBytes = kRows * kWidth * 2;  // one stage of Q or dO
  // K/V; full and empty of a stage; full and empty of a dS^T buffer
  static constexpr int kBarriers = 1 + 2 * kStages + 2 * kDsBuffers;
  // Each consumer warp's LSE and delta of a step, two buffers.
  static constexpr int kStatisticsBytes = kConsumerGroups * 4 * 2 * 2 * kRows * 4;
  // A step's 64-row fp32 block of dQ, 64 columns a panel (kTmaDq).
  static constexpr int kDqStageBytes = kTmaDq ? kWidth * 64 * 4 : 0;
  // Under a local mask, each consumer thread's two keys' rows (key_rows_of).
  static constexpr int kKeyRowsBytes = kConsumerGroups * 128 * 2 * 8;
  // K, V, the Q and dO stages, dS^T, the dQ blocks, the statistics, the barriers, the keys' rows
  // and the slack that aligns the tiles to the swizzle's 1024-byte period: 205 KiB at head_dim
  // 128 (also with kTmaDq), 141 KiB at 64 (157 with kTmaDq).
  static constexpr int kSmemBytes = 2 * kKeyTileBytes + 2 * kStages * kRowTileBytes +
                                    kDsBuffers * kKeys * kRows * 2 + kDqStageBytes +
                                    kStatisticsBytes + 8 * kBarriers + kKeyRowsBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA can have");
};

// acc += A B as one wgmma group: A (64 x kRows) in registers as kRows / 16 k-step fragments, B the
// kRows x kHeadDim tile `rows` of a stage (its 16-row k-steps 2048 bytes apart in each panel).
template <int kHeadDim, int kRows, typename T>
__device__ __forceinline__ void add_fragments_times_rows(float (&acc)[kHeadDim / 8][4],
                                                         const std::uint32_t (&a)[kRows / 16][4],
                                                         const T* rows) {
  const std::uint64_t b0 = mn_major_descriptor(rows, kRows);
  wgmma_fence();
#pragma unroll
  for (int kstep = 0; kstep < kRows / 16; ++kstep) {
    wgmma_rs_mn<kHeadDim, T>(acc, a[kstep], descriptor_plus(b0, kstep * 16 * 64 * sizeof(T)), 1);
  }
  wgmma_commit();
}

// Writes a warpgroup's 64 x (8 kTiles) fp32 accumulator block `acc` (wgmma's layout), times
// `scale`, into `stage` as [64 rows][32 columns] halves in the 128-byte swizzle, which a tensor map
// with 32-column boxes reads: 16-byte chunk c of row r at chunk c ^ (r % 8). The lanes of a quad's
// upper half store column tile dt ^ 2 where the lower half stores dt: a half-warp's rows then
// differ only in r % 4, and with the same dt for all its lanes its 16 stores of 8 bytes would fall
// on 4 chunks (two shared-memory wavefronts); this way they cover all 8 (one).
template <int kTiles>
__device__ __forceinline__ void stage_fp32_block(float* stage, const float (&acc)[kTiles][4],
                                                 float scale, int warp, int lane) {
  static_assert(kTiles % 4 == 0, "whole 32-column halves");
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  const bool upper = quad_col >= 4;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    const int dt = upper ? tile ^ 2 : tile;  // tile / 4 == dt / 4: the same 32-column half
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp * 16 + group_row + 8 * half, col = dt * 8 + quad_col;
      const int chunk = (col % 32) / 4;
      float* out = stage + (tile / 4) * (64 * 32) + row * 32 + (chunk ^ (row % 8)) * 4 + col % 4;
      const float x = upper ? acc[tile ^ 2][2 * half] : acc[tile][2 * half];
      const float y = upper ? acc[tile ^ 2][2 * half + 1] : acc[tile][2 * half + 1];
      store_shared_pair(out, x * scale, y * scale);
    }
  }
}

// A k-step's dS^T A fragment (keys key, key + 8; rows row, row + 1, row + 8, row + 9) into the
// dQ warpgroup's buffer: [kKeys][kRows] in PanelSwizzle, rows contiguous.
template <int kKeys, int kRows, typename T>
__device__ __forceinline__ void store_ds_fragment(T* ds_tile, int key, int row,
                                                  const std::uint32_t (&a)[4]) {
  const PanelSwizzle<kKeys, kRows> layout{};
  *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key, row)) = a[0];
  *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key + 8, row)) = a[1];
  *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key, row + 8)) = a[2];
  *reinterpret_cast<std::uint32_t*>(ds_tile + layout(key + 8, row + 8)) = a[3];
}

// dS^T = P^T (dP^T - delta) in place of dP^T, with P^T as rounded in its A fragments: the fp32
// P^T is then dead once they are built, which leaves the consumers room for the dQ warpgroup's
// registers. It repeats ds_from_probabilities' loop on purpose: one loop for both, taking P^T
// through a lambda, changed the SASS of the unmasked head_dim 128 and the head_dim 64 kernels,
// and kernels.flash then failed its dK bound at 17 x 17, head_dim 64, causal (bf16 and f16) on
// an H200 (bench/results/attention-bwd-ds-one-loop-h200-2026-12-02.md).
template <typename T, int kRowTiles>
__device__ __forceinline__ void ds_from_fragments(float (&dp)[kRowTiles][4],
                                                  const std::uint32_t (&a_p)[kRowTiles / 2][4],
                                                  const FragmentRows<kRowTiles>& delta) {
#pragma unroll
  for (int nt = 0; nt < kRowTiles; ++nt) {
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const float2 prob = unpack2<T>(a_p[nt / 2][(nt % 2) * 2 + pair]);
      dp[nt][2 * pair] = prob.x * (dp[nt][2 * pair] - delta.v[nt][0]);
      dp[nt][2 * pair + 1] = prob.y * (dp[nt][2 * pair + 1] - delta.v[nt][1]);
    }
  }
}

// The row tiles (kRows rows each) that see some key of a Hopper backward CTA whose keys start at
// key0: causal hides rows before key0 - shift, a local mask the rows outside the first key's
// first row and the last key's last; kRowSplits takes part `z % row_splits` of them. Under a
// local mask, full_rows are the rows that see every key (tile_needs_mask).
struct BackwardRows {
  int first_tile, row_tiles;
  IndexRange full_rows;
};
template <bool kCausal, bool kRowSplits, int kRows, int kKeys>
__device__ __forceinline__ BackwardRows backward_rows(const FlashParams& p, int batch, int key0,
                                                      int z) {
  int first_tile = 0, row_tiles = (p.q_len + kRows - 1) / kRows;
  IndexRange full_rows{0, 0};
  if constexpr (kCausal) {
    if (p.local) {
      const detail::BlockReach reach = key_block_rows(p, batch, key0, kKeys);
      full_rows = index_range(reach.every);
      first_tile = static_cast<int>(reach.some.first) / kRows;
      row_tiles = reach.some.empty()
                      ? 0
                      : static_cast<int>((reach.some.last + kRows - 1) / kRows) - first_tile;
    } else {
      first_tile = clamp_to(key0 - p.shift, 0, p.q_len) / kRows;
      row_tiles -= first_tile;
    }
  } else if constexpr (kRowSplits) {
    const int all_tiles = row_tiles, split = z % p.row_splits;
    first_tile = all_tiles * split / p.row_splits;
    row_tiles = all_tiles * (split + 1) / p.row_splits - first_tile;
  }
  return {first_tile, row_tiles, full_rows};
}

// A walk over a Hopper backward CTA's steps: step i covers query head first + i / row_tiles, row
// tile i % row_tiles (counted from the first visible one). Each walk (the copier's loads, the
// consumers' steps and their statistics, ahead) keeps its place in counters: a division a step
// would cost every warp a reciprocal on the MUFU that the exponentials use.
struct StepWalk {
  int head, tile;
  __device__ __forceinline__ void advance(int tiles) {
    if (++tile == tiles) {
      tile = 0;
      ++head;
    }
  }
};

// The tensor maps of a Hopper backward launch (the kernel's __grid_constant__ parameters).
struct BackwardMaps {
  const CUtensorMap &k, &v, &q, &dout, &dq;
};

// The third warpgroup of both Hopper backward kernels, after its registers went to the consumers.
// One thread (the copier) copies the CTA's kKeys keys of K (kWidth columns) and V (kValueWidth)
// once, then Q and dO of each step into stage step % kStages once both consumer warpgroups have
// freed it (rows_empty), all in 64-column panels (K and V panels of kKeys rows, Q and dO of kRows).
// In the default mode (kAtomicDq) the warpgroup also computes each step's dQ (kRows rows) = dS K
// over the CTA's keys, from the dS^T the consumers leave in buffer step % kDsBuffers ([keys][rows]
// in PanelSwizzle, read M-major: its 16-key steps kRows * 32 bytes apart) and K (read MN-major),
// 32 columns at a time, so that the consumers keep almost every register. kTmaDq: the step's
// fp32 block is staged in `dq_stages` (64-column panels of [rows][32] halves) and added into
// global dQ by TMA reductions; else with atomics from the registers. Only the first kHeadDim
// columns are dQ's (the rest are zero padding).
template <typename T, int kKeys, int kRows, int kWidth, int kValueWidth, int kHeadDim, int kStages,
          int kDsBuffers, bool kAtomicDq, bool kTmaDq, typename StepRows>
__device__ __forceinline__ void backward_copy_and_dq_steps(
    const FlashParams& p, const BackwardMaps& maps, int batch, int kv_head, int key0, int steps,
    StepWalk first_step, int row_tiles, StepRows&& step_rows, T* k_tile, T* v_tile, T* q_tiles,
    T* do_tiles, const T* ds_tiles, float* dq_stages, std::uint64_t* kv_full,
    std::uint64_t* rows_full, std::uint64_t* rows_empty, std::uint64_t* ds_full,
    std::uint64_t* ds_empty) {
  const bool copier = threadIdx.x % 128 == 0;
  StepWalk loading = first_step;  // the step whose rows the copier loads next
  int loaded = 0;
  const auto load_rows = [&] {
    const int stage = loaded % kStages;
    const int head = loading.head, row_first = step_rows(loading);
    mbarrier_wait(rows_empty + stage, ((loaded / kStages) & 1) ^ 1);
    mbarrier_arrive_expect_bytes(rows_full + stage, kRows * (kWidth + kValueWidth) * 2);
    for (int panel = 0; panel < kWidth / 64; ++panel) {
      tma_load_box(q_tiles + (stage * kWidth + panel * 64) * kRows, &maps.q, panel * 64, row_first,
                   head, batch, rows_full + stage);
    }
    for (int panel = 0; panel < kValueWidth / 64; ++panel) {
      tma_load_box(do_tiles + (stage * kValueWidth + panel * 64) * kRows, &maps.dout, panel * 64,
                   row_first, head, batch, rows_full + stage);
    }
    ++loaded;
    loading.advance(row_tiles);
  };
  if (copier) {
    mbarrier_arrive_expect_bytes(kv_full, kKeys * (kWidth + kValueWidth) * 2);
    for (int panel = 0; panel < kWidth / 64; ++panel) {
      tma_load_box(k_tile + panel * kKeys * 64, &maps.k, panel * 64, key0, kv_head, batch,
                   kv_full);
    }
    for (int panel = 0; panel < kValueWidth / 64; ++panel) {
      tma_load_box(v_tile + panel * kKeys * 64, &maps.v, panel * 64, key0, kv_head, batch,
                   kv_full);
    }
    // Every stage at once: their first waits pass. In the default mode the later ones are copied
    // between dQ's products, the rest here.
    while (loaded < steps && (!kAtomicDq || loaded < kStages)) load_rows();
  }
  if constexpr (kAtomicDq) {
    constexpr int kPanels = kWidth / 64;
    constexpr int kDqBarrier = 1;  // the dQ warpgroup's named barrier (kTmaDq)
    constexpr int kDqCols = 32;    // the columns of dQ computed at a time
    constexpr int kDqParts = kWidth / kDqCols;
    static_assert(kDqParts >= 2 && kDqParts % 2 == 0,
                  "the dQ stage's reductions are waited for two blocks at a time");
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int group_row = lane / 4, quad_col = 2 * (lane % 4);
    std::uint64_t dq_keys[kPanels];
  #pragma unroll
    for (int panel = 0; panel < kPanels; ++panel) {
      dq_keys[panel] = mn_major_descriptor(k_tile + panel * kKeys * 64, kKeys);
    }
    mbarrier_wait(kv_full, 0);
    StepWalk at = first_step;
    for (int step = 0; step < steps; ++step, at.advance(row_tiles)) {
      const int buffer = step % kDsBuffers;
      const int row_first = step_rows(at);
      mbarrier_wait(ds_full + buffer, (step / kDsBuffers) & 1);
      const std::uint64_t a_ds0 =
          wgmma_descriptor(ds_tiles + buffer * kKeys * kRows, 16, kSwizzleAtomBytes);
  #pragma unroll
      for (int part = 0; part < kDqParts; ++part) {
        const int column = part * kDqCols, panel = column / 64;
        float dq[kDqCols / 8][4];
        wgmma_fence();
  #pragma unroll
        for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
          wgmma_ss_mn<kDqCols, T>(
              dq, descriptor_plus(a_ds0, kstep * 16 * kRows * sizeof(T)),
              descriptor_plus(dq_keys[panel], (kstep * 16 * 64 + column % 64) * sizeof(T)),
              kstep > 0 ? 1 : 0);
        }
        wgmma_commit();
        // While an even part runs, (kTmaDq) the wait for the reductions of the step before to
        // have read this part's block of the stage and the next one's. Each 64 x 32 block's
        // reduction is a bulk group of its own and they read in order, so part 0 waits for two
        // blocks and part 2 for the other two. (Waiting for the whole stage at part 0 held the
        // warpgroup at its barrier, and through it the consumers at their dS^T buffers for
        // about 12% of their time at 32k tokens.) Only the copier has groups; the others pass.
        if constexpr (kTmaDq) {
          if (part % 2 == 0) bulk_wait_group_read_at_most(kDqParts - 2 - part);
        }
        wgmma_wait<0>();
        pin_registers(dq);
        if (part == 0 && copier && loaded < steps) load_rows();  // with no product in flight
        if (column + kDqCols == kWidth && lane == 0) mbarrier_arrive(ds_empty + buffer);
        if constexpr (kTmaDq) {
          if (part % 2 == 0) named_barrier_sync(kDqBarrier, 128);
          stage_fp32_block(dq_stages + column * 64, dq, p.scale, warp, lane);
        } else if (column < kHeadDim) {  // the padding's columns are not dQ's
          add_dq_atomic(p, batch, at.head, row_first + warp * 16 + group_row, column, quad_col, dq);
        }
      }
      if constexpr (kTmaDq) {
        fence_proxy_async_shared();
        named_barrier_sync(kDqBarrier, 128);
        if (copier) {
          // A block of the padding's columns lies past dQ's width, where TMA writes nothing.
          for (int panel = 0; panel < kPanels; ++panel) {
            const float* block = dq_stages + panel * 64 * 64;
            tma_reduce_add_box(&maps.dq, block, panel * 64, row_first, at.head, batch);
            bulk_commit_group();
            tma_reduce_add_box(&maps.dq, block + 64 * 32, panel * 64 + 32, row_first, at.head,
                               batch);
            bulk_commit_group();
          }
        }
      }
    }
    // The last reductions finish before the CTA's shared memory goes.
    if constexpr (kTmaDq) {
      if (copier) bulk_wait_group<0>();
    }
  }
}

// kAtomicDq: the default mode, dQ added here (kTmaDq: by TMA reductions through dq_map, else with
// atomics); otherwise flash_dq_kernel computes it. kRowSplits (unmasked, kTmaDq): each key block's
// rows split over FlashParams::row_splits CTAs (one or more).
template <typename T, int kHeadDim, bool kCausal, bool kAtomicDq, bool kTmaDq,
          bool kRowSplits = false>
__global__ void __launch_bounds__(HopperBackwardTiles<kHeadDim>::kThreads, 1)
    flash_backward_sm90_kernel(const FlashParams p, const __grid_constant__ CUtensorMap k_map,
                               const __grid_constant__ CUtensorMap v_map,
                               const __grid_constant__ CUtensorMap q_map,
                               const __grid_constant__ CUtensorMap do_map,
                               const __grid_constant__ CUtensorMap dq_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kAtomicDq || !kTmaDq, "TMA reductions are the default mode's");
  static_assert(!kRowSplits || (!kCausal && kTmaDq), "row splits are the unmasked TMA mode's");
  using Tiles = HopperBackwardTiles<kHeadDim, kTmaDq>;
  constexpr int kKeys = Tiles::kKeys, kRows = Tiles::kRows, kStages = Tiles::kStages;
  constexpr int kGroups = Tiles::kConsumerGroups;
  constexpr int kRowTiles = kRows / 8;      // n-tiles of S^T
  constexpr int kRowSteps = kRows / 16;     // k-steps of dV and dK
  constexpr int kWidth = Tiles::kWidth;  // of Q, K, V and dO in shared memory (>= kHeadDim)
  // The dtype of the P^T fragments that dS^T is formed from in the default mode: f16 where the
  // registers allow (64 columns: no spills either way), whose three more bits than bf16 on [0, 1]
  // keep P's rounding out of dS; at 128 the second set of fragments spills (ptxas: 48-164 bytes
  // against 0-84), and dS takes the rounded P of dV's product.
  using DsProbability = std::conditional_t<kWidth <= 64, __half, T>;
  constexpr int kRowElements = kRows * kWidth;
  // The third warpgroup's registers and the consumers' (the dQ warpgroup needs more).
  constexpr int kThirdGroupRegisters =
      kAtomicDq ? Tiles::kDqGroupRegisters : Tiles::kProducerRegisters;
  constexpr int kConsumerRegisters =
      kAtomicDq ? Tiles::kDqConsumerRegisters : Tiles::kConsumerRegisters;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  T* k_tile = reinterpret_cast<T*>(smem);
  T* v_tile = k_tile + kKeys * kWidth;
  T* q_tiles = v_tile + kKeys * kWidth;            // [kStages][kRows * kWidth]
  T* do_tiles = q_tiles + kStages * kRowElements;  // [kStages][kRows * kWidth]
  T* ds_tiles = do_tiles + kStages * kRowElements;  // [kDsBuffers][kKeys * kRows]
  // [kWidth / 64 panels][64 * 64] (kTmaDq), 1024-byte aligned like the tiles before it
  float* dq_stages = reinterpret_cast<float*>(ds_tiles + Tiles::kDsBuffers * kKeys * kRows);
  // [consumer warps][2 buffers][LSE in log2 units, delta][kRows]
  float* statistics = dq_stages + Tiles::kDqStageBytes / 4;
  std::uint64_t* kv_full =
      reinterpret_cast<std::uint64_t*>(statistics + Tiles::kStatisticsBytes / 4);
  std::uint64_t* rows_full = kv_full + 1;
  std::uint64_t* rows_empty = rows_full + kStages;
  std::uint64_t* ds_full = rows_empty + kStages;
  std::uint64_t* ds_empty = ds_full + Tiles::kDsBuffers;
  int2* key_rows = reinterpret_cast<int2*>(ds_empty + Tiles::kDsBuffers);  // [consumer thread][2]

  const int warp_group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  // Causal: the first key blocks see the most rows; they start first (causal_grid_place).
  const GridPlace place = grid_place<kCausal>(p.schedule_group);
  const int key0 = place.order * kKeys;
  const int kv_head = place.y, batch = kRowSplits ? place.z / p.row_splits : place.z;

  const BackwardRows visible = backward_rows<kCausal, kRowSplits, kRows, kKeys>(p, batch, key0,
                                                                                place.z);
  const int first_tile = visible.first_tile, row_tiles = visible.row_tiles;
  const int steps = row_tiles > 0 ? row_tiles * p.group : 0;
  // Step i covers query head kv_head * group + i / row_tiles, row tile first_tile + i % row_tiles:
  // the CTAs in flight walk the same rows together. Starting each on a row tile of its own (tile
  // b or 5b for key block b, wrapping around) ran 3-4% slower on an H200 at 32k-128k tokens
  // without a mask, even with every start set to 0 at run time.
  const StepWalk first_step{kv_head * p.group, 0};
  const auto step_rows = [&](const StepWalk& at) { return (first_tile + at.tile) * kRows; };

  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 1);
    for (int stage = 0; stage < kStages; ++stage) {
      mbarrier_init(rows_full + stage, 1);
      mbarrier_init(rows_empty + stage, 4 * kGroups);  // one arrival per consumer warp
    }
    for (int buffer = 0; buffer < Tiles::kDsBuffers; ++buffer) {
      mbarrier_init(ds_full + buffer, 4 * kGroups);  // one arrival per consumer warp
      mbarrier_init(ds_empty + buffer, 4);           // one per warp of the dQ warpgroup
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  if (warp_group == kGroups) {
    // The third warpgroup. One thread copies K and V, then Q and dO of each step once the
    // consumers have freed its stage; in the default mode the warpgroup also computes each step's
    // dQ = dS K from the consumers' dS^T and adds it into global dQ.
    warpgroup_registers_decrease<kThirdGroupRegisters>();
    if (steps == 0) return;
    backward_copy_and_dq_steps<T, kKeys, kRows, kWidth, kWidth, kHeadDim, kStages,
                               Tiles::kDsBuffers, kAtomicDq, kTmaDq>(
        p, BackwardMaps{k_map, v_map, q_map, do_map, dq_map}, batch, kv_head, key0, steps,
        first_step, row_tiles, step_rows, k_tile, v_tile, q_tiles, do_tiles, ds_tiles, dq_stages,
        kv_full, rows_full, rows_empty, ds_full, ds_empty);
    return;
  }

  warpgroup_registers_increase<kConsumerRegisters>();
  float dk[kWidth / 8][4] = {};
  float dv[kWidth / 8][4] = {};
  const int wg_key = warp_group * 64;  // this warpgroup's first key within the CTA
  const int my_keys[2] = {key0 + wg_key + warp * 16 + group_row,
                          key0 + wg_key + warp * 16 + group_row + 8};
  int2* my_key_rows = key_rows + 2 * threadIdx.x;
  if (kCausal && p.local) key_rows_of(p, batch, my_keys, my_key_rows);

  if (steps > 0) {
    // The descriptors of this warpgroup's 64 rows of K and V (A operands: kKeys * 128 bytes
    // between panels), made uniform once.
    const std::uint64_t k_rows = uniform_descriptor(k_major_descriptor(k_tile + wg_key * 64));
    const std::uint64_t v_rows = uniform_descriptor(k_major_descriptor(v_tile + wg_key * 64));
    // Lane l holds the statistics of rows l and l + 32 of a step until it stages them in buffer
    // step % 2 of its warp's copy. Two buffers: a lane writes step + 2's only after the warp has
    // passed the __syncwarp that follows the writes of step + 1's, that is after every lane's
    // reads of step's.
    float next_lse[2], next_delta[2];
    float* warp_statistics = statistics + (threadIdx.x / 32) * 2 * 2 * kRows;
    StepWalk loading = first_step;  // the step whose statistics read_statistics loads next
    const auto read_statistics = [&] {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        load_row_statistics(p, batch, loading.head, step_rows(loading) + lane + 32 * half,
                            next_lse[half], next_delta[half]);
      }
      loading.advance(row_tiles);
    };
    const auto stage_statistics = [&](int step) {
      float* buffer = warp_statistics + (step % 2) * 2 * kRows;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        buffer[lane + 32 * half] = lse_in_log2(next_lse[half]);
        buffer[kRows + lane + 32 * half] = next_delta[half];
      }
      __syncwarp();
      if (step + 1 < steps) read_statistics();  // step + 1's
    };
    read_statistics();  // step 0's
    stage_statistics(0);
    mbarrier_wait(kv_full, 0);

    StepWalk at = first_step;
    for (int step = 0; step < steps; ++step, at.advance(row_tiles)) {
      const int stage = step % kStages;
      const int row_first = step_rows(at);
      const T* q_tile = q_tiles + stage * kRowElements;
      const T* do_tile = do_tiles + stage * kRowElements;
      const float* lse_log2 = warp_statistics + (step % 2) * 2 * kRows;
      const float* delta = lse_log2 + kRows;
      FragmentRows<kRowTiles> lse_rows, delta_rows;
      lse_rows.load(lse_log2, quad_col);
      mbarrier_wait(rows_full + stage, (step / kStages) & 1);
      // The dQ warpgroup has read this step's dS^T buffer two steps ago (waited for here, with no
      // product in flight: a wait loop while one runs makes ptxas serialize every product).
      const int ds_buffer = step % Tiles::kDsBuffers;
      if constexpr (kAtomicDq) {
        mbarrier_wait(ds_empty + ds_buffer, ((step / Tiles::kDsBuffers) & 1) ^ 1);
      }

      // S^T = K Q^T, then dP^T = V dO^T, as two groups: P^T is computed while dP^T runs, and
      // dS^T while dV += P^T dO runs.
      float s[kRowTiles][4], dp[kRowTiles][4];
      wgmma_fence();
      wgmma_rows_times_rows<kRows, kWidth, kKeys, kRows, T>(s, k_rows, k_major_descriptor(q_tile));
      wgmma_commit();
      wgmma_rows_times_rows<kRows, kWidth, kKeys, kRows, T>(dp, v_rows, k_major_descriptor(do_tile));
      wgmma_commit();
      wgmma_wait<1>();
      pin_registers(s);

      const bool masked =
          tile_needs_mask<kCausal, false>(p, visible.full_rows, row_first, kRows, key0, kKeys);
      probabilities<kCausal>(s, my_keys, row_first, quad_col, masked, lse_rows, p, batch,
                             my_key_rows);

      // dV += P^T dO (P^T as A fragments): k-step `kstep` covers rows [16 kstep, 16 kstep + 16),
      // 2048 bytes into the panels; the panels of a row tile are kRows * 128 bytes apart. The
      // rows' delta is read once dP^T is done: read before dV's issue (1-2% faster on an H200
      // when both warpgroups computed dQ) it is live at the step's register peak, which then
      // leaves too few for the dQ warpgroup. (The LSE rows read after S^T's issue cost 3-6%.)
      std::uint32_t a_p[kRowSteps][4], a_ds[kRowSteps][4];
      [[maybe_unused]] std::uint32_t ds_p[kRowSteps][4];  // (DsProbability other than T)
#pragma unroll
      for (int kstep = 0; kstep < kRowSteps; ++kstep) {
        probability_fragment<T>(a_p[kstep], s, kstep);
        if constexpr (kAtomicDq && !std::is_same_v<DsProbability, T>) {
          probability_fragment<DsProbability>(ds_p[kstep], s, kstep);
        }
      }
      add_fragments_times_rows<kWidth, kRows>(dv, a_p, do_tile);
      wgmma_wait<1>();  // dP^T (dV's group may still run)
      pin_registers(dp);
      delta_rows.load(delta, quad_col);
      if constexpr (kAtomicDq) {
        if constexpr (std::is_same_v<DsProbability, T>) {
          ds_from_fragments<T>(dp, a_p, delta_rows);
        } else {
          ds_from_fragments<DsProbability>(dp, ds_p, delta_rows);
        }
      } else {
        ds_from_probabilities(dp, s, delta_rows);
      }

      // dS^T as A fragments, and (kAtomicDq) into shared memory for the dQ warpgroup (the
      // rounded values the MMAs use; the buffer's wait is at the step's start); dK += dS^T Q.
      T* ds_tile = ds_tiles + ds_buffer * kKeys * kRows;
#pragma unroll
      for (int kstep = 0; kstep < kRowSteps; ++kstep) {
        probability_fragment<T>(a_ds[kstep], dp, kstep);
        if constexpr (kAtomicDq) {
          store_ds_fragment<kKeys, kRows>(ds_tile, wg_key + warp * 16 + group_row,
                                          kstep * 16 + quad_col, a_ds[kstep]);
        }
      }
      if constexpr (kAtomicDq) {
        fence_proxy_async_shared();
        __syncwarp();
        if (lane == 0) mbarrier_arrive(ds_full + ds_buffer);
      }
      add_fragments_times_rows<kWidth, kRows>(dk, a_ds, q_tile);
      if (step + 1 < steps) stage_statistics(step + 1);
      wgmma_wait<0>();  // dK: the stage's Q is free after it
      pin_registers(dk);
      pin_registers(dv);
      if (lane == 0) mbarrier_arrive(rows_empty + stage);
    }
  }

  // A CTA with no rows (keys after every query, or an empty part of a split) has nothing to add
  // (but writes its zeros when overwriting); the parts of a split key block add together.
  if (steps > 0 || p.overwrite_key_gradients) {
    // The first kHeadDim columns (the rest are the padding's).
    using Columns = const float(&)[kHeadDim / 8][4];
    add_key_gradients<T, kHeadDim>(p, batch, kv_head, my_keys, quad_col,
                                   reinterpret_cast<Columns>(dk), reinterpret_cast<Columns>(dv),
                                kRowSplits && p.row_splits > 1);
  }
#endif  // sm_90a
}

}  // namespace ringattn::cuda_detail
