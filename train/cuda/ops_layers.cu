// The layer ops of train/cuda/ops.hpp: conversions, residual add, embedding, RMSNorm, RoPE and
// SwiGLU. All are memory-bound; every kernel reads bf16, computes in fp32 and rounds its bf16
// outputs once, to nearest even.
//
// Parallelisation:
//   elementwise (conversions, residual add, SwiGLU, embedding gather): grid-stride loops over
//     groups of V consecutive elements, V chosen on the host so that a group is one 16-byte
//     (or 8-byte) access when the pointers and sizes allow it, else V = 1;
//   RMSNorm forward and dx: one warp per row, two passes over the row (the second hits L1/L2);
//   RMSNorm dg: blocks own a 64-column tile and a fixed range of rows (the ranges depend only on
//     the shape), write per-range partial sums, and one thread per column adds the partials in
//     range order: no atomics, bitwise reproducible;
//   RMSNorm backward at dim 256, 512, 768 or 1024 (16-byte aligned rows): dx and dg's partials in
//     one kernel, blocks owning the same row ranges, each warp holding a row of x and dy in
//     registers: x and dy are read once instead of three times;
//   RoPE: one thread per V (i, i + head_dim / 2) pairs of one (token, head); the backward from
//     fp32 gradients also converts the rest of each row (groups of V) in the same kernel;
//   embedding backward: fp32 atomics, or one thread per column walking the tokens in order.
//
// The code keeps to C++17 (the .cu files of the library compile as C++17; the trainer's as
// C++20 only because its headers need it).
#include "train/cuda/ops.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ringattn/error.hpp"
#include "src/cuda/cuda_check.hpp"

namespace ringattn::train::cuda {
namespace {

// 256 threads a block (8 warps): full occupancy for kernels of a few dozen registers. Grids of
// the grid-stride kernels are capped; the loops stride over the rest.
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr std::int64_t kMaxBlocks = 65536;

// ---- host-side argument checks -------------------------------------------------------------

void check_pointer(std::string_view where, std::string_view name, const void* pointer) {
  if (pointer == nullptr) ringattn::detail::fail(where, name, " is null; expected device memory");
}

bool aligned(const void* pointer, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(pointer) % bytes == 0;
}

unsigned blocks_for(std::int64_t items, std::int64_t per_block = kThreads) {
  const std::int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::min(std::max<std::int64_t>(blocks, 1), kMaxBlocks));
}

// ---- device helpers --------------------------------------------------------------------------

__device__ __forceinline__ std::int64_t global_thread() {
  return blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
}

__device__ __forceinline__ std::int64_t grid_threads() {
  return std::int64_t{gridDim.x} * blockDim.x;
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned bits16) {
  return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ unsigned float_to_bf16_bits(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

// V consecutive bf16 as fp32 (exact), in one access of 2V bytes; p is 2V-byte aligned.
template <int V>
__device__ __forceinline__ void load_bf16(const bf16* p, float (&v)[V]) {
  static_assert(V == 1 || V == 2 || V == 4 || V == 8, "V is 1, 2, 4 or 8");
  if constexpr (V == 1) {
    v[0] = __bfloat162float(*p);
  } else {
    unsigned words[V / 2];
    if constexpr (V == 2) {
      words[0] = *reinterpret_cast<const unsigned*>(p);
    } else if constexpr (V == 4) {
      const uint2 raw = *reinterpret_cast<const uint2*>(p);
      words[0] = raw.x;
      words[1] = raw.y;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      words[0] = raw.x;
      words[1] = raw.y;
      words[2] = raw.z;
      words[3] = raw.w;
    }
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      v[2 * k] = bf16_bits_to_float(words[k] & 0xffffu);
      v[2 * k + 1] = bf16_bits_to_float(words[k] >> 16);
    }
  }
}

// V fp32 values rounded to bf16 (nearest even), stored in one access of 2V bytes.
template <int V>
__device__ __forceinline__ void store_bf16(bf16* p, const float (&v)[V]) {
  static_assert(V == 1 || V == 2 || V == 4 || V == 8, "V is 1, 2, 4 or 8");
  if constexpr (V == 1) {
    *p = __float2bfloat16_rn(v[0]);
  } else {
    unsigned words[V / 2];
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      words[k] = float_to_bf16_bits(v[2 * k]) | (float_to_bf16_bits(v[2 * k + 1]) << 16);
    }
    if constexpr (V == 2) {
      *reinterpret_cast<unsigned*>(p) = words[0];
    } else if constexpr (V == 4) {
      *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

// V consecutive floats; V a multiple of 4 loads float4s (p 16-byte aligned), else scalars.
template <int V>
__device__ __forceinline__ void load_f32(const float* p, float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      const float4 raw = *reinterpret_cast<const float4*>(p + k);
      v[k] = raw.x;
      v[k + 1] = raw.y;
      v[k + 2] = raw.z;
      v[k + 3] = raw.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = p[k];
  }
}

template <int V>
__device__ __forceinline__ void store_f32(float* p, const float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      *reinterpret_cast<float4*>(p + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = v[k];
  }
}

// Sum over the 32 lanes of a warp; every lane gets the result. All lanes must call it.
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// 1 / (1 + e^-a) from ex2.approx (__expf) and rcp.approx (__fdividef): four instructions where
// expf and a division take some twenty, and a correctly rounded reciprocal about ten, which the
// forward, bound by its instruction issue, feels; ~1e-6 relative against the twin's std::exp,
// far under the bf16 rounding of the outputs. a -> -inf gives 0 (1 / inf), +inf 1.
__device__ __forceinline__ float sigmoid(float a) {
  return __fdividef(1.0f, 1.0f + __expf(-a));
}

// ---- conversions and the residual stream ------------------------------------------------------
//
// Each kernel covers [0, count / V * V) in groups of V and the remaining count % V elements one by
// one (the first threads of the grid).

template <int V>
__global__ void to_bf16_kernel(bf16* out, const float* in, std::int64_t count) {
  const std::int64_t groups = count / V;
  for (std::int64_t g = global_thread(); g < groups; g += grid_threads()) {
    float v[V];
    load_f32<V>(in + g * V, v);
    store_bf16<V>(out + g * V, v);
  }
  for (std::int64_t i = groups * V + global_thread(); i < count; i += grid_threads()) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

template <int V>
__global__ void to_float_kernel(float* out, const bf16* in, std::int64_t count) {
  const std::int64_t groups = count / V;
  for (std::int64_t g = global_thread(); g < groups; g += grid_threads()) {
    float v[V];
    load_bf16<V>(in + g * V, v);
    store_f32<V>(out + g * V, v);
  }
  for (std::int64_t i = groups * V + global_thread(); i < count; i += grid_threads()) {
    out[i] = __bfloat162float(in[i]);
  }
}

template <int V>
__global__ void residual_add_kernel(bf16* y, const bf16* x, std::int64_t count) {
  const std::int64_t groups = count / V;
  for (std::int64_t g = global_thread(); g < groups; g += grid_threads()) {
    float a[V], b[V];
    load_bf16<V>(y + g * V, a);
    load_bf16<V>(x + g * V, b);
#pragma unroll
    for (int k = 0; k < V; ++k) a[k] += b[k];
    store_bf16<V>(y + g * V, a);
  }
  for (std::int64_t i = groups * V + global_thread(); i < count; i += grid_threads()) {
    y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + __bfloat162float(x[i]));
  }
}

// ---- embedding -------------------------------------------------------------------------------

// out[t, c..c+V) = table[tokens[t], c..c+V); dim % V == 0.
template <int V>
__global__ void embedding_forward_kernel(bf16* out, const std::int32_t* tokens, const bf16* table,
                                         std::int64_t n_tokens, std::int64_t dim) {
  const std::int64_t groups_per_row = dim / V;
  const std::int64_t groups = n_tokens * groups_per_row;
  for (std::int64_t g = global_thread(); g < groups; g += grid_threads()) {
    const std::int64_t t = g / groups_per_row;
    const std::int64_t c = (g - t * groups_per_row) * V;
    const bf16* src = table + std::int64_t{tokens[t]} * dim + c;
    bf16* dst = out + t * dim + c;
    if constexpr (V == 8) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) dst[k] = src[k];
    }
  }
}

// One thread per element of dout; rows hit by several tokens take their sums in any order.
__global__ void embedding_backward_atomic_kernel(float* dtable, const std::int32_t* tokens,
                                                 const bf16* dout, std::int64_t n_tokens,
                                                 std::int64_t dim) {
  const std::int64_t count = n_tokens * dim;
  for (std::int64_t i = global_thread(); i < count; i += grid_threads()) {
    const std::int64_t t = i / dim;
    const std::int64_t c = i - t * dim;
    atomicAdd(dtable + std::int64_t{tokens[t]} * dim + c, __bfloat162float(dout[i]));
  }
}

// One thread per column, walking the tokens in order: column c of every table row is written by
// this thread alone, so each sum dtable[v, c] + dout[t1, c] + dout[t2, c] + ... is formed in token
// order, as the CPU twin forms it. Threads of a warp own adjacent columns (coalesced rows).
constexpr int kOrderedThreads = 64;

__global__ void embedding_backward_ordered_kernel(float* dtable,
                                                  const std::int32_t* __restrict__ tokens,
                                                  const bf16* __restrict__ dout,
                                                  std::int64_t n_tokens, std::int64_t dim) {
  const std::int64_t c = global_thread();
  if (c >= dim) return;
  const bf16* src = dout + c;
#pragma unroll 4
  for (std::int64_t t = 0; t < n_tokens; ++t) {
    float* dst = dtable + std::int64_t{tokens[t]} * dim + c;
    *dst += __bfloat162float(src[t * dim]);
  }
}

// ---- RMSNorm ---------------------------------------------------------------------------------

// One warp per row (grid-stride over rows); lane l handles the groups l, l + 32, ... of V columns;
// dim % V == 0.
template <int V>
__global__ void rmsnorm_forward_kernel(bf16* y, float* inv_rms, const bf16* x, const float* g,
                                       std::int64_t rows, std::int64_t dim, float eps) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t row = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const bf16* xr = x + row * dim;
    float squares = 0.0f;
    for (std::int64_t c = std::int64_t{lane} * V; c < dim; c += 32 * V) {
      float v[V];
      load_bf16<V>(xr + c, v);
#pragma unroll
      for (int k = 0; k < V; ++k) squares += v[k] * v[k];
    }
    squares = warp_sum(squares);
    const float inv = 1.0f / sqrtf(squares / static_cast<float>(dim) + eps);
    bf16* yr = y + row * dim;
    for (std::int64_t c = std::int64_t{lane} * V; c < dim; c += 32 * V) {
      float v[V];
      load_bf16<V>(xr + c, v);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = v[k] * inv * g[c + k];
      store_bf16<V>(yr + c, v);
    }
    if (lane == 0) inv_rms[row] = inv;
  }
}

// rmsnorm_forward_kernel<8>'s arithmetic, in the same order (the same bits), where dim = 256 kChunks
// (up to 1024) and g is 16-byte aligned: a warp's row stays in registers between the sum of squares
// and the output (x read once, all its loads in flight together), g read as float4s.
template <int kChunks>
__global__ void rmsnorm_forward_rows_kernel(bf16* y, float* inv_rms, const bf16* x, const float* g,
                                            std::int64_t rows, float eps) {
  constexpr int V = 8;
  constexpr int kDim = 32 * V * kChunks;
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t row = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const bf16* xr = x + row * kDim;
    float v[kChunks][V];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) load_bf16<V>(xr + 32 * V * j + lane * V, v[j]);
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
#pragma unroll
      for (int k = 0; k < V; ++k) squares += v[j][k] * v[j][k];
    }
    squares = warp_sum(squares);
    const float inv = 1.0f / sqrtf(squares / static_cast<float>(kDim) + eps);
    bf16* yr = y + row * kDim;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = 32 * V * j + lane * V;
      float gv[V];
      load_f32<V>(g + c, gv);
#pragma unroll
      for (int k = 0; k < V; ++k) v[j][k] = v[j][k] * inv * gv[k];
      store_bf16<V>(yr + c, v[j]);
    }
    if (lane == 0) inv_rms[row] = inv;
  }
}

// A row's sum of dy * g * x over V columns, added to `dot`.
template <int V>
__device__ __forceinline__ void add_rmsnorm_dot(float& dot, const float (&xv)[V],
                                                const float (&dyv)[V], const float (&gv)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) dot += dyv[k] * gv[k] * xv[k];
}

// out = before + inv * (dy * g - x * inv * mean) over V columns (before: dx's old values, or
// zeros), stored to dx.
template <int V>
__device__ __forceinline__ void write_rmsnorm_dx(bf16* dx, float (&out)[V], const float (&xv)[V],
                                                 const float (&dyv)[V], const float (&gv)[V],
                                                 float inv, float mean) {
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] += inv * (dyv[k] * gv[k] - xv[k] * inv * mean);
  store_bf16<V>(dx, out);
}

// dx's old values (add) or zeros.
template <int V>
__device__ __forceinline__ void load_dx_before(const bf16* dx, bool add, float (&out)[V]) {
  if (add) {
    load_bf16<V>(dx, out);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = 0.0f;
  }
}

// dx (+)= inv * (dy * g - xhat * mean(dy * g * xhat)), xhat = x * inv; one warp per row.
template <int V>
__global__ void rmsnorm_backward_dx_kernel(bf16* dx, const bf16* dy, const bf16* x, const float* g,
                                           const float* inv_rms, std::int64_t rows,
                                           std::int64_t dim, bool add) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t row = std::int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const bf16* xr = x + row * dim;
    const bf16* dyr = dy + row * dim;
    float dot = 0.0f;  // sum of dy * g * x
    for (std::int64_t c = std::int64_t{lane} * V; c < dim; c += 32 * V) {
      float xv[V], dyv[V], gv[V];
      load_bf16<V>(xr + c, xv);
      load_bf16<V>(dyr + c, dyv);
#pragma unroll
      for (int k = 0; k < V; ++k) gv[k] = g[c + k];
      add_rmsnorm_dot<V>(dot, xv, dyv, gv);
    }
    dot = warp_sum(dot);
    const float inv = inv_rms[row];
    const float mean = dot * inv / static_cast<float>(dim);
    for (std::int64_t c = std::int64_t{lane} * V; c < dim; c += 32 * V) {
      float xv[V], dyv[V], gv[V], out[V];
      load_bf16<V>(xr + c, xv);
      load_bf16<V>(dyr + c, dyv);
#pragma unroll
      for (int k = 0; k < V; ++k) gv[k] = g[c + k];
      load_dx_before<V>(dx + row * dim + c, add, out);
      write_rmsnorm_dx<V>(dx + row * dim + c, out, xv, dyv, gv, inv, mean);
    }
  }
}

// dg, first pass: block (x, y) owns the 64 columns from 64 x and the rows_per_range rows from
// rows_per_range y. Lane l of warp w sums its columns l and l + 32 over the rows w, w + 8, ... of
// the range; thread j < 64 then adds the 8 warps' sums of its column in warp order. With
// `accumulate` (one range only) that sum is added to out = dg; otherwise it is written to
// out = partial [ranges, dim]. Every assignment depends only on the shape: reproducible sums.
constexpr int kDgTile = 64;
constexpr std::int64_t kDgMinRowsPerRange = 64;
constexpr std::int64_t kDgMaxRanges = 256;

__global__ void rmsnorm_dg_partial_kernel(float* out, const bf16* dy, const bf16* x,
                                          const float* inv_rms, std::int64_t rows, std::int64_t dim,
                                          std::int64_t rows_per_range, bool accumulate) {
  __shared__ float sums[kWarpsPerBlock][kDgTile];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const std::int64_t c0 = std::int64_t{blockIdx.x} * kDgTile + lane;
  const std::int64_t c1 = c0 + 32;
  const std::int64_t begin = std::int64_t{blockIdx.y} * rows_per_range;
  const std::int64_t end = begin + rows_per_range < rows ? begin + rows_per_range : rows;
  float s0 = 0.0f, s1 = 0.0f;
  for (std::int64_t r = begin + warp; r < end; r += kWarpsPerBlock) {
    const float inv = inv_rms[r];
    const std::int64_t base = r * dim;
    if (c0 < dim) s0 += __bfloat162float(dy[base + c0]) * __bfloat162float(x[base + c0]) * inv;
    if (c1 < dim) s1 += __bfloat162float(dy[base + c1]) * __bfloat162float(x[base + c1]) * inv;
  }
  sums[warp][lane] = s0;
  sums[warp][lane + 32] = s1;
  __syncthreads();
  if (threadIdx.x < kDgTile) {
    const std::int64_t c = std::int64_t{blockIdx.x} * kDgTile + threadIdx.x;
    if (c < dim) {
      float s = sums[0][threadIdx.x];
#pragma unroll
      for (int w = 1; w < kWarpsPerBlock; ++w) s += sums[w][threadIdx.x];
      if (accumulate) {
        out[c] += s;
      } else {
        out[std::int64_t{blockIdx.y} * dim + c] = s;
      }
    }
  }
}

// dg[c] += the sum of partial[0 .. ranges - 1, c]: a block takes 32 columns at a time (from 32 b,
// striding over the grid); lane l of warp w sums its column over the ranges w, w + 8, ... in order,
// then lane l of warp 0 adds the 8 warps' sums in warp order. The order depends only on the shape:
// reproducible sums.
__global__ void rmsnorm_dg_reduce_kernel(float* dg, const float* partial, std::int64_t ranges,
                                         std::int64_t dim) {
  __shared__ float sums[kWarpsPerBlock][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (std::int64_t c0 = std::int64_t{blockIdx.x} * 32; c0 < dim; c0 += std::int64_t{gridDim.x} * 32) {
    const std::int64_t c = c0 + lane;
    float s = 0.0f;
    if (c < dim) {
#pragma unroll 4
      for (std::int64_t k = warp; k < ranges; k += kWarpsPerBlock) s += partial[k * dim + c];
    }
    sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && c < dim) {
      float total = sums[0][lane];
#pragma unroll
      for (int w = 1; w < kWarpsPerBlock; ++w) total += sums[w][lane];
      dg[c] += total;
    }
    __syncthreads();
  }
}

// 8 bf16 as fp32 (exact), as load_bf16<8> converts them.
__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float (&v)[8]) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = bf16_bits_to_float(words[k] & 0xffffu);
    v[2 * k + 1] = bf16_bits_to_float(words[k] >> 16);
  }
}

// The same values by byte permutes. rmsnorm_backward_row's dx pass converts x and dy again from
// their raw bits rather than keeping the dot pass's 64 fp32 values across the reduction (beside
// the next row's registers they would spill); a conversion written differently from the dot
// pass's is one the compiler does not merge with it.
__device__ __forceinline__ void unpack_bf16x8_prmt(const uint4& raw, float (&v)[8]) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(__byte_perm(words[k], 0u, 0x1044u));
    v[2 * k + 1] = __uint_as_float(__byte_perm(words[k], 0u, 0x3244u));
  }
}

// A row's x and dy as they lie in memory, lane l holding its columns 8 l + 256 j + {0..7} in
// chunk j (8 bf16 to a uint4), and the row's inv_rms.
template <int kChunks>
struct RmsNormRowBits {
  uint4 x[kChunks], dy[kChunks];
  float inv;
};

// Issues the loads of `row` into `bits`; the warp waits for them only where it reads the bits.
template <int kChunks>
__device__ __forceinline__ void load_rmsnorm_row(RmsNormRowBits<kChunks>& bits, const bf16* dy,
                                                 const bf16* x, const float* inv_rms,
                                                 std::int64_t row, int lane) {
  constexpr int kDim = 256 * kChunks;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const std::int64_t i = row * kDim + 256 * j + 8 * lane;
    bits.x[j] = *reinterpret_cast<const uint4*>(x + i);
    bits.dy[j] = *reinterpret_cast<const uint4*>(dy + i);
  }
  bits.inv = inv_rms[row];
}

// One row of rmsnorm_backward_rows_kernel from its bits and dx's old values (`before`, raw bf16;
// zeros without kAdd): dx written, dy * x * inv added to the warp's partial sums. As each chunk's
// old values are read, the load of the `ahead` row's (if has_ahead) is issued into their
// registers.
template <int kChunks, bool kAdd>
__device__ __forceinline__ void rmsnorm_backward_row(bf16* dx, float* partial, const float* g,
                                                     const RmsNormRowBits<kChunks>& bits,
                                                     uint4 (&before)[kChunks], std::int64_t row,
                                                     std::int64_t ahead, bool has_ahead, int lane) {
  constexpr int V = 8;
  constexpr int kDim = 32 * V * kChunks;
  const float inv = bits.inv;
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    float xv[V], dyv[V], gv[V];
    unpack_bf16x8(bits.x[j], xv);
    unpack_bf16x8(bits.dy[j], dyv);
    load_f32<V>(g + 32 * V * j + lane * V, gv);
    add_rmsnorm_dot<V>(dot, xv, dyv, gv);
  }
  dot = warp_sum(dot);
  const float mean = dot * inv / static_cast<float>(kDim);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = 32 * V * j + lane * V;
    float xv[V], dyv[V], out[V], gv[V], sum[V];
    unpack_bf16x8_prmt(bits.x[j], xv);
    unpack_bf16x8_prmt(bits.dy[j], dyv);
    unpack_bf16x8(before[j], out);
    if (kAdd && has_ahead) before[j] = *reinterpret_cast<const uint4*>(dx + ahead * kDim + c);
    load_f32<V>(g + c, gv);
    write_rmsnorm_dx<V>(dx + row * kDim + c, out, xv, dyv, gv, inv, mean);
    load_f32<V>(partial + c, sum);
#pragma unroll
    for (int k = 0; k < V; ++k) sum[k] += dyv[k] * xv[k] * inv;
    store_f32<V>(partial + c, sum);
  }
}

// Both at once where dim = 256 kChunks (up to 1024) and g is 16-byte aligned, in one pass over x,
// dy (and dx, when added to: kAdd) held in registers: dx as rmsnorm_backward_dx_kernel computes
// it, and dg's partial sums with rmsnorm_dg_partial_kernel's row ranges and order. Block y owns
// range y; its warp w takes the range's rows w, w + 8, ...; lane l sums its columns
// 8 l + 256 j + {0..7} over them in its warp's row of shared memory, and the block adds its
// warps' sums in warp order into out = dg (`accumulate`, one range) or out = partial[y]. The same
// sums, bitwise, as the two-kernel path.
// A warp's rows are pipelined so that its loads are in flight while it computes: the next row's
// x and dy are loaded before the current row's arithmetic, as raw bf16 into a second set of
// registers (the loop takes two rows a turn, the sets alternating without copies), and its old dx
// values chunk by chunk into the current row's registers as these are read. Each row's
// arithmetic is the same, in the same order, as with one row at a time.
// Two blocks an SM (128 registers): g is read again from L1 for dx rather than held.
template <int kChunks, bool kAdd>
__global__ void __launch_bounds__(kThreads, 2)
    rmsnorm_backward_rows_kernel(bf16* dx, float* out, const bf16* dy, const bf16* x,
                                 const float* g, const float* inv_rms, std::int64_t rows,
                                 std::int64_t rows_per_range, bool accumulate) {
  constexpr int V = 8;
  constexpr int kDim = 32 * V * kChunks;
  __shared__ __align__(16) float sums[kWarpsPerBlock][kDim];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const std::int64_t begin = std::int64_t{blockIdx.x} * rows_per_range;
  const std::int64_t end = begin + rows_per_range < rows ? begin + rows_per_range : rows;
  float* partial = sums[warp];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const float zeros[V] = {};
    store_f32<V>(partial + 32 * V * j + lane * V, zeros);
  }
  std::int64_t row = begin + warp;
  RmsNormRowBits<kChunks> even, odd;
  uint4 before[kChunks] = {};
  if (row < end) {
    load_rmsnorm_row<kChunks>(even, dy, x, inv_rms, row, lane);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const std::int64_t i = row * kDim + 32 * V * j + lane * V;
      if (kAdd) before[j] = *reinterpret_cast<const uint4*>(dx + i);
    }
  }
  while (row < end) {
    std::int64_t ahead = row + kWarpsPerBlock;
    if (ahead < end) load_rmsnorm_row<kChunks>(odd, dy, x, inv_rms, ahead, lane);
    rmsnorm_backward_row<kChunks, kAdd>(dx, partial, g, even, before, row, ahead, ahead < end,
                                        lane);
    row = ahead;
    if (row >= end) break;
    ahead = row + kWarpsPerBlock;
    if (ahead < end) load_rmsnorm_row<kChunks>(even, dy, x, inv_rms, ahead, lane);
    rmsnorm_backward_row<kChunks, kAdd>(dx, partial, g, odd, before, row, ahead, ahead < end, lane);
    row = ahead;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kDim; c += kThreads) {
    float s = sums[0][c];
#pragma unroll
    for (int w = 1; w < kWarpsPerBlock; ++w) s += sums[w][c];
    if (accumulate) {
      out[c] += s;
    } else {
      out[std::int64_t{blockIdx.x} * kDim + c] = s;
    }
  }
}

// Stream-ordered scratch memory, released on the stream when the scope ends (also on a throw).
class StreamScratch {
 public:
  StreamScratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    RINGATTN_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() {
    if (data_ != nullptr) RINGATTN_CUDA_LOG(cudaFreeAsync(data_, stream_));
  }
  float* floats() const { return static_cast<float*>(data_); }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

// ---- RoPE ------------------------------------------------------------------------------------

// V consecutive source values as fp32: bf16 (exact) or fp32.
template <int V>
__device__ __forceinline__ void load_values(const bf16* p, float (&v)[V]) {
  load_bf16<V>(p, v);
}

template <int V>
__device__ __forceinline__ void load_values(const float* p, float (&v)[V]) {
  load_f32<V>(p, v);
}

// One block per token (blockIdx.x), its threads over the token's groups of V consecutive pairs
// (i, i + half) of a head; half % V == 0. Backward (inverse = true) rotates by -angle. The pairs
// are read from src and written to x (src == x: in place). Then the `tail` elements that follow
// the heads in the token's row are written to x as src holds them, in groups of V (tail % V == 0;
// 0 when in place or where the rest is left alone). Within a
// token the indices are 32-bit: one division a group, where a grid over every group of every
// token divided 64-bit numbers three times a group.
template <int V, bool inverse, typename Src>
__global__ void rope_kernel(bf16* x, const Src* src, const float* cos_table, const float* sin_table,
                            std::int64_t table_rows, int heads, int head_dim,
                            std::int64_t token_stride, int tail) {
  const std::int64_t t = blockIdx.x;
  const int half = head_dim / 2;
  const int groups_per_head = half / V;
  const int groups = heads * groups_per_head;
  const std::int64_t row = t * token_stride;
  const float* cos_row = cos_table + (t % table_rows) * half;
  const float* sin_row = sin_table + (t % table_rows) * half;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const int h = g / groups_per_head;
    const int i = (g - h * groups_per_head) * V;
    const std::int64_t lo = row + h * head_dim + i;
    const std::int64_t hi = lo + half;
    float a[V], b[V];
    load_values<V>(src + lo, a);
    load_values<V>(src + hi, b);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float c = cos_row[i + k];
      const float s = inverse ? -sin_row[i + k] : sin_row[i + k];
      const float a_k = a[k];
      a[k] = a_k * c - b[k] * s;
      b[k] = a_k * s + b[k] * c;
    }
    store_bf16<V>(x + lo, a);
    store_bf16<V>(x + hi, b);
  }
  const std::int64_t rest = row + static_cast<std::int64_t>(heads) * head_dim;
  for (int j = threadIdx.x * V; j < tail; j += blockDim.x * V) {
    float v[V];
    load_values<V>(src + rest + j, v);
    store_bf16<V>(x + rest + j, v);
  }
}

// The rotation of x's heads by the tables, read from src (named src_name in errors). src == x
// rotates in place and leaves the rest of each token row alone; another src (fp32, not
// overlapping x) also writes that rest, src's values as they are: every element of x's token rows
// is then written once, rounded once, unless keep_rest leaves the rest alone.
template <bool inverse, typename Src>
void rope(std::string_view where, std::string_view x_name, bf16* x, std::string_view src_name,
          const Src* src, const float* cos, const float* sin, std::int64_t table_rows,
          const cpu::RopeShape& s, cudaStream_t stream, bool keep_rest = false) {
  cpu::check_rope_shape(where, s);
  detail::check_positive(where, "table_rows", table_rows);
  check_pointer(where, x_name, x);
  check_pointer(where, src_name, src);
  check_pointer(where, "cos", cos);
  check_pointer(where, "sin", sin);

  const std::int64_t half = s.head_dim / 2;
  const bool in_place = static_cast<const void*>(src) == static_cast<const void*>(x);
  const std::int64_t tail = in_place || keep_rest ? 0 : s.token_stride - s.heads * s.head_dim;
  // The widest access every pair group allows: its offset t * token_stride + h * head_dim + i
  // (and + half) is a multiple of V when token_stride, head_dim and half are; so are the tail's
  // groups, from t * token_stride + heads * head_dim.
  auto fits = [&](int v) {
    return half % v == 0 && s.token_stride % v == 0 &&
           aligned(x, sizeof(bf16) * static_cast<std::size_t>(v)) &&
           aligned(src, sizeof(Src) * static_cast<std::size_t>(v));
  };
  // A token's groups (its pairs and its tail, V elements a group) over up to kThreads threads.
  constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();
  if (s.tokens > kMaxInt) {
    ringattn::detail::fail(where, "shape.tokens is ", s.tokens, "; expected at most ", kMaxInt,
                           " (one block a token)");
  }
  if (s.token_stride > kMaxInt) {
    ringattn::detail::fail(where, "shape.token_stride is ", s.token_stride, "; expected at most ",
                           kMaxInt);
  }
  auto launch = [&](auto width) {
    constexpr int V = decltype(width)::value;
    const std::int64_t groups = std::max(s.heads * half, tail) / V;
    const int threads = static_cast<int>(std::min<std::int64_t>(kThreads, (groups + 31) / 32 * 32));
    rope_kernel<V, inverse, Src><<<static_cast<unsigned>(s.tokens), threads, 0, stream>>>(
        x, src, cos, sin, table_rows, static_cast<int>(s.heads), static_cast<int>(s.head_dim),
        s.token_stride, static_cast<int>(tail));
  };
  if (fits(8)) {
    launch(std::integral_constant<int, 8>{});
  } else if (fits(4)) {
    launch(std::integral_constant<int, 4>{});
  } else if (fits(2)) {
    launch(std::integral_constant<int, 2>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

// ---- SwiGLU ----------------------------------------------------------------------------------

// Groups of V columns of one row; hidden % V == 0. Index: 32-bit where rows * hidden (and the
// grid's stride past it) fits, which spares the forward a 64-bit division a group, a quarter of
// its instructions.
template <int V, typename Index>
__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, Index rows, Index hidden) {
  const Index groups_per_row = hidden / V;
  const Index groups = rows * groups_per_row;
  const Index stride = static_cast<Index>(grid_threads());
  for (Index g = static_cast<Index>(global_thread()); g < groups; g += stride) {
    const Index r = g / groups_per_row;
    const std::int64_t c = static_cast<std::int64_t>(g - r * groups_per_row) * V;
    const bf16* a_row = gate_up + static_cast<std::int64_t>(r) * 2 * hidden;
    float a[V], b[V], o[V];
    load_bf16<V>(a_row + c, a);
    load_bf16<V>(a_row + hidden + c, b);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = a[k] * sigmoid(a[k]) * b[k];
    store_bf16<V>(out + static_cast<std::int64_t>(r) * hidden + c, o);
  }
}

template <int V>
__global__ void swiglu_backward_kernel(bf16* dgate_up, const bf16* dout, const bf16* gate_up,
                                       std::int64_t rows, std::int64_t hidden) {
  const std::int64_t groups_per_row = hidden / V;
  const std::int64_t groups = rows * groups_per_row;
  for (std::int64_t g = global_thread(); g < groups; g += grid_threads()) {
    const std::int64_t r = g / groups_per_row;
    const std::int64_t c = (g - r * groups_per_row) * V;
    const std::int64_t in = r * 2 * hidden + c;
    float a[V], b[V], d[V], da[V], db[V];
    load_bf16<V>(gate_up + in, a);
    load_bf16<V>(gate_up + in + hidden, b);
    load_bf16<V>(dout + r * hidden + c, d);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float sig = sigmoid(a[k]);
      da[k] = d[k] * b[k] * sig * (1.0f + a[k] * (1.0f - sig));
      db[k] = d[k] * a[k] * sig;
    }
    store_bf16<V>(dgate_up + in, da);
    store_bf16<V>(dgate_up + in + hidden, db);
  }
}

}  // namespace

// ---- conversions and the residual stream ------------------------------------------------------

void to_bf16(bf16* out, const float* in, std::int64_t count, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::to_bf16";
  detail::check_positive(kWhere, "count", count);
  check_pointer(kWhere, "out", out);
  check_pointer(kWhere, "in", in);
  if (aligned(in, 16) && aligned(out, 8)) {
    to_bf16_kernel<4><<<blocks_for(count / 4 + 1), kThreads, 0, stream>>>(out, in, count);
  } else {
    to_bf16_kernel<1><<<blocks_for(count), kThreads, 0, stream>>>(out, in, count);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void to_float(float* out, const bf16* in, std::int64_t count, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::to_float";
  detail::check_positive(kWhere, "count", count);
  check_pointer(kWhere, "out", out);
  check_pointer(kWhere, "in", in);
  if (aligned(in, 16) && aligned(out, 16)) {
    to_float_kernel<8><<<blocks_for(count / 8 + 1), kThreads, 0, stream>>>(out, in, count);
  } else {
    to_float_kernel<1><<<blocks_for(count), kThreads, 0, stream>>>(out, in, count);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void residual_add(bf16* y, const bf16* x, std::int64_t count, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::residual_add";
  detail::check_positive(kWhere, "count", count);
  check_pointer(kWhere, "y", y);
  check_pointer(kWhere, "x", x);
  if (aligned(y, 16) && aligned(x, 16)) {
    residual_add_kernel<8><<<blocks_for(count / 8 + 1), kThreads, 0, stream>>>(y, x, count);
  } else {
    residual_add_kernel<1><<<blocks_for(count), kThreads, 0, stream>>>(y, x, count);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

// ---- embedding -------------------------------------------------------------------------------

namespace {

void check_embedding(std::string_view where, const std::int32_t* tokens,
                     const cpu::EmbeddingShape& s) {
  detail::check_positive(where, "shape.tokens", s.tokens);
  detail::check_positive(where, "shape.vocab", s.vocab);
  detail::check_positive(where, "shape.dim", s.dim);
  check_pointer(where, "tokens", tokens);
}

}  // namespace

void embedding_forward(bf16* out, const std::int32_t* tokens, const bf16* table,
                       const cpu::EmbeddingShape& s, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::embedding_forward";
  check_embedding(kWhere, tokens, s);
  check_pointer(kWhere, "out", out);
  check_pointer(kWhere, "table", table);
  if (s.dim % 8 == 0 && aligned(out, 16) && aligned(table, 16)) {
    embedding_forward_kernel<8><<<blocks_for(s.tokens * s.dim / 8), kThreads, 0, stream>>>(
        out, tokens, table, s.tokens, s.dim);
  } else {
    embedding_forward_kernel<1><<<blocks_for(s.tokens * s.dim), kThreads, 0, stream>>>(
        out, tokens, table, s.tokens, s.dim);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void embedding_backward(float* dtable, const std::int32_t* tokens, const bf16* dout,
                        const cpu::EmbeddingShape& s, bool deterministic, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::embedding_backward";
  check_embedding(kWhere, tokens, s);
  check_pointer(kWhere, "dtable", dtable);
  check_pointer(kWhere, "dout", dout);
  if (deterministic) {
    const std::int64_t blocks = (s.dim + kOrderedThreads - 1) / kOrderedThreads;
    if (blocks > 0x7fffffff) {
      ringattn::detail::fail(kWhere, "shape.dim is ", s.dim,
                             "; expected <= ", std::int64_t{0x7fffffff} * kOrderedThreads);
    }
    embedding_backward_ordered_kernel<<<static_cast<unsigned>(blocks), kOrderedThreads, 0,
                                        stream>>>(dtable, tokens, dout, s.tokens, s.dim);
  } else {
    embedding_backward_atomic_kernel<<<blocks_for(s.tokens * s.dim), kThreads, 0, stream>>>(
        dtable, tokens, dout, s.tokens, s.dim);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

// ---- RMSNorm ---------------------------------------------------------------------------------

namespace {

void check_rmsnorm(std::string_view where, const cpu::RmsNormShape& s) {
  detail::check_positive(where, "shape.rows", s.rows);
  detail::check_positive(where, "shape.dim", s.dim);
}

unsigned row_blocks(std::int64_t rows) {
  return blocks_for(rows, kWarpsPerBlock);
}

// The register-row kernels' sizes: for dim = 256 K (K = 1 to 4) calls
// launch(std::integral_constant<int, K>{}) and returns true; false for any other dim.
template <typename Launch>
bool with_row_chunks(std::int64_t dim, Launch&& launch) {
  switch (dim) {
    case 256: launch(std::integral_constant<int, 1>{}); return true;
    case 512: launch(std::integral_constant<int, 2>{}); return true;
    case 768: launch(std::integral_constant<int, 3>{}); return true;
    case 1024: launch(std::integral_constant<int, 4>{}); return true;
    default: return false;
  }
}

}  // namespace

void rmsnorm_forward(bf16* y, float* inv_rms, const bf16* x, const float* g,
                     const cpu::RmsNormShape& s, double eps, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::rmsnorm_forward";
  check_rmsnorm(kWhere, s);
  check_pointer(kWhere, "y", y);
  check_pointer(kWhere, "inv_rms", inv_rms);
  check_pointer(kWhere, "x", x);
  check_pointer(kWhere, "g", g);
  if (!(eps > 0.0) || !std::isfinite(eps)) {
    ringattn::detail::fail(kWhere, "eps is ", eps, "; expected a finite value > 0");
  }
  const float eps_f = static_cast<float>(eps);
  const bool vectors = s.dim % 8 == 0 && aligned(y, 16) && aligned(x, 16);
  const bool rows = vectors && aligned(g, 16);
  const auto rows_kernel = [&](auto chunks) {
    rmsnorm_forward_rows_kernel<decltype(chunks)::value>
        <<<row_blocks(s.rows), kThreads, 0, stream>>>(y, inv_rms, x, g, s.rows, eps_f);
  };
  if (!(rows && with_row_chunks(s.dim, rows_kernel))) {
    if (vectors) {
      rmsnorm_forward_kernel<8>
          <<<row_blocks(s.rows), kThreads, 0, stream>>>(y, inv_rms, x, g, s.rows, s.dim, eps_f);
    } else {
      rmsnorm_forward_kernel<1>
          <<<row_blocks(s.rows), kThreads, 0, stream>>>(y, inv_rms, x, g, s.rows, s.dim, eps_f);
    }
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(bf16* dx, float* dg, const bf16* dy, const bf16* x, const float* g,
                      const float* inv_rms, const cpu::RmsNormShape& s, Write dx_write,
                      cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::rmsnorm_backward";
  check_rmsnorm(kWhere, s);
  check_pointer(kWhere, "dx", dx);
  check_pointer(kWhere, "dg", dg);
  check_pointer(kWhere, "dy", dy);
  check_pointer(kWhere, "x", x);
  check_pointer(kWhere, "g", g);
  check_pointer(kWhere, "inv_rms", inv_rms);
  // dg is summed from dy after dx is written: the two may not overlap.
  const auto dx_begin = reinterpret_cast<std::uintptr_t>(dx);
  const auto dy_begin = reinterpret_cast<std::uintptr_t>(dy);
  const auto bytes = static_cast<std::uintptr_t>(s.rows * s.dim) * sizeof(bf16);
  if (dx_begin < dy_begin + bytes && dy_begin < dx_begin + bytes) {
    ringattn::detail::fail(kWhere, "dx overlaps dy; expected separate buffers");
  }

  // Row ranges of at least kDgMinRowsPerRange rows, at most kDgMaxRanges of them (the partials
  // stay under 256 * dim floats); none is empty.
  const std::int64_t wanted =
      std::min(kDgMaxRanges, (s.rows + kDgMinRowsPerRange - 1) / kDgMinRowsPerRange);
  const std::int64_t rows_per_range = (s.rows + wanted - 1) / wanted;
  const std::int64_t ranges = (s.rows + rows_per_range - 1) / rows_per_range;
  const std::int64_t tiles = (s.dim + kDgTile - 1) / kDgTile;
  if (tiles > 0x7fffffff) {
    ringattn::detail::fail(kWhere, "shape.dim is ", s.dim,
                           "; expected <= ", std::int64_t{0x7fffffff} * kDgTile);
  }
  // With one range dg takes the sums directly; otherwise they go through per-range partials.
  std::optional<StreamScratch> partial;
  if (ranges > 1) partial.emplace(static_cast<std::size_t>(ranges * s.dim) * sizeof(float), stream);
  float* const sums = ranges > 1 ? partial->floats() : dg;

  const bool add = dx_write == Write::add;
  const bool vectors = s.dim % 8 == 0 && aligned(dx, 16) && aligned(dy, 16) && aligned(x, 16);
  const auto rows_kernel = [&](auto chunks) {
    constexpr int kChunks = decltype(chunks)::value;
    const auto kernel = add ? rmsnorm_backward_rows_kernel<kChunks, true>
                            : rmsnorm_backward_rows_kernel<kChunks, false>;
    kernel<<<static_cast<unsigned>(ranges), kThreads, 0, stream>>>(
        dx, sums, dy, x, g, inv_rms, s.rows, rows_per_range, ranges == 1);
  };
  const bool rows = vectors && aligned(g, 16);
  if (!(rows && with_row_chunks(s.dim, rows_kernel))) {
    if (vectors) {
      rmsnorm_backward_dx_kernel<8>
          <<<row_blocks(s.rows), kThreads, 0, stream>>>(dx, dy, x, g, inv_rms, s.rows, s.dim, add);
    } else {
      rmsnorm_backward_dx_kernel<1>
          <<<row_blocks(s.rows), kThreads, 0, stream>>>(dx, dy, x, g, inv_rms, s.rows, s.dim, add);
    }
    RINGATTN_CUDA_CHECK_LAUNCH();
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(ranges));
    rmsnorm_dg_partial_kernel<<<grid, kThreads, 0, stream>>>(sums, dy, x, inv_rms, s.rows, s.dim,
                                                             rows_per_range, ranges == 1);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
  if (ranges > 1) {
    rmsnorm_dg_reduce_kernel<<<blocks_for(s.dim, 32), kThreads, 0, stream>>>(dg, sums, ranges,
                                                                             s.dim);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
}

// ---- RoPE ------------------------------------------------------------------------------------

void check_rope_arguments(const std::vector<std::int64_t>& positions, std::int64_t head_dim,
                          double theta, const char* where) {
  detail::check_positive(where, "positions.size()", static_cast<std::int64_t>(positions.size()));
  detail::check_positive(where, "head_dim", head_dim);
  if (head_dim % 2 != 0) {
    ringattn::detail::fail(where, "head_dim is ", head_dim, "; expected an even number");
  }
  if (!(theta > 0.0) || !std::isfinite(theta)) {
    ringattn::detail::fail(where, "theta is ", theta, "; expected a finite value > 0");
  }
  for (std::size_t t = 0; t < positions.size(); ++t) {
    if (positions[t] < 0) {
      ringattn::detail::fail(where, "positions[", t, "] is ", positions[t], "; expected >= 0");
    }
  }
}

std::vector<double> rope_inverse_frequencies(std::int64_t head_dim, double theta) {
  std::vector<double> inv_freq(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = std::pow(theta, -2.0 * double(i) / double(head_dim));
  }
  return inv_freq;
}

RopeTable rope_table(const std::vector<std::int64_t>& positions, std::int64_t head_dim,
                     double theta) {
  check_rope_arguments(positions, head_dim, theta, "train::cuda::rope_table");
  const std::int64_t half = head_dim / 2;
  const std::vector<double> inv_freq = rope_inverse_frequencies(head_dim, theta);
  RopeTable table;
  table.cos.resize(positions.size() * static_cast<std::size_t>(half));
  table.sin.resize(table.cos.size());
  for (std::size_t t = 0; t < positions.size(); ++t) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = double(positions[t]) * inv_freq[i];
      table.cos[t * half + i] = static_cast<float>(std::cos(angle));
      table.sin[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
  return table;
}

namespace {

// Element (t, i) of the table: the angle positions[t] * inv_freq[i] formed and rotated in double,
// then rounded to fp32, as rope_table does on the host.
__global__ void rope_table_kernel(float* cos_table, float* sin_table,
                                  const std::int64_t* positions, const double* inv_freq,
                                  std::int64_t rows, std::int64_t half) {
  for (std::int64_t i = global_thread(); i < rows * half; i += grid_threads()) {
    const std::int64_t t = i / half;
    double sine, cosine;
    sincos(double(positions[t]) * inv_freq[i - t * half], &sine, &cosine);
    cos_table[i] = static_cast<float>(cosine);
    sin_table[i] = static_cast<float>(sine);
  }
}

}  // namespace

void rope_table(float* cos, float* sin, const std::int64_t* positions, std::int64_t rows,
                const double* inverse_frequencies, std::int64_t head_dim, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::rope_table";
  check_pointer(kWhere, "cos", cos);
  check_pointer(kWhere, "sin", sin);
  check_pointer(kWhere, "positions", positions);
  check_pointer(kWhere, "inverse_frequencies", inverse_frequencies);
  detail::check_positive(kWhere, "rows", rows);
  detail::check_positive(kWhere, "head_dim", head_dim);
  if (head_dim % 2 != 0) {
    ringattn::detail::fail(kWhere, "head_dim is ", head_dim, "; expected an even number");
  }
  const std::int64_t half = head_dim / 2;
  rope_table_kernel<<<blocks_for(rows * half), kThreads, 0, stream>>>(
      cos, sin, positions, inverse_frequencies, rows, half);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void rope_forward(bf16* x, const float* cos, const float* sin, std::int64_t table_rows,
                  const cpu::RopeShape& shape, cudaStream_t stream) {
  rope<false>("train::cuda::rope_forward", "x", x, "x", x, cos, sin, table_rows, shape, stream);
}

void rope_backward(bf16* dx, const float* cos, const float* sin, std::int64_t table_rows,
                   const cpu::RopeShape& shape, cudaStream_t stream) {
  rope<true>("train::cuda::rope_backward", "dx", dx, "dx", dx, cos, sin, table_rows, shape, stream);
}

void rope_backward(bf16* dx, const float* dx_acc, const float* cos, const float* sin,
                   std::int64_t table_rows, const cpu::RopeShape& shape, cudaStream_t stream) {
  rope<true>("train::cuda::rope_backward", "dx", dx, "dx_acc", dx_acc, cos, sin, table_rows, shape,
             stream);
}

void rope_backward_heads(bf16* dx, const float* dx_acc, const float* cos, const float* sin,
                         std::int64_t table_rows, const cpu::RopeShape& shape,
                         cudaStream_t stream) {
  rope<true>("train::cuda::rope_backward_heads", "dx", dx, "dx_acc", dx_acc, cos, sin, table_rows,
             shape, stream, true);
}

// ---- SwiGLU ----------------------------------------------------------------------------------

void swiglu_forward(bf16* out, const bf16* gate_up, const cpu::SwigluShape& s,
                    cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::swiglu_forward";
  detail::check_positive(kWhere, "shape.rows", s.rows);
  detail::check_positive(kWhere, "shape.hidden", s.hidden);
  check_pointer(kWhere, "out", out);
  check_pointer(kWhere, "gate_up", gate_up);
  const auto launch = [&](auto width, auto index) {
    constexpr int V = decltype(width)::value;
    using Index = decltype(index);
    swiglu_forward_kernel<V, Index><<<blocks_for(s.rows * s.hidden / V), kThreads, 0, stream>>>(
        out, gate_up, static_cast<Index>(s.rows), static_cast<Index>(s.hidden));
  };
  // The groups, plus one grid stride past the last (at most kMaxBlocks * kThreads), in 32 bits.
  const bool narrow = s.rows * s.hidden + kMaxBlocks * kThreads <= std::int64_t{UINT32_MAX};
  if (s.hidden % 8 == 0 && aligned(out, 16) && aligned(gate_up, 16)) {
    if (narrow) {
      launch(std::integral_constant<int, 8>{}, std::uint32_t{});
    } else {
      launch(std::integral_constant<int, 8>{}, std::int64_t{});
    }
  } else {
    launch(std::integral_constant<int, 1>{}, std::int64_t{});
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(bf16* dgate_up, const bf16* dout, const bf16* gate_up,
                     const cpu::SwigluShape& s, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::swiglu_backward";
  detail::check_positive(kWhere, "shape.rows", s.rows);
  detail::check_positive(kWhere, "shape.hidden", s.hidden);
  check_pointer(kWhere, "dgate_up", dgate_up);
  check_pointer(kWhere, "dout", dout);
  check_pointer(kWhere, "gate_up", gate_up);
  if (s.hidden % 8 == 0 && aligned(dgate_up, 16) && aligned(dout, 16) && aligned(gate_up, 16)) {
    swiglu_backward_kernel<8><<<blocks_for(s.rows * s.hidden / 8), kThreads, 0, stream>>>(
        dgate_up, dout, gate_up, s.rows, s.hidden);
  } else {
    swiglu_backward_kernel<1><<<blocks_for(s.rows * s.hidden), kThreads, 0, stream>>>(
        dgate_up, dout, gate_up, s.rows, s.hidden);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace ringattn::train::cuda
