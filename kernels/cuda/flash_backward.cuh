// The CUDA local block, backward with recomputation (FlashAttention-2's schedule).
//
// flash_backward_kernel: one CTA of 8 warps owns 128 keys of one (batch, kv head); each warp owns
// 16 keys and keeps their dK and dV in fp32 registers while it walks over every query row tile of
// every query head of the GQA group. It recomputes S^T = K Q^T and P^T = exp(S^T - LSE) tile by
// tile from the saved LSE, so P never exists in memory. dQ = dS K needs a sum over keys that
// live in other CTAs: in the default mode the CTA stages dS in shared memory and adds its dQ
// contribution with fp32 atomics; in the deterministic mode it leaves dQ alone and
// flash_dq_kernel computes dQ with one CTA per row tile that loops over the keys in a fixed order.
//
// Q, K, dQ and dK have kHeadDim columns (d_qk), V, O, dO and dV kValueDim (d_v): equal but for
// multi-head latent attention's 192/128. S^T = K Q^T and dK sum over d_qk, dP^T = V dO^T and dV
// over d_v, with loops that run over the wider of the two and skip the narrower's missing steps
// (has_step: for equal widths, the instructions of one width).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/flash_forward.cuh"
#include "kernels/cuda/flash_params.hpp"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/smem_tile.cuh"

namespace ringattn::cuda_detail {

constexpr float kLog2e = 1.4426950408889634f;

// Whether a loop over kAll steps (those of the wider of d_qk and d_v) has work at `step` for a
// width of kSteps steps. For equal widths the test is gone before the loop is unrolled: a test
// that only the unrolling removed gave the equal-width kernels another schedule (the SASS of
// every d_qk == d_v instantiation is the same as before the two widths).
template <int kSteps, int kAll>
__device__ __forceinline__ bool has_step(int step) {
  if constexpr (kSteps == kAll) {
    return true;
  } else {
    return step < kSteps;
  }
}

// dQ's atomics are the costliest instructions of the backward: sm_90 adds two floats in one
// (8-byte aligned: quad_col is even and dQ rows have even strides).
__device__ __forceinline__ void add_pair_atomic(float* address, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(address), make_float2(x, y));
#else
  atomicAdd(address, x);
  atomicAdd(address + 1, y);
#endif
}

// The threads that share one row in flash_backward_prepare_kernel: the most, up to 32, that
// split both its O / dO row of value_dim / 8 chunks of 16 bytes and its dQ row of head_dim / 8
// chunks of 8 floats evenly (a power of two, so a warp holds whole rows).
constexpr int prepare_row_lanes(int head_dim, int value_dim) {
  int lanes = 32;
  while ((value_dim / 8) % lanes != 0 || (head_dim / 8) % lanes != 0) lanes /= 2;
  return lanes;
}

// delta[b, h, i] = sum_d dO * O in fp32, and dQ = 0 where p.dq is set: prepare_row_lanes threads a
// row, each reading kChunks chunks of 8 elements of O and of dO in 16-byte accesses (check_layout:
// unit stride along head_dim, other strides multiples of 8, 16-byte aligned data), so a warp
// covers 2 (head_dim 128, 256), 4 (64, 192, 192/128) or 8 (32, 96) rows. blockIdx.y is the head,
// blockIdx.z the batch: a row's address takes no division. A thread zeroes kDqChunks chunks of 8
// dQ columns (dQ's rows have even strides: float2 stores), those of its O chunks where dQ is as
// wide as O; chunk j of lane `part` is chunk part + j * lanes of the row, so that each access of
// the row's threads covers a contiguous stretch. O and dO have kValueDim columns, dQ kHeadDim.
// delta's sum takes the same order whatever dQ's width: that of the kernel of kValueDim alone
// (kSumLanes threads a row, a butterfly over them), each thread here summing the chunks of the
// kSumLanes / kLanes threads it stands for apart and adding them as the butterfly would, so that
// the prepare with and without dQ (192/128 and 128/128) give the same bits.
template <typename T, int kHeadDim, int kValueDim = kHeadDim>
__global__ void flash_backward_prepare_kernel(const FlashParams p) {
  constexpr int kLanes = prepare_row_lanes(kHeadDim, kValueDim);
  constexpr int kChunks = kValueDim / 8 / kLanes;
  constexpr int kDqChunks = kHeadDim / 8 / kLanes;
  static_assert(kLanes * kChunks * 8 == kValueDim && kLanes * kDqChunks * 8 == kHeadDim,
                "a row's chunks split evenly over its threads");
  constexpr int kSumLanes = prepare_row_lanes(kValueDim, kValueDim);
  constexpr int kStandsFor = kSumLanes / kLanes;  // threads of the kValueDim kernel
  static_assert(kStandsFor * kLanes == kSumLanes && kChunks % kStandsFor == 0,
                "a thread stands for whole threads of the value width's kernel");
  float sums[kStandsFor] = {};
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row = static_cast<int>(blockIdx.x * (blockDim.x / kLanes) + threadIdx.x / kLanes);
  const int part = static_cast<int>(threadIdx.x % kLanes);
  if (row < p.q_len) {  // no early return: every lane of the warp takes part in the shuffles
    const T* o = static_cast<const T*>(p.o) + batch * p.o_strides[0] + row * p.o_strides[1] +
                 head * p.o_strides[2];
    const T* g = static_cast<const T*>(p.dout) + batch * p.dout_strides[0] +
                 row * p.dout_strides[1] + head * p.dout_strides[2];
    float* dq = p.dq == nullptr ? nullptr
                                : p.dq + batch * p.dq_strides[0] + row * p.dq_strides[1] +
                                      head * p.dq_strides[2];
    constexpr int kRowChunks = kChunks > kDqChunks ? kChunks : kDqChunks;
#pragma unroll
    for (int j = 0; j < kRowChunks; ++j) {
      const int column = (part + j * kLanes) * 8;
      uint4 o_raw{}, g_raw{};
      if (has_step<kChunks, kRowChunks>(j)) {
        o_raw = *reinterpret_cast<const uint4*>(o + column);
        g_raw = *reinterpret_cast<const uint4*>(g + column);
      }
      if (dq != nullptr && has_step<kDqChunks, kRowChunks>(j)) {
#pragma unroll
        for (int x = 0; x < 8; x += 2) {
          *reinterpret_cast<float2*>(dq + column + x) = make_float2(0.f, 0.f);
        }
      }
      if (has_step<kChunks, kRowChunks>(j)) {
        const T* o8 = reinterpret_cast<const T*>(&o_raw);
        const T* g8 = reinterpret_cast<const T*>(&g_raw);
        float& sum = sums[j % kStandsFor];  // chunk j is chunk j / kStandsFor of that thread
#pragma unroll
        for (int x = 0; x < 8; ++x) sum += to_float(o8[x]) * to_float(g8[x]);
      }
    }
  }
  // The butterfly's offsets of kLanes and above, within the thread: the lower partner first.
#pragma unroll
  for (int offset = kStandsFor / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int m = 0; m < offset; ++m) sums[m] = sums[m] + sums[m + offset];
  }
  float sum = sums[0];
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  if (row < p.q_len && part == 0) {
    p.delta[batch * p.delta_strides[0] + head * p.delta_strides[1] + row * p.delta_strides[2]] =
        sum;
  }
}

// The stored statistics of query row `row` of one head, as read: LSE (-inf for a row past q_len)
// and delta (0 there). Nothing uses the values here, so a load issued early does not wait.
__device__ __forceinline__ void load_row_statistics(const FlashParams& p, int batch, int head,
                                                    int row, float& lse, float& delta) {
  lse = -kInfinity;
  delta = 0.f;
  if (row < p.q_len) {
    lse = p.lse[batch * p.lse_strides[0] + head * p.lse_strides[1] + row * p.lse_strides[2]];
    delta = p.delta[batch * p.delta_strides[0] + head * p.delta_strides[1] + row * p.delta_strides[2]];
  }
}

// LSE in log2 units. A row that sees no key (LSE = -inf), or no row at all, gets +inf:
// exp2(s - inf) = 0.
__device__ __forceinline__ float lse_in_log2(float lse) {
  return lse == -kInfinity ? kInfinity : lse * kLog2e;
}

// The statistics of query row `row` of one head: LSE in log2 units and delta.
__device__ __forceinline__ void row_statistics(const FlashParams& p, int batch, int head, int row,
                                               float& lse_log2, float& delta) {
  load_row_statistics(p, batch, head, row, lse_log2, delta);
  lse_log2 = lse_in_log2(lse_log2);
}

// Stages the statistics of query rows [row_first, row_first + kRows) of one head in shared memory.
template <int kRows, int kThreads>
__device__ __forceinline__ void stage_row_statistics(const FlashParams& p, int batch, int head,
                                                     int row_first, float* lse_log2,
                                                     float* delta) {
  for (int r = threadIdx.x; r < kRows; r += kThreads) {
    row_statistics(p, batch, head, row_first + r, lse_log2[r], delta[r]);
  }
}

// A thread's values of the query rows its S^T and dP^T fragments cover, rows
// nt * 8 + quad_col + {0, 1} of a tile, in registers: read from shared memory before the MMAs
// whose results they meet are waited for, so that their latency hides behind the MMAs.
template <int kRowTiles>
struct FragmentRows {
  float v[kRowTiles][2];

  // From a tile's per-row array (8-byte aligned) in shared memory.
  __device__ __forceinline__ void load(const float* rows, int quad_col) {
#pragma unroll
    for (int nt = 0; nt < kRowTiles; ++nt) {
      const float2 pair = *reinterpret_cast<const float2*>(rows + nt * 8 + quad_col);
      v[nt][0] = pair.x;
      v[nt][1] = pair.y;
    }
  }
};

// Under a local mask, the local rows [first, last) that see each of a thread's two keys, written to
// the thread's own two entries of shared memory once a CTA, for probabilities: held in registers
// across the step loop they cost the consumers spills, and found at each masked step they cost two
// binary searches over the document starts.
__device__ __forceinline__ void key_rows_of(const FlashParams& p, int batch, const int (&keys)[2],
                                            int2* key_rows) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const detail::LocalRange rows = local_key_rows(p, batch, keys[half]);
    key_rows[half] = make_int2(static_cast<int>(rows.first), static_cast<int>(rows.last));
  }
}

// P^T in place of S^T for a thread's two keys (keys[0] for elements 0-1, keys[1] for 2-3) and the
// tile's rows row_first + nt * 8 + quad_col + {0, 1}; `masked` (uniform over the warp): some
// (key, row) pair of the tile may be hidden. The mask is a separate pass behind one branch, so that
// the exponentials of an unmasked tile carry no per-element tests. Under a local mask the keys'
// rows come from `key_rows` (the thread's own two entries, key_rows_of) where given, else from a
// binary search over the document starts each.
template <bool kCausal, int kRowTiles>
__device__ __forceinline__ void probabilities(float (&s)[kRowTiles][4], const int (&keys)[2],
                                              int row_first, int quad_col, bool masked,
                                              const FragmentRows<kRowTiles>& lse_log2,
                                              const FlashParams& p, int batch,
                                              const int2* key_rows = nullptr) {
#pragma unroll
  for (int nt = 0; nt < kRowTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = fast_exp2(s[nt][e] * p.scale_log2 - lse_log2.v[nt][e & 1]);
    }
  }
  if (!masked) return;
  if (kCausal && p.local) {
    // Tile row r sees the key iff first <= r < last (the key's rows under the local mask).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const detail::LocalRange rows =
          key_rows != nullptr ? detail::LocalRange{key_rows[half].x, key_rows[half].y}
                              : local_key_rows(p, batch, keys[half]);
      const bool past_end = keys[half] >= p.k_len;
      const int first = past_end ? 0 : static_cast<int>(rows.first) - row_first - quad_col;
      const int last = past_end ? 0 : static_cast<int>(rows.last) - row_first - quad_col;
#pragma unroll
      for (int nt = 0; nt < kRowTiles; ++nt) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const int r = nt * 8 + (e & 1);
          if (r < first || r >= last) s[nt][e] = 0.f;
        }
      }
    }
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // Tile row r sees the key iff r >= first_visible: key < k_len and, causal,
    // key <= row_first + r + shift.
    int first_visible = 0;
    if (keys[half] >= p.k_len) {
      first_visible = kRowTiles * 8;
    } else if (kCausal) {
      const std::int64_t first = static_cast<std::int64_t>(keys[half]) - row_first - p.shift;
      first_visible = static_cast<int>(
          first < 0 ? 0 : (first > kRowTiles * 8 ? kRowTiles * 8 : first));
    }
    first_visible -= quad_col;  // compared with nt * 8 + (e & 1) below
#pragma unroll
    for (int nt = 0; nt < kRowTiles; ++nt) {
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        if (nt * 8 + (e & 1) < first_visible) s[nt][e] = 0.f;
      }
    }
  }
}

// dS^T = P^T (dP^T - delta) in place of dP^T, the same elements as probabilities'.
template <int kRowTiles>
__device__ __forceinline__ void ds_from_probabilities(float (&dp)[kRowTiles][4],
                                                      const float (&prob)[kRowTiles][4],
                                                      const FragmentRows<kRowTiles>& delta) {
#pragma unroll
  for (int nt = 0; nt < kRowTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dp[nt][e] = prob[nt][e] * (dp[nt][e] - delta.v[nt][e & 1]);
    }
  }
}

// Both at once: P^T in place of S^T, dS^T in place of dP^T.
template <bool kCausal, int kRowTiles>
__device__ __forceinline__ void probabilities_and_ds(float (&s)[kRowTiles][4],
                                                     float (&dp)[kRowTiles][4],
                                                     const int (&keys)[2], int row_first,
                                                     int quad_col, bool masked,
                                                     const float* lse_log2, const float* delta,
                                                     const FlashParams& p, int batch) {
  FragmentRows<kRowTiles> rows;
  rows.load(lse_log2, quad_col);
  probabilities<kCausal>(s, keys, row_first, quad_col, masked, rows, p, batch);
  rows.load(delta, quad_col);
  ds_from_probabilities(dp, s, rows);
}

// dQ[row, d0 + 8 dt + quad_col + {0, 1}] += scale * acc for a thread's two rows (row0, row0 + 8).
template <int kTiles>
__device__ __forceinline__ void add_dq_atomic(const FlashParams& p, int batch, int head, int row0,
                                              int d0, int quad_col, const float (&acc)[kTiles][4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + 8 * half;
    if (row >= p.q_len) continue;
    float* out = p.dq + batch * p.dq_strides[0] + row * p.dq_strides[1] + head * p.dq_strides[2];
#pragma unroll
    for (int dt = 0; dt < kTiles; ++dt) {
      add_pair_atomic(out + d0 + dt * 8 + quad_col, acc[dt][2 * half] * p.scale,
                      acc[dt][2 * half + 1] * p.scale);
    }
  }
}

// The n-tile (8 columns) of dK / dV that a warp's local tile j holds, of a gradient kWidth columns
// wide (d_qk for dK, d_v for dV). With one warp to a key (kParts 1) it is j. With two (kParts 2,
// d_qk + d_v above 256), part `part` holds the n-tiles [part q, part q + q) of each half of the
// columns, q = kWidth / 32: local tile j and j + q then hold columns i and i + kWidth / 2, the pair
// that RoPE rotates together.
template <int kWidth, int kParts>
__device__ __forceinline__ int key_gradient_tile(int j, int part) {
  if constexpr (kParts == 1) {
    return j;
  } else {
    static_assert(kParts == 2, "dK and dV split over one or two warps");
    constexpr int kQuarter = kWidth / 32;
    return j < kQuarter ? part * kQuarter + j : kWidth / 16 + part * kQuarter + (j - kQuarter);
  }
}

// A thread's dK of one key (row `key`, element pair jj of local n-tile j, column
// 8 key_gradient_tile(j) + quad_col + jj) times the softmax scale: as the block computed it, or
// with the keys' RoPE undone (p.key_cos). Column i pairs with i + kHeadDim / 2, local n-tile j with
// j + kTiles / 2: both in this thread.
template <int kHeadDim, int kParts, int kTiles>
__device__ __forceinline__ void scaled_key_gradient(const FlashParams& p, int key, int half,
                                                    int quad_col, int part,
                                                    const float (&dk)[kTiles][4],
                                                    float (&out)[kTiles][2]) {
#pragma unroll
  for (int dt = 0; dt < kTiles; ++dt) {
    out[dt][0] = dk[dt][2 * half] * p.scale;
    out[dt][1] = dk[dt][2 * half + 1] * p.scale;
  }
  if (p.key_cos == nullptr) return;
  constexpr int kPairTiles = kTiles / 2;
  const float* cos_row = p.key_cos + key * p.key_cos_stride;
  const float* sin_row = p.key_sin + key * p.key_sin_stride;
#pragma unroll
  for (int dt = 0; dt < kPairTiles; ++dt) {
    const int column = key_gradient_tile<kHeadDim, kParts>(dt, part) * 8 + quad_col;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float c = cos_row[column + j], s = sin_row[column + j];
      const float x = out[dt][j], y = out[dt + kPairTiles][j];
      out[dt][j] = x * c + y * s;
      out[dt + kPairTiles][j] = y * c - x * s;
    }
  }
}

// dK and dV of a thread's two keys belong to its CTA alone: added into the fp32 buffers without
// atomics (dK scaled by the softmax scale, its RoPE undone where asked), or written: fp32, or
// rounded to T. kParts / part: which columns the arrays hold (key_gradient_tile); dK has kHeadDim
// columns, dV kValueDim. The loops run over the wider and skip the narrower's missing tiles.
// kWithKey / kWithValue: which of the two this thread holds (a warpgroup of the wide Hopper
// kernel holds one); the other array is then never read.
template <typename T, int kHeadDim, int kValueDim = kHeadDim, int kParts = 1,
          int kKeyTiles = kHeadDim / 8 / kParts, int kValueTiles = kValueDim / 8 / kParts,
          bool kWithKey = true, bool kWithValue = true>
__device__ __forceinline__ void add_key_gradients(const FlashParams& p, int batch, int kv_head,
                                                  const int (&keys)[2], int quad_col,
                                                  const float (&dk)[kKeyTiles][4],
                                                  const float (&dv)[kValueTiles][4],
                                                  bool shared_keys = false, int part = 0) {
  constexpr int kTiles = kKeyTiles > kValueTiles ? kKeyTiles : kValueTiles;
  int columns_k[kKeyTiles], columns_v[kValueTiles];
#pragma unroll
  for (int dt = 0; dt < kKeyTiles; ++dt) {
    columns_k[dt] = key_gradient_tile<kHeadDim, kParts>(dt, part) * 8 + quad_col;
  }
#pragma unroll
  for (int dt = 0; dt < kValueTiles; ++dt) {
    columns_v[dt] = key_gradient_tile<kValueDim, kParts>(dt, part) * 8 + quad_col;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = keys[half];
    if (key >= p.k_len) continue;
    float k[kKeyTiles][2];
    if constexpr (kWithKey) {
      scaled_key_gradient<kHeadDim, kParts>(p, key, half, quad_col, part, dk, k);
    }
    const std::int64_t at_k =
        batch * p.dk_strides[0] + key * p.dk_strides[1] + kv_head * p.dk_strides[2];
    const std::int64_t at_v =
        batch * p.dv_strides[0] + key * p.dv_strides[1] + kv_head * p.dv_strides[2];
    if (p.round_key_gradients) {
      T* out_k = static_cast<T*>(p.dk) + at_k;
      T* out_v = static_cast<T*>(p.dv) + at_v;
#pragma unroll
      for (int dt = 0; dt < kTiles; ++dt) {
        if (kWithKey && has_step<kKeyTiles, kTiles>(dt)) {
          *reinterpret_cast<std::uint32_t*>(out_k + columns_k[dt]) = pack2<T>(k[dt][0], k[dt][1]);
        }
        if (kWithValue && has_step<kValueTiles, kTiles>(dt)) {
          *reinterpret_cast<std::uint32_t*>(out_v + columns_v[dt]) =
              pack2<T>(dv[dt][2 * half], dv[dt][2 * half + 1]);
        }
      }
      continue;
    }
    float* out_k = static_cast<float*>(p.dk) + at_k;
    float* out_v = static_cast<float*>(p.dv) + at_v;
    if (p.overwrite_key_gradients && !shared_keys) {
#pragma unroll
      for (int dt = 0; dt < kTiles; ++dt) {
        if (kWithKey && has_step<kKeyTiles, kTiles>(dt)) {
          *reinterpret_cast<float2*>(out_k + columns_k[dt]) = make_float2(k[dt][0], k[dt][1]);
        }
        if (kWithValue && has_step<kValueTiles, kTiles>(dt)) {
          *reinterpret_cast<float2*>(out_v + columns_v[dt]) =
              make_float2(dv[dt][2 * half], dv[dt][2 * half + 1]);
        }
      }
      continue;
    }
    if (shared_keys) {  // other CTAs add into the same keys
#pragma unroll
      for (int dt = 0; dt < kTiles; ++dt) {
        if (kWithKey && has_step<kKeyTiles, kTiles>(dt)) {
          add_pair_atomic(out_k + columns_k[dt], k[dt][0], k[dt][1]);
        }
        if (kWithValue && has_step<kValueTiles, kTiles>(dt)) {
          add_pair_atomic(out_v + columns_v[dt], dv[dt][2 * half], dv[dt][2 * half + 1]);
        }
      }
      continue;
    }
#pragma unroll
    for (int dt = 0; dt < kTiles; ++dt) {
      const bool has_k = kWithKey && has_step<kKeyTiles, kTiles>(dt);
      const bool has_v = kWithValue && has_step<kValueTiles, kTiles>(dt);
      float2* gk = reinterpret_cast<float2*>(out_k + columns_k[has_k ? dt : 0]);
      float2* gv = reinterpret_cast<float2*>(out_v + columns_v[has_v ? dt : 0]);
      float2 vk{}, vv{};
      if (has_k) vk = *gk;
      if (has_v) vv = *gv;
      if (has_k) {
        vk.x += k[dt][0];
        vk.y += k[dt][1];
      }
      if (has_v) {
        vv.x += dv[dt][2 * half];
        vv.y += dv[dt][2 * half + 1];
      }
      if (has_k) *gk = vk;
      if (has_v) *gv = vv;
    }
  }
}

// The column bands of dQ's rows that the warps of one 16-row tile split among them: the most, up
// to `warps`, whose width is a multiple of 16 (the extra warps, if any, have no band).
constexpr int dq_bands(int head_dim, int warps) {
  int bands = warps;
  while (bands > 1 && head_dim % (16 * bands) != 0) --bands;
  return bands;
}

template <int kHeadDim, int kValueDim = kHeadDim>
struct BackwardTiles {
  // 8 warps (128 keys) share each Q / dO row tile and its dQ atomics: 2-19% faster on an H200
  // than 4 warps (64 keys), most at head_dim 64, with the same 8 warps an SM.
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // Above 128 + 128 columns one warp's dK and dV accumulators of 16 keys would not fit in
  // registers: two warps share the 16 keys, each computes their S^T and dP^T in full and
  // accumulates dK and dV for half of the columns (key_gradient_tile). 192/128 takes 192/192's
  // split, 48 + 32 accumulator registers a warp (one warp's 96 + 64 spilled 8-28 bytes a thread
  // at 255 registers for sm_80).
  static constexpr int kParts = kHeadDim + kValueDim <= 256 ? 1 : 2;
  static constexpr int kKeyWarps = kWarps / kParts;
  static constexpr int kKeys = 16 * kKeyWarps;
  static constexpr int kKeyTiles = kHeadDim / 8 / kParts;     // n-tiles of dK a warp holds
  static constexpr int kValueTiles = kValueDim / 8 / kParts;  // n-tiles of dV a warp holds
  // Rows per tile: 64 up to head_dim 64; 32 above, which keeps S^T and dP^T at 16 registers each
  // beside the 2 x 64 registers of the dK and dV accumulators (no spills at 128).
  static constexpr int kRows = kHeadDim <= 64 && kValueDim <= 64 ? 64 : 32;
  static constexpr int kDsPitch = kRows + 8;  // padded rows of dS^T: 8 ldmatrix rows hit 32 banks
  // K and V, two stages of Q and dO, dS^T, two stages of LSE and delta.
  static constexpr int kSmemBytes = (kKeys + 2 * kRows) * (kHeadDim + kValueDim) * 2 +
                                    kKeys * kDsPitch * 2 + 4 * kRows * 4;
  static_assert(kSmemBytes <= kMaxDynamicSmemBytes, "the backward's tiles exceed shared memory");
};

template <typename T, int kHeadDim, int kValueDim, bool kCausal, bool kAtomicDq>
__global__ void __launch_bounds__(BackwardTiles<kHeadDim, kValueDim>::kThreads)
    flash_backward_kernel(const FlashParams p) {
  using Tiles = BackwardTiles<kHeadDim, kValueDim>;
  constexpr int kKeys = Tiles::kKeys, kRows = Tiles::kRows, kThreads = Tiles::kThreads;
  constexpr int kKeySteps = kHeadDim / 16;     // k-steps of S^T = K Q^T
  constexpr int kValueSteps = kValueDim / 16;  // k-steps of dP^T = V dO^T
  constexpr int kDimSteps = kKeySteps > kValueSteps ? kKeySteps : kValueSteps;
  constexpr int kRowTiles = kRows / 8;  // n-tiles of S^T

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* k_tile = reinterpret_cast<T*>(smem_raw);
  T* v_tile = k_tile + kKeys * kHeadDim;          // [kKeys * kValueDim]
  T* q_tiles = v_tile + kKeys * kValueDim;        // [2][kRows * kHeadDim]
  T* do_tiles = q_tiles + 2 * kRows * kHeadDim;   // [2][kRows * kValueDim]
  T* ds_tile = do_tiles + 2 * kRows * kValueDim;  // [kKeys][kDsPitch], dS^T
  float* lse_log2 = reinterpret_cast<float*>(ds_tile + kKeys * Tiles::kDsPitch);  // [2][kRows]
  float* delta = lse_log2 + 2 * kRows;                                             // [2][kRows]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  constexpr int kParts = Tiles::kParts;
  constexpr int kKeyTiles = Tiles::kKeyTiles, kValueTiles = Tiles::kValueTiles;
  // n-tile pairs of the wider of dK and dV
  constexpr int kGradientPairs = (kKeyTiles > kValueTiles ? kKeyTiles : kValueTiles) / 2;
  // This warp's 16 keys, and which part of their dK / dV columns it accumulates.
  const int key_warp = warp % Tiles::kKeyWarps, part = warp / Tiles::kKeyWarps;
  const int key0 = blockIdx.x * kKeys;
  const int kv_head = blockIdx.y, batch = blockIdx.z;
  const T* k = head_slice<T>(p.k, p.k_strides, batch, kv_head);
  const T* v = head_slice<T>(p.v, p.v_strides, batch, kv_head);

  // Row tiles [first_tile, end_tile) hold every row that sees some key of this CTA: causal
  // hides rows before key0 - shift; a local mask every row outside the first key's first row and
  // the last key's last.
  // Under a local mask, full_rows are the rows that see every key (tile_needs_mask).
  int first_tile = 0, end_tile = (p.q_len + kRows - 1) / kRows;
  IndexRange full_rows{0, 0};
  if (kCausal && p.local) {
    const detail::BlockReach reach = key_block_rows(p, batch, key0, kKeys);
    full_rows = index_range(reach.every);
    first_tile = static_cast<int>(reach.some.first) / kRows;
    end_tile = reach.some.empty() ? first_tile
                                  : static_cast<int>((reach.some.last + kRows - 1) / kRows);
  } else if (kCausal) {
    first_tile = clamp_to(key0 - p.shift, 0, p.q_len) / kRows;
  }
  const int row_tiles = end_tile - first_tile;
  const int steps = row_tiles > 0 ? row_tiles * p.group : 0;

  // Step i covers query head kv_head * group + i / row_tiles, row tile first_tile + i % row_tiles.
  auto issue_step = [&](int step, int stage) {
    const int head = kv_head * p.group + step / row_tiles;
    const int row_first = (first_tile + step % row_tiles) * kRows;
    const T* q = head_slice<T>(p.q, p.q_strides, batch, head);
    const T* g = head_slice<T>(p.dout, p.dout_strides, batch, head);
    load_tile_async<kRows, kHeadDim, kThreads>(q_tiles + stage * kRows * kHeadDim, q,
                                               p.q_strides[1], row_first, p.q_len);
    load_tile_async<kRows, kValueDim, kThreads>(do_tiles + stage * kRows * kValueDim, g,
                                                p.dout_strides[1], row_first, p.q_len);
    stage_row_statistics<kRows, kThreads>(p, batch, head, row_first, lse_log2 + stage * kRows,
                                          delta + stage * kRows);
  };

  const int key_limit = min(p.k_len, key0 + kKeys);
  load_tile_async<kKeys, kHeadDim, kThreads>(k_tile, k, p.k_strides[1], key0, key_limit);
  load_tile_async<kKeys, kValueDim, kThreads>(v_tile, v, p.v_strides[1], key0, key_limit);
  if (steps > 0) issue_step(0, 0);
  cp_async_commit();

  float dk[kKeyTiles][4] = {};
  float dv[kValueTiles][4] = {};
  const int my_keys[2] = {key0 + key_warp * 16 + group_row, key0 + key_warp * 16 + group_row + 8};

  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    [[maybe_unused]] const int head = kv_head * p.group + step / row_tiles;
    const int row_first = (first_tile + step % row_tiles) * kRows;
    cp_async_wait<0>();
    __syncthreads();
    if (step + 1 < steps) issue_step(step + 1, stage ^ 1);
    cp_async_commit();
    const T* q_tile = q_tiles + stage * kRows * kHeadDim;
    const T* do_tile = do_tiles + stage * kRows * kValueDim;
    const float* lse_s = lse_log2 + stage * kRows;
    const float* delta_s = delta + stage * kRows;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and the tile's rows.
    float s[kRowTiles][4] = {};
    float dp[kRowTiles][4] = {};
#pragma unroll
    for (int dstep = 0; dstep < kDimSteps; ++dstep) {
      std::uint32_t a_k[4], a_v[4];
      const int key = key_warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
      const int col = dstep * 16 + (lane / 16) * 8;
      if (has_step<kKeySteps, kDimSteps>(dstep)) {
        ldmatrix_x4(a_k, k_tile + swizzled<kHeadDim>(key, col));
      }
      if (has_step<kValueSteps, kDimSteps>(dstep)) {
        ldmatrix_x4(a_v, v_tile + swizzled<kValueDim>(key, col));
      }
#pragma unroll
      for (int pair = 0; pair < kRowTiles / 2; ++pair) {
        std::uint32_t b[4];
        const int row = pair * 16 + (lane % 8) + (lane / 16) * 8;
        const int bcol = dstep * 16 + ((lane / 8) % 2) * 8;
        if (has_step<kKeySteps, kDimSteps>(dstep)) {
          ldmatrix_x4(b, q_tile + swizzled<kHeadDim>(row, bcol));
          mma_16816<T>(s[2 * pair], a_k, b[0], b[1]);
          mma_16816<T>(s[2 * pair + 1], a_k, b[2], b[3]);
        }
        if (has_step<kValueSteps, kDimSteps>(dstep)) {
          ldmatrix_x4(b, do_tile + swizzled<kValueDim>(row, bcol));
          mma_16816<T>(dp[2 * pair], a_v, b[0], b[1]);
          mma_16816<T>(dp[2 * pair + 1], a_v, b[2], b[3]);
        }
      }
    }

    // P^T = exp2(S^T * scale * log2e - LSE * log2e), zero where hidden; dS^T = P^T (dP^T - delta).
    const bool masked =
        tile_needs_mask<kCausal, false>(p, full_rows, row_first, kRows, key0, kKeys);
    probabilities_and_ds<kCausal>(s, dp, my_keys, row_first, quad_col, masked, lse_s, delta_s, p,
                                  batch);

    // dV += P^T dO and dK += dS^T Q: the row index is the reduction axis.
#pragma unroll
    for (int kstep = 0; kstep < kRows / 16; ++kstep) {
      std::uint32_t a_p[4], a_ds[4];
      probability_fragment<T>(a_p, s, kstep);
      probability_fragment<T>(a_ds, dp, kstep);
      if (kAtomicDq && part == 0) {
        // Stage dS^T (the rounded values the MMAs use) for the dQ product below; the warps that
        // share these keys computed the same values.
        T* ds_row0 =
            ds_tile + (key_warp * 16 + group_row) * Tiles::kDsPitch + kstep * 16 + quad_col;
        T* ds_row8 = ds_row0 + 8 * Tiles::kDsPitch;
        *reinterpret_cast<std::uint32_t*>(ds_row0) = a_ds[0];
        *reinterpret_cast<std::uint32_t*>(ds_row8) = a_ds[1];
        *reinterpret_cast<std::uint32_t*>(ds_row0 + 8) = a_ds[2];
        *reinterpret_cast<std::uint32_t*>(ds_row8 + 8) = a_ds[3];
      }
#pragma unroll
      for (int pair = 0; pair < kGradientPairs; ++pair) {
        std::uint32_t b[4];
        const int row = kstep * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        if (has_step<kValueTiles / 2, kGradientPairs>(pair)) {
          const int col =
              key_gradient_tile<kValueDim, kParts>(2 * pair, part) * 8 + (lane / 16) * 8;
          ldmatrix_x4_trans(b, do_tile + swizzled<kValueDim>(row, col));
          mma_16816<T>(dv[2 * pair], a_p, b[0], b[1]);
          mma_16816<T>(dv[2 * pair + 1], a_p, b[2], b[3]);
        }
        if (has_step<kKeyTiles / 2, kGradientPairs>(pair)) {
          const int col =
              key_gradient_tile<kHeadDim, kParts>(2 * pair, part) * 8 + (lane / 16) * 8;
          ldmatrix_x4_trans(b, q_tile + swizzled<kHeadDim>(row, col));
          mma_16816<T>(dk[2 * pair], a_ds, b[0], b[1]);
          mma_16816<T>(dk[2 * pair + 1], a_ds, b[2], b[3]);
        }
      }
    }

    if constexpr (kAtomicDq) {
      // dQ (kRows x head_dim) += scale * dS K: the warps split it into 16-row, column-band tiles.
      constexpr int kWarpsPerRowTile = Tiles::kWarps / (kRows / 16);
      constexpr int kBands = dq_bands(kHeadDim, kWarpsPerRowTile);
      constexpr int kBandDims = kHeadDim / kBands;
      __syncthreads();
      const int band = warp % kWarpsPerRowTile;
      if (band >= kBands) continue;  // no band for this warp (head_dim 96: 3 of 4 have one)
      const int m0 = (warp / kWarpsPerRowTile) * 16;
      const int d0 = band * kBandDims;
      float dq[kBandDims / 8][4] = {};
#pragma unroll
      for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
        std::uint32_t a[4];
        const int key = kstep * 16 + (lane % 8) + (lane / 16) * 8;
        ldmatrix_x4_trans(a, ds_tile + key * Tiles::kDsPitch + m0 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int pair = 0; pair < kBandDims / 16; ++pair) {
          std::uint32_t b[4];
          const int krow = kstep * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          ldmatrix_x4_trans(b, k_tile + swizzled<kHeadDim>(krow, d0 + pair * 16 + (lane / 16) * 8));
          mma_16816<T>(dq[2 * pair], a, b[0], b[1]);
          mma_16816<T>(dq[2 * pair + 1], a, b[2], b[3]);
        }
      }
      add_dq_atomic(p, batch, head, row_first + m0 + group_row, d0, quad_col, dq);
    }
  }

  add_key_gradients<T, kHeadDim, kValueDim, kParts>(p, batch, kv_head, my_keys, quad_col, dk, dv,
                                                     false, part);
}

// Deterministic dQ: one CTA per 64 query rows of one (batch, head), keys visited in order.
// Each warp holds 16 rows' fp32 dQ in registers, and up to head_dim 128 their Q and dO fragments
// too; above, the fragments are re-read from shared memory for each key tile and the tiles hold
// 32 keys, so that dQ's 96-128 registers fit beside the scores. dQ is kHeadDim wide, so 192/128
// takes 192/192's tiles.
template <int kHeadDim, int kValueDim = kHeadDim>
struct DqTiles {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 16 * kWarps;
  static constexpr bool kFragmentsInRegisters = kHeadDim <= 128 && kValueDim <= 128;
  static constexpr int kKeys = kFragmentsInRegisters ? 64 : 32;
  // Q and dO, then two stages of K and V.
  static constexpr int kSmemBytes = (kRows + 2 * kKeys) * (kHeadDim + kValueDim) * 2;
  static_assert(kSmemBytes <= kMaxDynamicSmemBytes, "the dQ kernel's tiles exceed shared memory");
};

template <typename T, int kHeadDim, int kValueDim, bool kCausal>
__global__ void __launch_bounds__(DqTiles<kHeadDim, kValueDim>::kThreads)
    flash_dq_kernel(const FlashParams p) {
  using Tiles = DqTiles<kHeadDim, kValueDim>;
  constexpr int kRows = Tiles::kRows, kKeys = Tiles::kKeys;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kKeySteps = kHeadDim / 16;     // k-steps of S = Q K^T, n-tile pairs of dS K
  constexpr int kValueSteps = kValueDim / 16;  // k-steps of dP = dO V^T
  constexpr int kDimSteps = kKeySteps > kValueSteps ? kKeySteps : kValueSteps;
  constexpr int kKeyTiles = kKeys / 8;
  constexpr bool kInRegisters = Tiles::kFragmentsInRegisters;
  constexpr float kNegInf = -kInfinity;
  constexpr float kPosInf = kInfinity;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  T* do_tile = q_tile + kRows * kHeadDim;    // [kRows * kValueDim]
  T* k_tiles = do_tile + kRows * kValueDim;  // [2][kKeys * kHeadDim]
  T* v_tiles = k_tiles + 2 * kKeys * kHeadDim;  // [2][kKeys * kValueDim]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad_col = 2 * (lane % 4);
  const int row0 = blockIdx.x * kRows;
  const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / p.group;
  const T* q = head_slice<T>(p.q, p.q_strides, batch, head);
  const T* g = head_slice<T>(p.dout, p.dout_strides, batch, head);
  const T* k = head_slice<T>(p.k, p.k_strides, batch, kv_head);
  const T* v = head_slice<T>(p.v, p.v_strides, batch, kv_head);

  const detail::BlockReach reach = row_block_keys<kCausal>(p, batch, row0, kRows);
  const detail::LocalRange& visible = reach.some;
  const IndexRange full_keys = index_range(reach.every);
  if (visible.empty()) return;
  const int key_end = static_cast<int>(visible.last);
  const int first_tile = static_cast<int>(visible.first) / kKeys;
  const int key_tiles = (key_end + kKeys - 1) / kKeys;

  load_tile_async<kRows, kHeadDim, kThreads>(q_tile, q, p.q_strides[1], row0, p.q_len);
  load_tile_async<kRows, kValueDim, kThreads>(do_tile, g, p.dout_strides[1], row0, p.q_len);
  load_tile_async<kKeys, kHeadDim, kThreads>(k_tiles, k, p.k_strides[1], first_tile * kKeys,
                                             key_end);
  load_tile_async<kKeys, kValueDim, kThreads>(v_tiles, v, p.v_strides[1], first_tile * kKeys,
                                              key_end);
  cp_async_commit();

  const int my_rows[2] = {row0 + warp * 16 + group_row, row0 + warp * 16 + group_row + 8};
  float lse_l2[2], delta_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = my_rows[r];
    float l = kNegInf, d = 0.f;
    if (row < p.q_len) {
      l = p.lse[batch * p.lse_strides[0] + head * p.lse_strides[1] + row * p.lse_strides[2]];
      d = p.delta[batch * p.delta_strides[0] + head * p.delta_strides[1] + row * p.delta_strides[2]];
    }
    lse_l2[r] = l == kNegInf ? kPosInf : l * kLog2e;
    delta_r[r] = d;
  }

  cp_async_wait<0>();
  __syncthreads();
  // A fragments of this warp's 16 rows of Q and dO for k-step `step` (of Q where
  // step < kKeySteps, of dO where step < kValueSteps).
  auto load_row_fragments = [&](int step, std::uint32_t (&qf)[4], std::uint32_t (&gf)[4]) {
    const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int c = step * 16 + (lane / 16) * 8;
    if (has_step<kKeySteps, kDimSteps>(step)) ldmatrix_x4(qf, q_tile + swizzled<kHeadDim>(r, c));
    if (has_step<kValueSteps, kDimSteps>(step)) {
      ldmatrix_x4(gf, do_tile + swizzled<kValueDim>(r, c));
    }
  };
  constexpr int kHeld = kInRegisters ? kDimSteps : 1;
  std::uint32_t q_frag[kHeld][4], g_frag[kHeld][4];
  if constexpr (kInRegisters) {
#pragma unroll
    for (int step = 0; step < kDimSteps; ++step) load_row_fragments(step, q_frag[step], g_frag[step]);
  }
  float dq[kHeadDim / 8][4] = {};

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

    float s[kKeyTiles][4] = {};
    float dp[kKeyTiles][4] = {};
#pragma unroll
    for (int step = 0; step < kDimSteps; ++step) {
      const int held = kInRegisters ? step : 0;
      if constexpr (!kInRegisters) load_row_fragments(step, q_frag[0], g_frag[0]);
#pragma unroll
      for (int pair = 0; pair < kKeyTiles / 2; ++pair) {
        std::uint32_t b[4];
        const int key = pair * 16 + (lane % 8) + (lane / 16) * 8;
        const int col = step * 16 + ((lane / 8) % 2) * 8;
        if (has_step<kKeySteps, kDimSteps>(step)) {
          ldmatrix_x4(b, k_tile + swizzled<kHeadDim>(key, col));
          mma_16816<T>(s[2 * pair], q_frag[held], b[0], b[1]);
          mma_16816<T>(s[2 * pair + 1], q_frag[held], b[2], b[3]);
        }
        if (has_step<kValueSteps, kDimSteps>(step)) {
          ldmatrix_x4(b, v_tile + swizzled<kValueDim>(key, col));
          mma_16816<T>(dp[2 * pair], g_frag[held], b[0], b[1]);
          mma_16816<T>(dp[2 * pair + 1], g_frag[held], b[2], b[3]);
        }
      }
    }
    const int key0 = tile * kKeys;
    const bool masked = tile_needs_mask<kCausal, true>(p, full_keys, row0, kRows, key0, kKeys);
    // Each row's keys [lo, hi) where the tile needs the mask.
    int lo[2] = {0, 0}, hi[2] = {p.k_len, p.k_len};
    if (masked) {
      if (kCausal && p.local) {
        local_key_bounds(p, batch, my_rows, lo, hi);
      } else if (kCausal) {
#pragma unroll
        for (int r = 0; r < 2; ++r) hi[r] = clamp_to(my_rows[r] + p.shift + 1, 0, p.k_len);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nt * 8 + quad_col + (e & 1);
        float prob = fast_exp2(s[nt][e] * p.scale_log2 - lse_l2[e / 2]);
        if (masked && (key < lo[e / 2] || key >= hi[e / 2])) prob = 0.f;
        dp[nt][e] = prob * (dp[nt][e] - delta_r[e / 2]);
      }
    }
    // dQ += dS K, with dS as A fragments straight from registers.
#pragma unroll
    for (int kstep = 0; kstep < kKeys / 16; ++kstep) {
      const std::uint32_t a[4] = {pack2<T>(dp[2 * kstep][0], dp[2 * kstep][1]),
                                  pack2<T>(dp[2 * kstep][2], dp[2 * kstep][3]),
                                  pack2<T>(dp[2 * kstep + 1][0], dp[2 * kstep + 1][1]),
                                  pack2<T>(dp[2 * kstep + 1][2], dp[2 * kstep + 1][3])};
#pragma unroll
      for (int pair = 0; pair < kKeySteps; ++pair) {
        std::uint32_t b[4];
        const int key = kstep * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(b, k_tile + swizzled<kHeadDim>(key, pair * 16 + (lane / 16) * 8));
        mma_16816<T>(dq[2 * pair], a, b[0], b[1]);
        mma_16816<T>(dq[2 * pair + 1], a, b[2], b[3]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = my_rows[r];
    if (row >= p.q_len) continue;
    float* out = p.dq + batch * p.dq_strides[0] + row * p.dq_strides[1] + head * p.dq_strides[2];
#pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt) {
      float2* slot = reinterpret_cast<float2*>(out + dt * 8 + quad_col);
      float2 value = *slot;
      value.x += dq[dt][2 * r] * p.scale;
      value.y += dq[dt][2 * r + 1] * p.scale;
      *slot = value;
    }
  }
}


}  // namespace ringattn::cuda_detail
