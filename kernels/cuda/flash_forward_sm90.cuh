// The CUDA local block, forward, Hopper family (sm_90a): the same algorithm and epilogue as
// flash_forward.cuh, with both products on warpgroup MMAs (wgmma) fed by TMA copies.
//
// One CTA owns 128 query rows of one (batch, head): two consumer warpgroups of 64 rows each
// (every warp 16), which keep their fp32 O and softmax statistics in registers, and a producer
// warpgroup that hands most of its registers to them. One producer thread copies Q once and the
// K and V tiles of 128 keys (64 at head dims 192 and 256) into a ring of shared-memory stages with
// TMA (128-byte swizzle; rows past the end, and columns past a head dim that is not a multiple of
// 64, as zeros); full / empty mbarriers per stage hand each buffer between the producer and the
// consumers, so no CTA-wide barrier stands in the loop. Q and K are head_dim wide, V and O
// v_head_dim (192 with 128: multi-head latent attention).
//
// Per tile j a consumer warpgroup issues S_j = Q K_j^T (head_dim / 16 wgmmas, both operands in
// shared memory) and then O += P_{j-1} V_{j-1} (keys / 16 wgmmas of v_head_dim columns, P from
// registers, V read MN-major),
// and runs the online softmax of S_j while the second product is still in flight. The two
// warpgroups take turns to issue (two named barriers), so one's softmax overlaps the other's
// products on the tensor cores. The softmax exponentiates S_j against the rows' maxima so far
// without taking the tile's maxima first (stale_softmax_scores): only a tile whose partial row
// sums exceed 2^15 moves them, and a warp whose probabilities overflow makes its rows of S_j
// again on mma.sync (warp_scores; a wgmma would need the whole warpgroup).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/flash_forward.cuh"
#include "kernels/cuda/flash_params.hpp"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/tma_ptx.cuh"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace ringattn::cuda_detail {

// Q, K and V sit in shared memory as whole 64-column panels: a head dim that is not a multiple of
// 64 (32, 96) fills its last panel with the zeros that TMA writes for the columns past the view's
// width, which add nothing to Q K^T and make O columns that are never stored.
template <int kHeadDim, int kValueDim = kHeadDim>
struct HopperForwardTiles {
  static constexpr int kQKWidth = (kHeadDim + 63) / 64 * 64;  // Q and K in shared memory
  static constexpr int kVWidth = (kValueDim + 63) / 64 * 64;  // V, and O in registers
  static constexpr int kConsumerGroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerGroups;
  static constexpr int kThreads = kConsumerThreads + 128;  // and the producer warpgroup
  // Registers a thread: the producer gives back all but 24, the consumers take 240 (65536 in all).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kRows = 64 * kConsumerGroups;      // query rows per CTA
  static constexpr int kQBytes = kRows * kQKWidth * 2;
  // Q and the K and V stages share at most 220 KiB (the rest of the 227 a CTA may have holds the
  // barriers and the alignment's slack). A stage holds 128 keys where two such stages fit beside
  // Q (head dims up to 128, and 192 with V of 128), else 64 (192 and 256).
  static constexpr int kStageBudget = 220 * 1024;
  static constexpr int kKeys =
      kQBytes + 2 * 128 * (kQKWidth + kVWidth) * 2 <= kStageBudget ? 128 : 64;
  static constexpr int kKTileBytes = kKeys * kQKWidth * 2;  // one K stage
  static constexpr int kVTileBytes = kKeys * kVWidth * 2;   // one V stage
  // As many stages as fit, at most 4: 4 at head_dim 64, 3 at 192 (and 192 with V of 128: 2), 2 at
  // 128 and 256.
  static constexpr int kStages = (kStageBudget - kQBytes) / (kKTileBytes + kVTileBytes) < 4
                                     ? (kStageBudget - kQBytes) / (kKTileBytes + kVTileBytes)
                                     : 4;
  static_assert(kStages >= 2, "two K/V stages at least, for the producer to run ahead");
  static constexpr int kBarriers = 1 + 4 * kStages;  // Q; full and empty of K and V
  // Q, the K and V stages (160 KiB at head_dim 128, 144 KiB at 64, 192 at 192 and 256) and the
  // barriers, the keys that every row sees under a local mask (two ints), plus the slack that
  // aligns the tiles to the swizzle's 1024-byte period.
  static constexpr int kSmemBytes =
      kQBytes + kStages * (kKTileBytes + kVTileBytes) + 8 * kBarriers + 8 + 1024;
};

// One warp's 16 rows of S = Q K^T (Q rows from `row` of q_tile, every key of k_tile) on mma.sync:
// the warp's share of the warpgroup's product, in the same accumulator layout, which a warp can
// make without the rest of its warpgroup. For a tile whose softmax overflowed (rare).
template <typename T, int kHeadDim, int kQRows, int kKeys>
__device__ __forceinline__ void warp_scores(float (&s)[kKeys / 8][4], const T* q_tile, int row,
                                            const T* k_tile, int lane) {
#pragma unroll
  for (int nt = 0; nt < kKeys / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  const PanelSwizzle<kQRows, kHeadDim> q_at;
  const PanelSwizzle<kKeys, kHeadDim> k_at;
#pragma unroll 1
  for (int step = 0; step < kHeadDim / 16; ++step) {
    std::uint32_t a[4];
    ldmatrix_x4(a, q_tile + q_at(row + (lane % 8) + ((lane / 8) % 2) * 8,
                                 step * 16 + (lane / 16) * 8));
#pragma unroll
    for (int pair = 0; pair < kKeys / 16; ++pair) {
      std::uint32_t b[4];
      ldmatrix_x4(b, k_tile + k_at(pair * 16 + (lane % 8) + (lane / 16) * 8,
                                   step * 16 + ((lane / 8) % 2) * 8));
      mma_16816<T>(s[2 * pair], a, b[0], b[1]);
      mma_16816<T>(s[2 * pair + 1], a, b[2], b[3]);
    }
  }
}

template <typename T, int kHeadDim, int kValueDim, bool kCausal, bool kCombine>
__global__ void __launch_bounds__(HopperForwardTiles<kHeadDim, kValueDim>::kThreads, 1)
    flash_forward_sm90_kernel(const FlashParams p, const __grid_constant__ CUtensorMap q_map,
                              const __grid_constant__ CUtensorMap k_map,
                              const __grid_constant__ CUtensorMap v_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tiles = HopperForwardTiles<kHeadDim, kValueDim>;
  constexpr int kRows = Tiles::kRows, kKeys = Tiles::kKeys, kStages = Tiles::kStages;
  constexpr int kGroups = Tiles::kConsumerGroups;
  constexpr int kKeyTiles = kKeys / 8;       // n-tiles of S
  constexpr int kQKWidth = Tiles::kQKWidth, kVWidth = Tiles::kVWidth;
  constexpr int kPanels = kQKWidth / 64;      // 64-column panels of a Q or K tile
  constexpr int kValuePanels = kVWidth / 64;  // and of a V tile
  constexpr int kKTileElements = kKeys * kQKWidth, kVTileElements = kKeys * kVWidth;
  constexpr int kScheduleBarrier = 1;        // named barriers kScheduleBarrier + warp group
  constexpr int kPairThreads = 256;          // one warpgroup syncs, the previous one arrives
  constexpr float kNegInf = -kInfinity;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  T* q_tile = reinterpret_cast<T*>(smem);
  T* k_tiles = q_tile + kRows * kQKWidth;            // [kStages][kKeys * kQKWidth]
  T* v_tiles = k_tiles + kStages * kKTileElements;  // [kStages][kKeys * kVWidth]
  std::uint64_t* q_full = reinterpret_cast<std::uint64_t*>(v_tiles + kStages * kVTileElements);
  std::uint64_t* k_full = q_full + 1;
  std::uint64_t* v_full = k_full + kStages;
  std::uint64_t* k_empty = v_full + kStages;
  std::uint64_t* v_empty = k_empty + kStages;
  // Under a local mask, the keys [first, last) that every row sees, for tile_needs_mask: read
  // from shared memory at each tile (held in registers across the loop they cost the consumers
  // spills).
  int* full_keys = reinterpret_cast<int*>(v_empty + kStages);

  const int warp_group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  // Causal: the last row blocks see the most keys; start them first so that the short ones fill
  // the tail of the grid.
  const GridPlace place = grid_place<kCausal>(p.schedule_group);
  const int row_block = kCausal ? gridDim.x - 1 - place.order : place.order;
  const int row0 = row_block * kRows;
  const int head = place.y, batch = place.z, kv_head = head / p.group;

  // The key tiles first_tile .. first_tile + key_tiles - 1 hold every key some row of this CTA
  // sees (under a local mask none below first_tile's); loops count tiles from first_tile.
  const detail::BlockReach reach = row_block_keys<kCausal>(p, batch, row0, kRows);
  const detail::LocalRange& visible = reach.some;
  const int first_tile = visible.empty() ? 0 : static_cast<int>(visible.first) / kKeys;
  const int key_tiles =
      visible.empty() ? 0 : (static_cast<int>(visible.last) + kKeys - 1) / kKeys - first_tile;

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int stage = 0; stage < kStages; ++stage) {
      mbarrier_init(k_full + stage, 1);
      mbarrier_init(v_full + stage, 1);
      mbarrier_init(k_empty + stage, 4 * kGroups);  // one arrival per consumer warp
      mbarrier_init(v_empty + stage, 4 * kGroups);
    }
    mbarrier_init_fence();
    full_keys[0] = static_cast<int>(reach.every.first);
    full_keys[1] = static_cast<int>(reach.every.last);
  }
  __syncthreads();

  if (warp_group == kGroups) {
    // The producer: Q, then K and V of each tile once the consumers have freed its stage; one
    // thread issues every copy.
    warpgroup_registers_decrease<Tiles::kProducerRegisters>();
    if (threadIdx.x % 128 == 0 && key_tiles > 0) {
      mbarrier_arrive_expect_bytes(q_full, Tiles::kQBytes);
      for (int panel = 0; panel < kPanels; ++panel) {
        tma_load_box(q_tile + panel * kRows * 64, &q_map, panel * 64, row0, head, batch, q_full);
      }
      for (int tile = 0; tile < key_tiles; ++tile) {
        const int stage = tile % kStages, free_parity = ((tile / kStages) & 1) ^ 1;
        const auto load = [&](T* stage_tile, int panels, int bytes, const CUtensorMap* map,
                              std::uint64_t* empty, std::uint64_t* full) {
          mbarrier_wait(empty + stage, free_parity);
          mbarrier_arrive_expect_bytes(full + stage, bytes);
          for (int panel = 0; panel < panels; ++panel) {
            tma_load_box(stage_tile + panel * kKeys * 64, map, panel * 64,
                         (first_tile + tile) * kKeys, kv_head, batch, full + stage);
          }
        };
        load(k_tiles + stage * kKTileElements, kPanels, Tiles::kKTileBytes, &k_map, k_empty,
             k_full);
        load(v_tiles + stage * kVTileElements, kValuePanels, Tiles::kVTileBytes, &v_map, v_empty,
             v_full);
      }
    }
    return;
  }

  warpgroup_registers_increase<Tiles::kConsumerRegisters>();
  float acc[kVWidth / 8][4] = {};
  float row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.f, 0.f};
  const int my_rows[2] = {row0 + warp_group * 64 + warp * 16 + group_row,
                          row0 + warp_group * 64 + warp * 16 + group_row + 8};

  if (key_tiles > 0) {
    // The descriptor of this warpgroup's 64 rows of Q (the panels start kRows * 128 bytes apart),
    // made uniform once.
    const std::uint64_t q_rows = uniform_descriptor(k_major_descriptor(q_tile + warp_group * 64 * 64));
    float s[kKeyTiles][4];
    std::uint32_t probabilities[kKeys / 16][4];
    float correction[2];
    bool rescale = false;  // whether the last softmax moved a row's maximum (warp-uniform)

    const auto release = [&](std::uint64_t* empty) {
      if (lane == 0) mbarrier_arrive(empty);
    };
    // Issue turns: warpgroup g waits for g - 1 (the last one for the first), then hands on.
    // The last warpgroup's final hand-over would have no taker and is skipped.
    const auto wait_turn = [&] { named_barrier_sync(kScheduleBarrier + warp_group, kPairThreads); };
    const auto hand_over = [&](int tile) {
      if (warp_group + 1 < kGroups || tile + 1 < key_tiles) {
        named_barrier_arrive(kScheduleBarrier + (warp_group + 1) % kGroups, kPairThreads);
      }
    };
    // S = Q K^T.
    const auto issue_scores = [&](int stage) {
      wgmma_fence();
      wgmma_rows_times_rows<kKeys, kQKWidth, kRows, kKeys, T>(
          s, q_rows, k_major_descriptor(k_tiles + stage * kKTileElements));
      wgmma_commit();
    };
    // O += P V: k-step `kstep` covers keys [16 kstep, 16 kstep + 16), 2048 bytes into the panels;
    // V's 64-column panels are kKeys * 128 bytes apart.
    const auto issue_values = [&](int stage) {
      const std::uint64_t b0 = mn_major_descriptor(v_tiles + stage * kVTileElements, kKeys);
      wgmma_fence();
#pragma unroll
      for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
        wgmma_rs_mn<kVWidth, T>(acc, probabilities[kstep],
                                 descriptor_plus(b0, kstep * 16 * 64 * sizeof(T)), 1);
      }
      wgmma_commit();
    };
    // The softmax of S_j, then K_j's stage is released: until then a warp can make its scores
    // again, for a tile whose probabilities overflowed against the rows' old maxima.
    const auto apply_mask = [&](int key0) {
      if (kCausal && p.local) {
        int lo[2], hi[2];
        local_key_bounds(p, batch, my_rows, lo, hi);
        mask_scores_bounded(s, key0, lo, hi, quad_col);
      } else {
        mask_scores<kCausal>(s, key0, my_rows, quad_col, p);
      }
    };
    const auto softmax = [&](int tile) {
      const int key0 = (first_tile + tile) * kKeys, stage = tile % kStages;
      const IndexRange full = p.local ? IndexRange{full_keys[0], full_keys[1]} : IndexRange{0, 0};
      const bool masked = tile_needs_mask<kCausal, true>(p, full, row0, kRows, key0, kKeys);
      if (masked) apply_mask(key0);
      const TileSoftmax done =
          stale_softmax_scores(s, row_max, row_sum, p.scale_log2, correction);
      if (done == TileSoftmax::kNeedsScores) {
        warp_scores<T, kQKWidth, kRows, kKeys>(s, q_tile, warp_group * 64 + warp * 16,
                                               k_tiles + stage * kKTileElements, lane);
        if (masked) apply_mask(key0);
        rescale = online_softmax_scores(s, row_max, row_sum, p.scale_log2, correction);
      } else {
        rescale = done == TileSoftmax::kMoved;
      }
      release(k_empty + stage);
    };
    const auto to_probabilities = [&] {
#pragma unroll
      for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
        probability_fragment<T>(probabilities[kstep], s, kstep);
      }
    };

    mbarrier_wait(q_full, 0);
    if (warp_group == kGroups - 1) {
      named_barrier_arrive(kScheduleBarrier, kPairThreads);  // the first turn is group 0's
    }
    mbarrier_wait(k_full, 0);
    wait_turn();
    issue_scores(0);
    hand_over(0);
    wgmma_wait<0>();
    pin_registers(s);
    softmax(0);
    to_probabilities();

    for (int tile = 1; tile < key_tiles; ++tile) {
      const int stage = tile % kStages, parity = (tile / kStages) & 1;
      const int previous = (tile - 1) % kStages, previous_parity = ((tile - 1) / kStages) & 1;
      mbarrier_wait(k_full + stage, parity);
      wait_turn();
      issue_scores(stage);
      if (rescale) rescale_rows(acc, correction);
      mbarrier_wait(v_full + previous, previous_parity);
      issue_values(previous);
      hand_over(tile);
      wgmma_wait<1>();  // S_j is done; P_{j-1} V_{j-1} may still run
      pin_registers(s);
      softmax(tile);
      wgmma_wait<0>();
      pin_registers(acc);
      release(v_empty + previous);
      to_probabilities();
    }

    const int last = key_tiles - 1;
    if (rescale) rescale_rows(acc, correction);
    mbarrier_wait(v_full + last % kStages, (last / kStages) & 1);
    issue_values(last % kStages);
    wgmma_wait<0>();
    pin_registers(acc);
  }

  // O's first kValueDim columns (the rest, of V's zero padding, are zeros).
  store_forward_rows<T, kValueDim, kCombine>(
      p, batch, head, my_rows, reinterpret_cast<const float(&)[kValueDim / 8][4]>(acc), row_max,
      row_sum, lane);
#endif  // sm_90a
}

}  // namespace ringattn::cuda_detail
