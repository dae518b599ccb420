// The CUDA local block, forward: FlashAttention-2's algorithm on mma.sync tensor cores.
//
// One CTA of 4 warps owns 128 query rows of one (batch, head); each warp owns 32 of them and
// keeps its fp32 O accumulator and its softmax statistics in registers. K and V
// stream through two shared-memory stages: the next tile's cp.async copies run while the tensor
// cores work on the current one. The softmax runs in the exp2 domain (one FFMA and one EX2 per
// score) with the running maximum in raw score units. Q and K have kHeadDim columns (d_qk), V and
// O kValueDim (d_v): equal but for multi-head latent attention's 192/128.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/flash_params.hpp"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/smem_tile.cuh"

namespace ringattn::cuda_detail {

// Each warp owns kMTiles m16 tiles of query rows, so every K and V fragment read from shared
// memory feeds kMTiles MMAs: with one tile a warp, the shared-memory reads (16 FLOPs a byte) and
// not the tensor cores bounded the kernel. From head_dim 96 the two tiles' fp32 O accumulators
// take 96-128 registers, so the Q fragments are re-read from shared memory for each K/V tile
// instead of living in registers; above 128 a warp owns one tile (the accumulator of 256 columns
// alone takes 128 registers). The O accumulator is kValueDim wide and sets kMTiles; Q's width
// only lengthens the Q K^T loop (its fragments come from shared memory from 96 on): 192/128 takes
// 128/128's tiles.
template <int kHeadDim, int kValueDim = kHeadDim>
struct ForwardTiles {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMTiles = kValueDim <= 128 ? 2 : 1;
  static constexpr int kRows = 16 * kMTiles * kWarps;  // query rows per CTA
  // Keys per K/V stage: 64, or 32 from head_dim 96, where the scores of 64 keys would spill.
  static constexpr int kKeys = kHeadDim <= 64 && kValueDim <= 64 ? 64 : 32;
  static constexpr bool kQInRegisters = kHeadDim <= 64 && kValueDim <= 64;
  // Q, then two stages of K and V: 64 KiB at head_dim 64 and 128 (up to three CTAs an SM), 96
  // KiB at 256, 88 KiB at 192/128.
  static constexpr int kSmemBytes = (kRows * kHeadDim + 2 * kKeys * (kHeadDim + kValueDim)) * 2;
  static_assert(kSmemBytes <= kMaxDynamicSmemBytes, "the forward's tiles exceed shared memory");
};

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Rows of the 16-row tile at `row` of a swizzled [rows, head_dim] tile, as A fragments.
template <int kHeadDim, typename T>
__device__ __forceinline__ void load_a_fragment(std::uint32_t (&frag)[4], const T* tile, int row,
                                                int step, int lane) {
  const int r = row + (lane % 8) + ((lane / 8) % 2) * 8;
  ldmatrix_x4(frag, tile + swizzled<kHeadDim>(r, step * 16 + (lane / 16) * 8));
}

// The [len, head_dim] slice of (batch, head) in a [batch, len, heads, head_dim] input.
template <typename T>
__device__ __forceinline__ const T* head_slice(const void* base, const std::int64_t (&strides)[3],
                                               int batch, int head) {
  return static_cast<const T*>(base) + batch * strides[0] + head * strides[2];
}

// A CTA's place in a causal grid whose x walks the blocks of one (z, y) pair: `order` counts the
// pair's blocks from the one with the most work. The pairs go `group` at a time (a partial group
// first), the blocks of a group interleaved over its pairs, so that the CTAs launched last are
// the shortest of a few pairs: in pair order the longest block of the last pair started near the
// end, and each SM waited for it (a scheduling model put that at 6% of an 8k x 8k causal grid of
// 32 pairs on 132 SMs; the order below measured 3% faster on an H200). A
// group keeps its few pairs' rows hot in L2 together, which the longest-first order over every
// pair would not. Once per CTA: the divisions cost nothing.
struct GridPlace {
  int order, y, z;
};

__device__ __forceinline__ GridPlace causal_grid_place(int group) {
  const int blocks = gridDim.x, pairs = gridDim.y * gridDim.z;
  int at = blockIdx.x + blocks * (blockIdx.y + gridDim.y * blockIdx.z);
  const int front = pairs % group;  // the partial group's pairs
  int members = front, pair0 = 0;
  if (at >= front * blocks) {
    at -= front * blocks;
    const int g = at / (group * blocks);
    at -= g * group * blocks;
    members = group;
    pair0 = front + g * group;
  }
  const int pair = pair0 + at % members;
  return {at / members, pair % static_cast<int>(gridDim.y), pair / static_cast<int>(gridDim.y)};
}

// This CTA's place: causal_grid_place in a causal grid, else its block index as it is.
template <bool kCausal>
__device__ __forceinline__ GridPlace grid_place(int schedule_group) {
  if constexpr (kCausal) return causal_grid_place(schedule_group);
  return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}

// Keys [0, end) that some query row of [row0, row0 + rows) can see: all of them, or when causal
// those up to the last row's position.
template <bool kCausal>
__device__ __forceinline__ int visible_key_end(const FlashParams& p, int row0, int rows) {
  if (!kCausal) return p.k_len;
  const std::int64_t last_row = min(row0 + rows, p.q_len) - 1;
  return clamp_to(last_row + p.shift + 1, 0, p.k_len);
}

// Under a local mask (FlashParams::local), the keys [first, last) local row `row` of batch row
// `batch` sees, and the rows that see local key `key`; as local indices clamped to the block.
// (A row or key past the block's end, in a partial tile, is taken as the last one: its result
// is never stored, and its position stays within int64.)
__device__ __forceinline__ detail::LocalRange local_row_keys(const FlashParams& p, int batch,
                                                             std::int64_t row) {
  const std::int64_t position = p.q_start + min(row, static_cast<std::int64_t>(p.q_len) - 1);
  return detail::local_range(p.rule.for_batch(batch, p.document_stride).keys_of(position),
                             p.k_start, p.k_len);
}
__device__ __forceinline__ detail::LocalRange local_key_rows(const FlashParams& p, int batch,
                                                             std::int64_t key) {
  const std::int64_t position = p.k_start + min(key, static_cast<std::int64_t>(p.k_len) - 1);
  return detail::local_range(p.rule.for_batch(batch, p.document_stride).queries_of(position),
                             p.q_start, p.q_len);
}

// Local indices [first, last) as ints, as a kernel keeps them.
struct IndexRange {
  int first, last;
};
__device__ __forceinline__ IndexRange index_range(const detail::LocalRange& range) {
  return {static_cast<int>(range.first), static_cast<int>(range.last)};
}

// The keys of rows [row0, row0 + rows) (a CTA whose rows stay while it walks key tiles): `some`
// holds every key, the keys up to the last row's position when causal, or under a local mask
// the keys some row sees (detail::BlockReach); `every`, used only under a local mask, the keys
// that every row sees. Once per CTA: a test of each tile would cost a binary search over the
// document starts for each end.
template <bool kCausal>
__device__ __forceinline__ detail::BlockReach row_block_keys(const FlashParams& p, int batch,
                                                             int row0, int rows) {
  if (kCausal && p.local) {
    const int last_row = min(row0 + rows, p.q_len) - 1;
    return detail::block_reach(local_row_keys(p, batch, row0), local_row_keys(p, batch, last_row));
  }
  const int end = visible_key_end<kCausal>(p, row0, rows);
  return {{0, end}, {0, end}};
}

// The rows of keys [key0, key0 + keys) under a local mask (a CTA whose keys stay while it walks
// row tiles): the rows that see some key, and those that see every key.
__device__ __forceinline__ detail::BlockReach key_block_rows(const FlashParams& p, int batch,
                                                             int key0, int keys) {
  const int last_key = min(key0 + keys, p.k_len) - 1;
  return detail::block_reach(local_key_rows(p, batch, key0), local_key_rows(p, batch, last_key));
}

// Under a local mask, the keys [lo, hi) of the rows a thread holds (rows[0], rows[1]), for
// mask_scores_bounded. Computed where a tile needs the mask (a binary search over the document
// starts a row), so that no register holds them across the key loop.
__device__ __forceinline__ void local_key_bounds(const FlashParams& p, int batch,
                                                 const int (&rows)[2], int (&lo)[2], int (&hi)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const detail::LocalRange keys = local_row_keys(p, batch, rows[r]);
    lo[r] = static_cast<int>(keys.first);
    hi[r] = static_cast<int>(keys.last);
  }
}

// Whether the tile of keys [key0, key0 + keys) needs mask_scores for rows [row0, row0 + rows):
// keys past k_len, or some (row, key) pair hidden by the mask. Under a local mask `full` is the
// `every` of the CTA's fixed side: its row_block_keys (kFixedRows) or its key_block_rows.
template <bool kCausal, bool kFixedRows>
__device__ __forceinline__ bool tile_needs_mask(const FlashParams& p, IndexRange full, int row0,
                                                int rows, int key0, int keys) {
  if (key0 + keys > p.k_len) return true;
  if (!kCausal) return false;
  if (p.local) {
    if constexpr (kFixedRows) return key0 < full.first || key0 + keys > full.last;
    return row0 < full.first || min(row0 + rows, p.q_len) > full.last;
  }
  return static_cast<std::int64_t>(key0 + keys - 1) > row0 + p.shift;
}

// The pieces of a forward step that both kernel families share. A thread holds, for one 16-row
// tile, kKeyTiles n-tiles of scores s[nt][0..3] (rows[0] for elements 0-1, rows[1] for 2-3, keys
// key0 + nt * 8 + quad_col + {0, 1}) and the fp32 O accumulator of the same two rows.

// Hides the keys at or past k_len and, when causal, the keys after the row's position.
template <bool kCausal, int kKeyTiles>
__device__ __forceinline__ void mask_scores(float (&s)[kKeyTiles][4], int key0, const int (&rows)[2],
                                            int quad_col, const FlashParams& p) {
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + nt * 8 + quad_col + (e & 1);
      const bool hidden = key >= p.k_len ||
                          (kCausal && static_cast<std::int64_t>(key) > rows[e / 2] + p.shift);
      if (hidden) s[nt][e] = -kInfinity;
    }
  }
}

// Hides the keys outside each row's [lo, hi) (row_key_bounds).
template <int kKeyTiles>
__device__ __forceinline__ void mask_scores_bounded(float (&s)[kKeyTiles][4], int key0,
                                                    const int (&lo)[2], const int (&hi)[2],
                                                    int quad_col) {
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + nt * 8 + quad_col + (e & 1);
      if (key < lo[e / 2] || key >= hi[e / 2]) s[nt][e] = -kInfinity;
    }
  }
}

// The base a row's scores are exponentiated against: its maximum in log2 units of the scaled
// scores, or 0 while it has none (a masked score then gives exp2(-inf) = 0, not NaN).
__device__ __forceinline__ float row_base(float row_max, float scale_log2) {
  return row_max == -kInfinity ? 0.f : row_max * scale_log2;
}

// Row r's scores (elements 2r and 2r + 1 of each n-tile) exponentiated in place against `base`;
// returns the thread's partial sum of them.
template <int kKeyTiles>
__device__ __forceinline__ float exponentiate_row(float (&s)[kKeyTiles][4], int r,
                                                  float scale_log2, float base) {
  float partial_sum = 0.f;
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float& x = s[nt][2 * r + c];
      x = fast_exp2(x * scale_log2 - base);
      partial_sum += x;
    }
  }
  return partial_sum;
}

// Online softmax over one tile of scores: the row maxima, the scores exponentiated in place, the
// row sums; `correction` receives the factor that rescales what was accumulated before. A row's
// maximum moves only when some row of the warp gained more than kStaleMaxLog2 (log2 units of the
// scaled scores) over its own: otherwise every row keeps its old maximum, the tile's
// probabilities reach at most 2^kStaleMaxLog2, nothing accumulated needs rescaling and the
// function returns false (the same for every lane of the warp). The result is the same softmax:
// the epilogue divides by the row sum made against the same maximum and takes it into the LSE.
constexpr float kStaleMaxLog2 = 8.f;

template <int kKeyTiles>
__device__ __forceinline__ bool online_softmax_scores(float (&s)[kKeyTiles][4], float (&row_max)[2],
                                                      float (&row_sum)[2], float scale_log2,
                                                      float (&correction)[2]) {
  constexpr float kNegInf = -kInfinity;
  float new_max[2];
  bool grows = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float tile_max = kNegInf;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      tile_max = fmaxf(tile_max, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    }
    new_max[r] = fmaxf(row_max[r], quad_max(tile_max));
    // A row that has seen nothing yet takes its first finite maximum.
    grows |= row_max[r] == kNegInf ? new_max[r] != kNegInf
                                   : (new_max[r] - row_max[r]) * scale_log2 > kStaleMaxLog2;
  }
  const bool rescale = __any_sync(0xffffffffu, grows);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float old_max = row_max[r];
    if (rescale) row_max[r] = new_max[r];
    const float base = row_base(row_max[r], scale_log2);
    correction[r] = !rescale             ? 1.f
                    : old_max == kNegInf ? 0.f
                                         : fast_exp2(old_max * scale_log2 - base);
    const float partial_sum = exponentiate_row(s, r, scale_log2, base);
    row_sum[r] = rescale ? row_sum[r] * correction[r] + partial_sum : row_sum[r] + partial_sum;
  }
  return rescale;
}

// What stale_softmax_scores made of a tile (the same for every lane of the warp).
enum class TileSoftmax {
  kKept,        // the rows kept their maxima: nothing accumulated needs rescaling
  kMoved,       // some rows moved theirs: rescale what was accumulated by `correction`
  kNeedsScores  // a probability overflowed and the scores are lost: exponentiate them again
};

// The bound on a thread's partial row sum of one tile below which its probabilities need no
// maximum of the tile: each is at most the sum (none is negative), so at most 2^15, which fp16
// and bf16 P hold.
constexpr float kStaleSumLimit = 32768.f;
// The bound on every lane's partial row sums below which a tile may move its rows' maxima by
// scaling: its probabilities, its peaks and the scaled row sums then stay finite (a gain of at most
// 100 and a correction of at least 2^-100, a normal float). A sum past it, infinite or NaN, or one
// that a lane's finite probabilities overflowed, sends the tile to kNeedsScores: scaling an
// infinite sum would leave the row sum, and the row's LSE, infinite.
constexpr float kScaledSumLimit = 0x1p100f;

// Online softmax over one tile without the tile's row maxima. The scores are exponentiated
// against the rows' maxima so far at once, and the thread's partial row sums tell whether that
// was safe: if every lane's sums stay within kStaleSumLimit, the rows keep their maxima (kKept)
// and the tile cost no max, shuffle or comparison a score. Otherwise each row of the warp takes
// the largest probability it got, p, as its gain: the maximum moves up by log2(p) and the tile's
// probabilities, the row sum and (through `correction`) the accumulator are scaled by 1 / p
// (kMoved), the same softmax against another base. A row of the warp with no maximum yet sends
// the tile to online_softmax_scores before any exponent is taken (that needs the scores' maxima).
// A partial sum past kScaledSumLimit (a score more than about 95 log2 units above its row's
// maximum, or finite probabilities whose sum overflowed) leaves the scores lost and the statistics
// untouched: the caller recomputes the tile's scores and runs online_softmax_scores on them
// (kNeedsScores).
template <int kKeyTiles>
__device__ __forceinline__ TileSoftmax stale_softmax_scores(float (&s)[kKeyTiles][4],
                                                           float (&row_max)[2],
                                                           float (&row_sum)[2], float scale_log2,
                                                           float (&correction)[2]) {
  constexpr float kNegInf = -kInfinity;
  if (__any_sync(0xffffffffu, row_max[0] == kNegInf || row_max[1] == kNegInf)) {
    return online_softmax_scores(s, row_max, row_sum, scale_log2, correction) ? TileSoftmax::kMoved
                                                                             : TileSoftmax::kKept;
  }
  float partial_sum[2];
  bool bounded = true;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    partial_sum[r] = exponentiate_row(s, r, scale_log2, row_max[r] * scale_log2);
    bounded &= partial_sum[r] <= kStaleSumLimit;  // false for an infinite or NaN sum too
  }
  if (__all_sync(0xffffffffu, bounded)) {
    row_sum[0] += partial_sum[0];
    row_sum[1] += partial_sum[1];
    return TileSoftmax::kKept;
  }
  bool scalable = true;
#pragma unroll
  for (int r = 0; r < 2; ++r) scalable &= partial_sum[r] <= kScaledSumLimit;
  if (!__all_sync(0xffffffffu, scalable)) return TileSoftmax::kNeedsScores;
  float peak[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float largest = 0.f;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      largest = fmaxf(largest, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    }
    peak[r] = quad_max(largest);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float gain = peak[r] > 1.f ? __log2f(peak[r]) : 0.f;
    correction[r] = fast_exp2(-gain);
    row_max[r] += gain / scale_log2;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      s[nt][2 * r] *= correction[r];
      s[nt][2 * r + 1] *= correction[r];
    }
    row_sum[r] = (row_sum[r] + partial_sum[r]) * correction[r];
  }
  return TileSoftmax::kMoved;
}

// Scales the accumulator rows a thread holds (row g and row g + 8).
template <int kAccTiles>
__device__ __forceinline__ void rescale_rows(float (&acc)[kAccTiles][4],
                                             const float (&correction)[2]) {
#pragma unroll
  for (int dt = 0; dt < kAccTiles; ++dt) {
    acc[dt][0] *= correction[0];
    acc[dt][1] *= correction[0];
    acc[dt][2] *= correction[1];
    acc[dt][3] *= correction[1];
  }
}

// Online softmax: new maximum, rescale what was accumulated, exponentiate the scores in place.
template <int kKeyTiles, int kAccTiles>
__device__ __forceinline__ void online_softmax(float (&s)[kKeyTiles][4], float (&acc)[kAccTiles][4],
                                               float (&row_max)[2], float (&row_sum)[2],
                                               float scale_log2) {
  float correction[2];
  if (online_softmax_scores(s, row_max, row_sum, scale_log2, correction)) {
    rescale_rows(acc, correction);
  }
}

// The probabilities of keys [16 kstep, 16 kstep + 16) as an A fragment (registers only).
template <typename T, int kKeyTiles>
__device__ __forceinline__ void probability_fragment(std::uint32_t (&a)[4],
                                                     const float (&s)[kKeyTiles][4], int kstep) {
  a[0] = pack2<T>(s[2 * kstep][0], s[2 * kstep][1]);
  a[1] = pack2<T>(s[2 * kstep][2], s[2 * kstep][3]);
  a[2] = pack2<T>(s[2 * kstep + 1][0], s[2 * kstep + 1][1]);
  a[3] = pack2<T>(s[2 * kstep + 1][2], s[2 * kstep + 1][3]);
}

// Epilogue for the two rows a thread holds: normalise, then write O and LSE, or merge them into
// the running fp32 pair (combine mode). Every lane of the warp must call it (quad shuffles). O
// and the accumulator have kValueDim columns.
template <typename T, int kValueDim, bool kCombine>
__device__ __forceinline__ void store_forward_rows(const FlashParams& p, int batch, int head,
                                                   const int (&rows)[2],
                                                   const float (&acc)[kValueDim / 8][4],
                                                   const float (&row_max)[2],
                                                   const float (&row_sum)[2], int lane) {
  constexpr float kNegInf = -kInfinity;
  const int quad_col = 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = rows[r];
    const bool valid = row < p.q_len;
    const float total = quad_sum(row_sum[r]);
    const bool empty = !(total > 0.f);
    const float block_lse = empty ? kNegInf : row_max[r] * p.scale + __logf(total);
    float* lse = p.lse + batch * p.lse_strides[0] + head * p.lse_strides[1] +
                 static_cast<std::int64_t>(valid ? row : 0) * p.lse_strides[2];
    if constexpr (kCombine) {
      // One lane of the quad reads and writes the running LSE; the others get it by shuffle.
      float old_lse = (valid && lane % 4 == 0) ? *lse : kNegInf;
      old_lse = __shfl_sync(0xffffffffu, old_lse, lane & ~3);
      if (!valid || empty) continue;
      float* o = static_cast<float*>(p.o) + batch * p.o_strides[0] + row * p.o_strides[1] +
                 head * p.o_strides[2];
      const float merged =
          old_lse == kNegInf
              ? block_lse
              : fmaxf(old_lse, block_lse) + log1pf(__expf(-fabsf(old_lse - block_lse)));
      const float keep = old_lse == kNegInf ? 0.f : __expf(old_lse - merged);
      const float add = __expf(block_lse - merged) / total;
#pragma unroll
      for (int dt = 0; dt < kValueDim / 8; ++dt) {
        float2* out = reinterpret_cast<float2*>(o + dt * 8 + quad_col);
        float2 value = *out;
        value.x = value.x * keep + acc[dt][2 * r] * add;
        value.y = value.y * keep + acc[dt][2 * r + 1] * add;
        *out = value;
      }
      if (lane % 4 == 0) *lse = merged;
    } else {
      if (!valid) continue;
      T* o = static_cast<T*>(p.o) + batch * p.o_strides[0] + row * p.o_strides[1] +
             head * p.o_strides[2];
      const float inv = empty ? 0.f : 1.f / total;
#pragma unroll
      for (int dt = 0; dt < kValueDim / 8; ++dt) {
        *reinterpret_cast<std::uint32_t*>(o + dt * 8 + quad_col) =
            pack2<T>(acc[dt][2 * r] * inv, acc[dt][2 * r + 1] * inv);
      }
      if (lane % 4 == 0) *lse = block_lse;
    }
  }
}

template <typename T, int kHeadDim, int kValueDim, bool kCausal, bool kCombine>
__global__ void __launch_bounds__(ForwardTiles<kHeadDim, kValueDim>::kThreads)
    flash_forward_kernel(const FlashParams p) {
  using Tiles = ForwardTiles<kHeadDim, kValueDim>;
  constexpr int kRows = Tiles::kRows, kKeys = Tiles::kKeys, kThreads = Tiles::kThreads;
  constexpr int kMTiles = Tiles::kMTiles;
  constexpr int kDimSteps = kHeadDim / 16;     // k-steps of Q K^T
  constexpr int kValueSteps = kValueDim / 16;  // n-tile pairs of P V
  constexpr int kKeyTiles = kKeys / 8;      // n-tiles of S
  constexpr float kNegInf = -kInfinity;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  T* k_tiles = q_tile + kRows * kHeadDim;  // [2][kKeys * kHeadDim]
  T* v_tiles = k_tiles + 2 * kKeys * kHeadDim;  // [2][kKeys * kValueDim]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  const int row0 = blockIdx.x * kRows;
  const int warp_row = warp * 16 * kMTiles;  // first row of this warp within the CTA
  const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / p.group;

  const T* q = head_slice<T>(p.q, p.q_strides, batch, head);
  const T* k = head_slice<T>(p.k, p.k_strides, batch, kv_head);
  const T* v = head_slice<T>(p.v, p.v_strides, batch, kv_head);

  // Key tiles [first_tile, key_tiles) hold every key some row of this CTA can see (keys below
  // key_end; under a local mask none below first_tile's).
  const detail::BlockReach reach = row_block_keys<kCausal>(p, batch, row0, kRows);
  const detail::LocalRange& visible = reach.some;
  const IndexRange full_keys = index_range(reach.every);
  const int key_end = static_cast<int>(visible.last);
  const int first_tile = visible.empty() ? 0 : static_cast<int>(visible.first) / kKeys;
  const int key_tiles = visible.empty() ? 0 : (key_end + kKeys - 1) / kKeys;

  if (key_tiles > first_tile) {
    load_tile_async<kRows, kHeadDim, kThreads>(q_tile, q, p.q_strides[1], row0, p.q_len);
    load_tile_async<kKeys, kHeadDim, kThreads>(k_tiles, k, p.k_strides[1], first_tile * kKeys,
                                               key_end);
    load_tile_async<kKeys, kValueDim, kThreads>(v_tiles, v, p.v_strides[1], first_tile * kKeys,
                                                key_end);
  }
  cp_async_commit();

  float acc[kMTiles][kValueDim / 8][4] = {};
  float row_max[kMTiles][2], row_sum[kMTiles][2];
  // The rows this thread holds, as local query indices: tile mt, half r (+0 or +8).
  int my_rows[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = kNegInf;
      row_sum[mt][r] = 0.f;
      my_rows[mt][r] = row0 + warp_row + mt * 16 + group_row + 8 * r;
    }
  }
  std::uint32_t q_frag[Tiles::kQInRegisters ? kMTiles : 1][Tiles::kQInRegisters ? kDimSteps : 1][4];

  cp_async_wait<0>();
  __syncthreads();
  if constexpr (Tiles::kQInRegisters) {
    if (key_tiles > first_tile) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int step = 0; step < kDimSteps; ++step) {
          load_a_fragment<kHeadDim>(q_frag[mt][step], q_tile, warp_row + mt * 16, step, lane);
        }
      }
    }
  }

  for (int tile = first_tile; tile < key_tiles; ++tile) {
    const int stage = (tile - first_tile) & 1;
    const T* k_tile = k_tiles + stage * kKeys * kHeadDim;
    const T* v_tile = v_tiles + stage * kKeys * kValueDim;
    if (tile + 1 < key_tiles) {
      const int next = stage ^ 1;
      load_tile_async<kKeys, kHeadDim, kThreads>(k_tiles + next * kKeys * kHeadDim, k,
                                                 p.k_strides[1], (tile + 1) * kKeys, key_end);
      load_tile_async<kKeys, kValueDim, kThreads>(v_tiles + next * kKeys * kValueDim, v,
                                                  p.v_strides[1], (tile + 1) * kKeys, key_end);
    }
    cp_async_commit();

    // S = Q K^T for this warp's rows and the tile's keys.
    float s[kMTiles][kKeyTiles][4] = {};
#pragma unroll
    for (int step = 0; step < kDimSteps; ++step) {
      std::uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if constexpr (Tiles::kQInRegisters) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[mt][step][i];
        } else {
          load_a_fragment<kHeadDim>(a[mt], q_tile, warp_row + mt * 16, step, lane);
        }
      }
#pragma unroll
      for (int pair = 0; pair < kKeyTiles / 2; ++pair) {
        std::uint32_t b[4];
        const int key = pair * 16 + (lane % 8) + (lane / 16) * 8;
        ldmatrix_x4(b, k_tile + swizzled<kHeadDim>(key, step * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(s[mt][2 * pair], a[mt], b[0], b[1]);
          mma_16816<T>(s[mt][2 * pair + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Mask keys past the end and, when causal, keys after the row's position (under a local
    // mask, keys outside the row's interval). Tiles that every row of the CTA sees in full skip
    // this.
    const int key0 = tile * kKeys;
    if (tile_needs_mask<kCausal, true>(p, full_keys, row0, kRows, key0, kKeys)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if (kCausal && p.local) {
          int lo[2], hi[2];
          local_key_bounds(p, batch, my_rows[mt], lo, hi);
          mask_scores_bounded(s[mt], key0, lo, hi, quad_col);
        } else {
          mask_scores<kCausal>(s[mt], key0, my_rows[mt], quad_col, p);
        }
      }
    }

#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      online_softmax(s[mt], acc[mt], row_max[mt], row_sum[mt], p.scale_log2);
    }

    // O += P V: the S accumulators become A fragments without leaving registers.
#pragma unroll
    for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
      std::uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) probability_fragment<T>(a[mt], s[mt], kstep);
#pragma unroll
      for (int pair = 0; pair < kValueSteps; ++pair) {
        std::uint32_t b[4];
        const int key = kstep * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(b, v_tile + swizzled<kValueDim>(key, pair * 16 + (lane / 16) * 8));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(acc[mt][2 * pair], a[mt], b[0], b[1]);
          mma_16816<T>(acc[mt][2 * pair + 1], a[mt], b[2], b[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
  }

#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    store_forward_rows<T, kValueDim, kCombine>(p, batch, head, my_rows[mt], acc[mt], row_max[mt],
                                               row_sum[mt], lane);
  }
}

}  // namespace ringattn::cuda_detail
