// The loss and optimizer ops of train/cuda/ops.hpp: softmax cross-entropy fused with its
// gradient, the sum of squares of gradient clipping, and the AdamW step. The CPU twins
// (train/op_cross_entropy, train/op_adamw) define the math.
//
// Cross-entropy runs one block per token row. Where the row fits in shared memory (vocabularies up
// to 49152), it is copied there once and three passes over the copy give its max, its sum of
// exponentials (fp32) with the argmax, and the gradient; otherwise the row is read twice from
// global memory: an online max / sum of exponentials, then, after a barrier, the gradient. Every
// entry of the gradient is written by the thread that read it, so the gradient can overwrite
// the logits in place. Rows are read in 16-byte vectors between a scalar head (up to the row's
// first 16-byte boundary) and a scalar tail: vocab need not be a multiple of anything. The losses
// come back to the host, where the sums are formed in token order in double, as the CPU twin
// forms them.
//
// sum_of_squares: a grid that depends only on the element count, each block summing a fixed
// range in double; the block partials are added on the host in order (bitwise reproducible).
//
// adamw_step: elementwise, the CPU twin's fp32 expression operation for operation, four elements a
// thread in 16-byte vectors where every array allows it (1.59 -> 1.41 ms a step of the 188M model
// on an H200).
//
// The device code keeps to C++17 (the .cu files of the library compile as C++17; the trainer's
// as C++20 only because its headers need it).
#include "train/cuda/ops.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cuda/mma_ptx.cuh"
#include "ringattn/error.hpp"
#include "src/cuda/cuda_check.hpp"

namespace ringattn::train::cuda {
namespace {

// ---- softmax cross-entropy -------------------------------------------------------------------

// 512 threads a row: a 131072-entry vocabulary is 32 16-byte vectors per thread, and a row of a
// few hundred entries still fills most of the block's warps.
constexpr int kRowThreads = 512;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kVector = 8;  // bf16 elements per 16-byte access
constexpr int kNoIndex = INT_MAX;
// The largest row cross_entropy_staged_kernel copies into shared memory: 96 KiB (a 49152-entry
// vocabulary), two blocks an SM; a 32768-entry row (64 KiB) leaves room for three.
constexpr std::size_t kStagedRowMaxBytes = 96 * 1024;

constexpr float kLog2e = 1.44269504088896340736f;

// 2^a in one instruction: ex2.approx.ftz flushes results below 2^-126 to zero, where the plain
// ex2.approx.f32 (__expf's) spends three more instructions an entry keeping them, and the
// kernels' arithmetic is most of their time. Relative error about 2^-22. 2^-inf = 0, 2^NaN = NaN.
__device__ __forceinline__ float exp2_ftz(float a) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// exp(a) = 2^(a log2 e). The rounded product adds |a| 2^-24 relative: the row's sum and the
// probabilities stay within ~1e-6 of the exact ones for the logits' range.
__device__ __forceinline__ float exp_fast(float a) {
  return exp2_ftz(a * kLog2e);
}

// exp(x - c) from c_log2 = c log2 e: one FMA and the 2^, where exp_fast(x - c) takes three
// instructions. x log2 e - c_log2 rounds once; c_log2's own rounding adds |c| 2^-24 relative (1e-6
// at |c| = 16). For x == c the result is 1 within that, not exactly 1; infinite or NaN c gives
// exp_fast(x - c)'s 0 or NaN.
__device__ __forceinline__ float exp_minus(float x, float c_log2) {
  return exp2_ftz(fmaf(x, kLog2e, -c_log2));
}

// The statistics of a set of logits: their maximum, the sum of exp(x - max) over them, and the
// lowest index holding the maximum. The empty set is {-inf, 0, kNoIndex}. NaN logits never become
// the maximum and make the sum NaN.
struct RowStats {
  float max;
  float sum;
  int argmax;
};

__device__ __forceinline__ RowStats empty_stats() {
  return {-INFINITY, 0.0f, kNoIndex};
}

__device__ __forceinline__ void add_logit(RowStats& s, float x, int j) {
  if (x > s.max) {
    // exp(-inf) = 0 covers the first finite logit and a new +inf maximum.
    s.sum = s.sum * exp_fast(s.max - x) + 1.0f;
    s.max = x;
    s.argmax = j;
  } else if (x == s.max) {
    // exp(0), without forming inf - inf when the maximum is infinite.
    s.sum += 1.0f;
    s.argmax = min(s.argmax, j);
  } else {
    s.sum += exp_fast(x - s.max);
  }
}

// add_logit over kVector logits j0.. in order, with one rescale: their maximum (the first index
// of it; NaN never becomes it) joins the running one first, then each logit adds exp(x - max), or
// exactly 1 where it equals the maximum (no inf - inf).
__device__ __forceinline__ void add_logits(RowStats& s, const float (&x)[kVector], int j0) {
  float m = -INFINITY;
  int arg = kNoIndex;
#pragma unroll
  for (int k = 0; k < kVector; ++k) {
    if (x[k] > m) m = x[k], arg = j0 + k;
  }
  if (m > s.max) {
    s.sum *= exp_fast(s.max - m);
    s.max = m;
    s.argmax = arg;
  } else if (m == s.max) {
    s.argmax = min(s.argmax, arg);
  }
#pragma unroll
  for (int k = 0; k < kVector; ++k) s.sum += x[k] == s.max ? 1.0f : exp_fast(x[k] - s.max);
}

// Symmetric in its arguments (the larger maximum first), so the result does not depend on which
// lane holds which operand.
__device__ __forceinline__ RowStats merge(RowStats a, RowStats b) {
  if (a.max < b.max) {
    const RowStats t = a;
    a = b;
    b = t;
  }
  if (a.max == b.max) return {a.max, a.sum + b.sum, min(a.argmax, b.argmax)};
  return {a.max, a.sum + b.sum * exp_fast(b.max - a.max), a.argmax};
}

__device__ __forceinline__ RowStats shuffle_down(const RowStats& s, int offset) {
  return {__shfl_down_sync(0xffffffffu, s.max, offset),
          __shfl_down_sync(0xffffffffu, s.sum, offset),
          __shfl_down_sync(0xffffffffu, s.argmax, offset)};
}

// The statistics of the whole block, returned to every thread: a fixed tree (lanes, then warps),
// so the result is bitwise the same run to run. shared holds kRowWarps + 1 entries.
__device__ RowStats reduce_block(RowStats s, RowStats* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) s = merge(s, shuffle_down(s, offset));
  if (lane == 0) shared[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kRowWarps ? shared[lane] : empty_stats();
    for (int offset = 16; offset > 0; offset /= 2) s = merge(s, shuffle_down(s, offset));
    if (lane == 0) shared[kRowWarps] = s;
  }
  __syncthreads();
  return shared[kRowWarps];
}

// Two bf16 in a 32-bit word (the lower address in the low half) to fp32, exactly, and back,
// rounding to nearest even.
__device__ __forceinline__ void unpack_word(unsigned word, float& low, float& high) {
  low = __uint_as_float(word << 16);
  high = __uint_as_float(word & 0xffff0000u);
}

__device__ __forceinline__ unsigned pack_word(float low, float high) {
  return cuda_detail::pack2<bf16>(low, high);
}

// 8 bf16 of one 16-byte access.
__device__ __forceinline__ void unpack(uint4 raw, float (&x)[kVector]) {
  unpack_word(raw.x, x[0], x[1]);
  unpack_word(raw.y, x[2], x[3]);
  unpack_word(raw.z, x[4], x[5]);
  unpack_word(raw.w, x[6], x[7]);
}

__device__ __forceinline__ uint4 pack(const float (&x)[kVector]) {
  return make_uint4(pack_word(x[0], x[1]), pack_word(x[2], x[3]), pack_word(x[4], x[5]),
                    pack_word(x[6], x[7]));
}

// A row as [0, head) scalar, [head, tail) 16-byte vectors, [tail, vocab) scalar.
struct RowSplit {
  int head, vectors, tail;
};

__device__ __forceinline__ RowSplit split_row(const bf16* row, int vocab, bool vectorize) {
  if (!vectorize) return {vocab, 0, vocab};
  const int misaligned_bytes = static_cast<int>(reinterpret_cast<std::uintptr_t>(row) % 16);
  const int head = min(vocab, (16 - misaligned_bytes) % 16 / static_cast<int>(sizeof(bf16)));
  const int vectors = (vocab - head) / kVector;
  return {head, vectors, head + vectors * kVector};
}

// The gradient pass over one row: out = (softmax - onehot) * factor, a weight of 0 giving exact
// zeros. Each thread writes the entries it read in the statistics pass (so out may be the logits
// themselves); `vectors` holds the row's 16-byte vectors (the logits, or their copy in shared
// memory).
__device__ __forceinline__ void write_gradient(bf16* out, const bf16* row, const uint4* vectors,
                                               RowSplit split, int vocab, float lse, float factor,
                                               int target) {
  const float lse_log2 = lse * kLog2e;
  auto gradient = [&](float x, int j) {
    const float p = exp_minus(x, lse_log2);
    return j == target ? p * factor - factor : p * factor;
  };
  for (int j = threadIdx.x; j < split.head; j += kRowThreads) {
    out[j] = __float2bfloat16_rn(gradient(__bfloat162float(row[j]), j));
  }
  uint4* out_vectors = reinterpret_cast<uint4*>(out + split.head);
  for (int i = threadIdx.x; i < split.vectors; i += kRowThreads) {
    float x[kVector];
    unpack(vectors[i], x);
    const int j0 = split.head + i * kVector;
    // One comparison a vector for the target; its vector takes the per-entry expression.
    if (static_cast<unsigned>(target - j0) < static_cast<unsigned>(kVector)) {
#pragma unroll
      for (int k = 0; k < kVector; ++k) x[k] = gradient(x[k], j0 + k);
    } else {
#pragma unroll
      for (int k = 0; k < kVector; ++k) x[k] = exp_minus(x[k], lse_log2) * factor;
    }
    out_vectors[i] = pack(x);
  }
  for (int j = split.tail + threadIdx.x; j < vocab; j += kRowThreads) {
    out[j] = __float2bfloat16_rn(gradient(__bfloat162float(row[j]), j));
  }
}

// What both kernels do once a row's (max, sum, argmax) are known: the loss and the prediction
// (thread 0), and with dlogits the gradient. An invalid target has no loss: NaN, for the caller's
// check of the loss to catch, and a NaN gradient row.
__device__ __forceinline__ void finish_row(bf16* dlogits, float* losses, std::int32_t* predictions,
                                           std::int64_t t, const bf16* row, const uint4* vectors,
                                           RowSplit split, int vocab, RowStats s,
                                           float target_logit, int target, float factor) {
  const bool valid_target = target >= 0 && target < vocab;
  const float lse = valid_target ? s.max + logf(s.sum) : __int_as_float(0x7fffffff);
  if (threadIdx.x == 0) {
    losses[t] = lse - target_logit;
    predictions[t] = s.argmax == kNoIndex ? 0 : s.argmax;  // kNoIndex: every logit is NaN
  }
  if (dlogits != nullptr) {
    write_gradient(dlogits + t * vocab, row, vectors, split, vocab, lse, factor, target);
  }
}

// The logit at the target (0 for an invalid one), read by thread 0 before any barrier: after the
// statistics the row may be overwritten (in place).
__device__ __forceinline__ float read_target_logit(const bf16* row, int target, int vocab) {
  return threadIdx.x == 0 && target >= 0 && target < vocab ? __bfloat162float(row[target]) : 0.0f;
}

// One block per row t, two passes over the logits in global memory: an online (max, sum) as the
// row streams by, then the gradient (the row read again, mostly from L2). vectorize: dlogits
// (when written) has the same alignment modulo 16 bytes as logits, so both rows split at the
// same indices. For any vocabulary; cross_entropy_staged_kernel is the faster path where a row
// fits in shared memory.
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_kernel(bf16* dlogits, float* losses, std::int32_t* predictions,
                         const bf16* logits, const std::int32_t* targets, const float* weights,
                         int vocab, double scale, bool vectorize) {
  __shared__ RowStats shared[kRowWarps + 1];
  const std::int64_t t = blockIdx.x;
  const bf16* row = logits + t * vocab;
  const int target = targets[t];
  const float target_logit = read_target_logit(row, target, vocab);

  const RowSplit split = split_row(row, vocab, vectorize);
  RowStats s = empty_stats();
  for (int j = threadIdx.x; j < split.head; j += kRowThreads) {
    add_logit(s, __bfloat162float(row[j]), j);
  }
  const uint4* vectors = reinterpret_cast<const uint4*>(row + split.head);
  for (int i = threadIdx.x; i < split.vectors; i += kRowThreads) {
    float x[kVector];
    unpack(vectors[i], x);
    add_logits(s, x, split.head + i * kVector);
  }
  for (int j = split.tail + threadIdx.x; j < vocab; j += kRowThreads) {
    add_logit(s, __bfloat162float(row[j]), j);
  }
  s = reduce_block(s, shared);
  finish_row(dlogits, losses, predictions, t, row, vectors, split, vocab, s, target_logit, target,
             static_cast<float>(static_cast<double>(weights[t]) * scale));
}

// The largest of two bf16 pairs' four values as a pair (max.bf16x2: a NaN loses to any number).
__device__ __forceinline__ unsigned max_pair(unsigned a, unsigned b) {
  __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a);
  const __nv_bfloat162 y = *reinterpret_cast<__nv_bfloat162*>(&b);
  x = __hmax2(x, y);
  return *reinterpret_cast<unsigned*>(&x);
}

// One block per row t with the row's vectors copied into shared memory (cp.async), so that it is
// read from device memory once and the statistics take three cheap passes over the copy instead
// of one online pass: the row's max (packed bf16 maxima, no exponential), then sum exp(x - max)
// (one exponential and one add an entry, where the online form also compares and rescales), with
// the argmax searched only by the threads whose own maximum is the row's; then the gradient.
// Needs split_row's vectors (the host launches it when dlogits and logits align alike) and
// vocab / kVector * 16 bytes of dynamic shared memory. The sums differ from the online kernel's
// in rounding only (exp(x - max) against the row's max rather than each thread's running one).
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_staged_kernel(bf16* dlogits, float* losses, std::int32_t* predictions,
                                const bf16* logits, const std::int32_t* targets,
                                const float* weights, int vocab, double scale) {
  extern __shared__ uint4 staged[];
  __shared__ RowStats shared[kRowWarps + 1];
  const std::int64_t t = blockIdx.x;
  const bf16* row = logits + t * vocab;
  const int target = targets[t];
  const float target_logit = read_target_logit(row, target, vocab);
  const RowSplit split = split_row(row, vocab, true);
  const uint4* vectors = reinterpret_cast<const uint4*>(row + split.head);
  // Each thread copies, and later reads, only its own vectors: its wait is all it needs.
  for (int i = threadIdx.x; i < split.vectors; i += kRowThreads) {
    cuda_detail::cp_async_16(staged + i, vectors + i, true);
  }
  cuda_detail::cp_async_commit();
  cuda_detail::cp_async_wait<0>();

  // The row's max. The scalar head and tail are read from the logits in every pass.
  float mine = -INFINITY;
  for (int j = threadIdx.x; j < split.head; j += kRowThreads) {
    mine = fmaxf(mine, __bfloat162float(row[j]));
  }
  unsigned pair = 0xff80ff80u;  // (-inf, -inf)
  for (int i = threadIdx.x; i < split.vectors; i += kRowThreads) {
    const uint4 raw = staged[i];
    pair = max_pair(pair, max_pair(max_pair(raw.x, raw.y), max_pair(raw.z, raw.w)));
  }
  {
    float low, high;
    unpack_word(pair, low, high);
    mine = fmaxf(mine, fmaxf(low, high));
  }
  for (int j = split.tail + threadIdx.x; j < vocab; j += kRowThreads) {
    mine = fmaxf(mine, __bfloat162float(row[j]));
  }
  const float max = reduce_block({mine, 0.0f, kNoIndex}, shared).max;  // never NaN

  // sum exp(x - max). An infinite max (a +inf logit, or none above -inf) takes add_logit's rule:
  // 1 where x equals it, exp(x - max) elsewhere.
  const bool finite_max = isfinite(max);
  const float max_log2 = max * kLog2e;
  const auto term = [&](float x) {
    return finite_max ? exp_minus(x, max_log2) : x == max ? 1.0f : exp_fast(x - max);
  };
  float sum = 0.0f;
  for (int j = threadIdx.x; j < split.head; j += kRowThreads) sum += term(__bfloat162float(row[j]));
  for (int i = threadIdx.x; i < split.vectors; i += kRowThreads) {
    float x[kVector];
    unpack(staged[i], x);
    if (finite_max) {
#pragma unroll
      for (int k = 0; k < kVector; ++k) sum += exp_minus(x[k], max_log2);
    } else {
#pragma unroll
      for (int k = 0; k < kVector; ++k) sum += term(x[k]);
    }
  }
  for (int j = split.tail + threadIdx.x; j < vocab; j += kRowThreads) {
    sum += term(__bfloat162float(row[j]));
  }
  // The first index holding the max, among this thread's entries in index order (head, vectors,
  // tail), where its own max is the row's.
  int argmax = kNoIndex;
  if (mine == max) {
    for (int j = threadIdx.x; j < split.head && argmax == kNoIndex; j += kRowThreads) {
      if (__bfloat162float(row[j]) == max) argmax = j;
    }
    for (int i = threadIdx.x; i < split.vectors && argmax == kNoIndex; i += kRowThreads) {
      float x[kVector];
      unpack(staged[i], x);
#pragma unroll
      for (int k = kVector - 1; k >= 0; --k) {
        if (x[k] == max) argmax = split.head + i * kVector + k;
      }
    }
    for (int j = split.tail + threadIdx.x; j < vocab && argmax == kNoIndex; j += kRowThreads) {
      if (__bfloat162float(row[j]) == max) argmax = j;
    }
  }
  // Every thread's statistics share the max: the tree adds the sums and keeps the least index.
  const RowStats s = reduce_block({max, sum, argmax}, shared);
  finish_row(dlogits, losses, predictions, t, row, staged, split, vocab, s, target_logit, target,
             static_cast<float>(static_cast<double>(weights[t]) * scale));
}

// ---- sum of squares --------------------------------------------------------------------------

constexpr int kSumThreads = 256;
constexpr int kSumWarps = kSumThreads / 32;
// At most 1024 partial sums (8 KiB back to the host); at least 16384 elements per block, so a
// small tensor is not spread over blocks that would each read a few elements.
constexpr std::int64_t kSumMaxBlocks = SumOfSquaresScratch::kPartials;
constexpr std::int64_t kSumMinBlockElements = 16384;

// Block b sums [b * chunk, min(count, (b + 1) * chunk)): each thread in double over a fixed
// stride of elements, then a fixed tree over the threads. The squares of floats are exact in
// double.
__global__ void __launch_bounds__(kSumThreads)
    sum_of_squares_kernel(double* partials, const float* grads, std::int64_t count,
                          std::int64_t chunk) {
  __shared__ double shared[kSumWarps];
  const std::int64_t begin = blockIdx.x * chunk;
  const std::int64_t end = min(begin + chunk, count);
  double sum = 0.0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += kSumThreads) {
    const double g = grads[i];
    sum += g * g;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (lane == 0) shared[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < kSumWarps ? shared[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += __shfl_down_sync(0xffffffffu, sum, offset);
    }
    if (lane == 0) partials[blockIdx.x] = sum;
  }
}

// One thread: the partials summed in order in double, as sum_of_squares sums them on the host
// (the same additions: the same total), and cpu::step_clip_factor of that total (the host's
// function, compiled for the device: the test holds the two to the bit).
__global__ void clip_factor_kernel(double* total, float* factor, const double* partials,
                                   std::int64_t blocks, double max_norm) {
  double sum = 0.0;
  for (std::int64_t b = 0; b < blocks; ++b) sum += partials[b];
  *total = sum;
  *factor = cpu::step_clip_factor(sum, max_norm);
}

// ---- AdamW -----------------------------------------------------------------------------------

constexpr int kStepThreads = 256;
constexpr int kStepTile = 8 * kStepThreads;      // the elements a block steps at a time
constexpr std::int64_t kStepMaxBlocks = 65535;  // the grid-stride loop covers the rest
constexpr int kStepSegments = 64;                // segments a launch

// The segments of one launch: segment j is [end[j - 1], end[j]) (end[-1] = 0), decayed where bit
// j of decay is set.
struct StepSegments {
  std::int64_t end[kStepSegments];
  std::uint64_t decay;
  int count;
};

// cpu::adamw_update, element by element, with the scalars of its segment (the same scalars, the
// same rounding: the result is the CPU twin's to the bit). Each thread steps groups of V
// consecutive elements, read and written in 16-byte vectors at V = 4 (8-byte ones for the bf16
// copy); a group that the end cuts short goes element by element.
template <int V>
__global__ void __launch_bounds__(kStepThreads)
    adamw_kernel(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                 std::int64_t count, StepSegments segments, cpu::AdamWScalars decayed,
                 cpu::AdamWScalars undecayed, const float* device_grad_scale) {
  // The two sets of scalars differ in `keep` only: one copy in registers, its keep chosen per
  // element. A multiplier on the device replaces theirs; one that is not finite skips the step.
  cpu::AdamWScalars s = decayed;
  if (device_grad_scale != nullptr) {
    s.grad_scale = *device_grad_scale;
    if (!isfinite(s.grad_scale)) return;
  }
  __shared__ std::int64_t end[kStepSegments];
  for (int j = threadIdx.x; j < segments.count; j += kStepThreads) end[j] = segments.end[j];
  __syncthreads();
  for (std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kStepTile; first < count;
       first += static_cast<std::int64_t>(gridDim.x) * kStepTile) {
    // The segment of the tile's first element: the first whose end lies past it.
    int seg = 0;
    for (int hi = segments.count - 1; seg < hi;) {
      const int mid = (seg + hi) / 2;
      if (end[mid] > first) {
        hi = mid;
      } else {
        seg = mid + 1;
      }
    }
    const auto keep_of = [&](std::int64_t i) {
      while (end[seg] <= i) ++seg;
      return (segments.decay >> seg) & 1u ? decayed.keep : undecayed.keep;
    };
#pragma unroll
    for (int k = 0; k < kStepTile / (kStepThreads * V); ++k) {
      const std::int64_t i = first + (k * kStepThreads + threadIdx.x) * V;
      if (i >= count) break;
      if (V == 1 || i + V > count) {
        for (std::int64_t e = i; e < count && e < i + V; ++e) {
          s.keep = keep_of(e);
          const float p = cpu::adamw_update(params, grads, m, v, e, s);
          if (params_bf16 != nullptr) params_bf16[e] = __float2bfloat16_rn(p);
        }
        continue;
      }
      if constexpr (V == 4) {
        float4 p4 = *reinterpret_cast<const float4*>(params + i);
        const float4 g4 = *reinterpret_cast<const float4*>(grads + i);
        float4 m4 = *reinterpret_cast<const float4*>(m + i);
        float4 v4 = *reinterpret_cast<const float4*>(v + i);
        float p[4] = {p4.x, p4.y, p4.z, p4.w}, mv[4] = {m4.x, m4.y, m4.z, m4.w};
        float vv[4] = {v4.x, v4.y, v4.z, v4.w};
        const float g[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s.keep = keep_of(i + e);
          cpu::adamw_update(p, g, mv, vv, e, s);
        }
        *reinterpret_cast<float4*>(params + i) = make_float4(p[0], p[1], p[2], p[3]);
        *reinterpret_cast<float4*>(m + i) = make_float4(mv[0], mv[1], mv[2], mv[3]);
        *reinterpret_cast<float4*>(v + i) = make_float4(vv[0], vv[1], vv[2], vv[3]);
        if (params_bf16 != nullptr) {
          const __nv_bfloat162 lo = __floats2bfloat162_rn(p[0], p[1]);
          const __nv_bfloat162 hi = __floats2bfloat162_rn(p[2], p[3]);
          uint2 packed;
          packed.x = *reinterpret_cast<const std::uint32_t*>(&lo);
          packed.y = *reinterpret_cast<const std::uint32_t*>(&hi);
          *reinterpret_cast<uint2*>(params_bf16 + i) = packed;
        }
      }
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------

// One block per token (the grid's x dimension); int indices within a row, with room for the
// loop strides.
constexpr std::int64_t kMaxTokens = std::numeric_limits<std::int32_t>::max();
constexpr std::int64_t kMaxVocab = std::int64_t{1} << 30;

void check_pointer(const char* where, const char* name, const void* pointer,
                   const char* memory = "device") {
  if (pointer == nullptr)
    ringattn::detail::fail(where, name, " is null; expected ", memory, " memory");
}

// The checks and the kernel of a cross-entropy call, queued on the stream (dlogits null: the
// forward alone).
void launch_cross_entropy(const char* where, bf16* dlogits, float* losses,
                          std::int32_t* predictions, const bf16* logits,
                          const std::int32_t* targets, const float* weights,
                          const cpu::CrossEntropyShape& s, double scale, const float* host_weights,
                          cudaStream_t stream) {
  const bool backward = dlogits != nullptr;
  train::detail::check_positive(where, "shape.tokens", s.tokens);
  train::detail::check_positive(where, "shape.vocab", s.vocab);
  if (s.tokens > kMaxTokens) {
    ringattn::detail::fail(where, "shape.tokens is ", s.tokens, "; expected at most ", kMaxTokens);
  }
  if (s.vocab > kMaxVocab) {
    ringattn::detail::fail(where, "shape.vocab is ", s.vocab, "; expected at most ", kMaxVocab);
  }
  check_pointer(where, "losses", losses);
  check_pointer(where, "predictions", predictions);
  check_pointer(where, "logits", logits);
  check_pointer(where, "targets", targets);
  check_pointer(where, "weights", weights);
  check_pointer(where, "host_weights", host_weights, "host");
  if (backward) {
    if (!std::isfinite(scale)) {
      ringattn::detail::fail(where, "scale is ", scale, "; expected a finite value");
    }
    // The same memory is the in-place gradient; a partial overlap would be overwritten before it
    // is read.
    const std::uintptr_t bytes = static_cast<std::uintptr_t>(s.tokens * s.vocab) * sizeof(bf16);
    const auto out = reinterpret_cast<std::uintptr_t>(dlogits);
    const auto in = reinterpret_cast<std::uintptr_t>(logits);
    if (out != in && out < in + bytes && in < out + bytes) {
      ringattn::detail::fail(where, "dlogits overlaps logits without being the same memory");
    }
  }
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    if (!(host_weights[t] >= 0.0f) || !std::isfinite(host_weights[t])) {
      ringattn::detail::fail(where, "host_weights[", t, "] is ", host_weights[t],
                             "; expected a finite value >= 0");
    }
  }

  const dim3 grid(static_cast<unsigned>(s.tokens));
  const int vocab = static_cast<int>(s.vocab);
  // Vector accesses need both rows to split at the same indices.
  const bool vectorize = !backward || reinterpret_cast<std::uintptr_t>(logits) % 16 ==
                                          reinterpret_cast<std::uintptr_t>(dlogits) % 16;
  const std::size_t staged_bytes = static_cast<std::size_t>(vocab / kVector) * sizeof(uint4);
  if (vectorize && staged_bytes <= kStagedRowMaxBytes) {
    // Per call: the attribute belongs to the current device.
    RINGATTN_CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_staged_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(staged_bytes)));
    cross_entropy_staged_kernel<<<grid, kRowThreads, staged_bytes, stream>>>(
        dlogits, losses, predictions, logits, targets, weights, vocab, scale);
  } else {
    cross_entropy_kernel<<<grid, kRowThreads, 0, stream>>>(
        dlogits, losses, predictions, logits, targets, weights, vocab, scale, vectorize);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

// launch_cross_entropy, then the losses back to the host and their sums.
cpu::CrossEntropySums run_cross_entropy(const char* where, bf16* dlogits, float* losses,
                                        std::int32_t* predictions, const bf16* logits,
                                        const std::int32_t* targets, const float* weights,
                                        const cpu::CrossEntropyShape& s, double scale,
                                        float* host_losses, const float* host_weights,
                                        cudaStream_t stream) {
  check_pointer(where, "host_losses", host_losses, "host");
  launch_cross_entropy(where, dlogits, losses, predictions, logits, targets, weights, s, scale,
                       host_weights, stream);
  const auto tokens = static_cast<std::size_t>(s.tokens);
  RINGATTN_CUDA_CHECK(
      cudaMemcpyAsync(host_losses, losses, tokens * sizeof(float), cudaMemcpyDeviceToHost, stream));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  return cpu::cross_entropy_sums<float>({host_losses, tokens}, {host_weights, tokens});
}

// Device memory from the stream-ordered allocator for the span of one call, returned on the
// stream when the owner goes out of scope.
class StreamAllocation {
 public:
  StreamAllocation(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    RINGATTN_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
  }
  StreamAllocation(const StreamAllocation&) = delete;
  StreamAllocation& operator=(const StreamAllocation&) = delete;
  ~StreamAllocation() { RINGATTN_CUDA_LOG(cudaFreeAsync(data_, stream_)); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

std::int64_t sum_of_squares_blocks(std::int64_t count) {
  const std::int64_t blocks = (count + kSumMinBlockElements - 1) / kSumMinBlockElements;
  return std::clamp<std::int64_t>(blocks, 1, kSumMaxBlocks);
}

// sum_of_squares_kernel's partials of grads[0, count) into `partials`, queued; returns how many.
std::int64_t queue_sum_partials(double* partials, const float* grads, std::int64_t count,
                                cudaStream_t stream) {
  const std::int64_t blocks = sum_of_squares_blocks(count);
  const std::int64_t chunk = (count + blocks - 1) / blocks;
  sum_of_squares_kernel<<<static_cast<unsigned>(blocks), kSumThreads, 0, stream>>>(
      partials, grads, count, chunk);
  RINGATTN_CUDA_CHECK_LAUNCH();
  return blocks;
}

}  // namespace

cpu::CrossEntropySums cross_entropy_forward(float* losses, std::int32_t* predictions,
                                            const bf16* logits, const std::int32_t* targets,
                                            const float* weights,
                                            const cpu::CrossEntropyShape& shape, float* host_losses,
                                            const float* host_weights, cudaStream_t stream) {
  return run_cross_entropy("train::cuda::cross_entropy_forward", nullptr, losses, predictions,
                           logits, targets, weights, shape, 0.0, host_losses, host_weights, stream);
}

cpu::CrossEntropySums cross_entropy_forward_backward(
    bf16* dlogits, float* losses, std::int32_t* predictions, const bf16* logits,
    const std::int32_t* targets, const float* weights, const cpu::CrossEntropyShape& shape,
    double scale, float* host_losses, const float* host_weights, cudaStream_t stream) {
  check_pointer("train::cuda::cross_entropy_forward_backward", "dlogits", dlogits);
  return run_cross_entropy("train::cuda::cross_entropy_forward_backward", dlogits, losses,
                           predictions, logits, targets, weights, shape, scale, host_losses,
                           host_weights, stream);
}

void cross_entropy_queue(bf16* dlogits, float* losses, std::int32_t* predictions,
                         const bf16* logits, const std::int32_t* targets, const float* weights,
                         const cpu::CrossEntropyShape& shape, double scale,
                         const float* host_weights, cudaStream_t stream) {
  launch_cross_entropy("train::cuda::cross_entropy_queue", dlogits, losses, predictions, logits,
                       targets, weights, shape, scale, host_weights, stream);
}

double sum_of_squares(const float* grads, std::int64_t count, cudaStream_t stream,
                      const SumOfSquaresScratch* scratch) {
  constexpr const char* kWhere = "train::cuda::sum_of_squares";
  check_pointer(kWhere, "grads", grads);
  train::detail::check_positive(kWhere, "count", count);
  if (scratch != nullptr) {
    check_pointer(kWhere, "scratch->device", scratch->device);
    check_pointer(kWhere, "scratch->host", scratch->host, "page-locked host");
  }

  const std::int64_t blocks = sum_of_squares_blocks(count);
  const auto bytes = static_cast<std::size_t>(blocks) * sizeof(double);
  std::vector<double> pageable;
  double* partials = scratch != nullptr ? scratch->host : nullptr;
  if (partials == nullptr) {
    pageable.resize(static_cast<std::size_t>(blocks));
    partials = pageable.data();
  }
  const auto queue = [&](double* device_partials) {
    queue_sum_partials(device_partials, grads, count, stream);
    RINGATTN_CUDA_CHECK(
        cudaMemcpyAsync(partials, device_partials, bytes, cudaMemcpyDeviceToHost, stream));
  };
  if (scratch != nullptr) {
    queue(scratch->device);
  } else {
    const StreamAllocation device_partials(bytes, stream);
    queue(device_partials.as<double>());
  }
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  double total = 0.0;
  for (std::int64_t b = 0; b < blocks; ++b) total += partials[b];
  return total;
}

void queue_clip_factor(const float* grads, std::int64_t count, double max_norm,
                       const SumOfSquaresScratch& scratch, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::queue_clip_factor";
  check_pointer(kWhere, "grads", grads);
  train::detail::check_positive(kWhere, "count", count);
  check_pointer(kWhere, "scratch.device", scratch.device);
  check_pointer(kWhere, "scratch.host", scratch.host, "page-locked host");
  check_pointer(kWhere, "scratch.total", scratch.total);
  check_pointer(kWhere, "scratch.factor", scratch.factor);
  if (std::isnan(max_norm)) ringattn::detail::fail(kWhere, "max_norm is nan; expected a number");
  const std::int64_t blocks = queue_sum_partials(scratch.device, grads, count, stream);
  clip_factor_kernel<<<1, 1, 0, stream>>>(scratch.total, scratch.factor, scratch.device, blocks,
                                          max_norm);
  RINGATTN_CUDA_CHECK_LAUNCH();
  RINGATTN_CUDA_CHECK(
      cudaMemcpyAsync(scratch.host, scratch.total, sizeof(double), cudaMemcpyDeviceToHost, stream));
}

void adamw_step(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                std::int64_t count, const cpu::AdamWHyper& h, std::int64_t step,
                cpu::WeightDecay decay, float grad_scale, cudaStream_t stream) {
  train::detail::check_positive("train::cuda::adamw_step", "count", count);
  const cpu::AdamWSegment whole{count, decay};
  adamw_step(params, params_bf16, grads, m, v, {&whole, 1}, h, step, grad_scale, stream);
}

namespace {

void launch_adamw(const char* where, float* params, bf16* params_bf16, const float* grads,
                  float* m, float* v, std::span<const cpu::AdamWSegment> segments,
                  const cpu::AdamWHyper& h, std::int64_t step, float grad_scale,
                  const float* device_grad_scale, cudaStream_t stream) {
  check_pointer(where, "params", params);
  check_pointer(where, "grads", grads);
  check_pointer(where, "m", m);
  check_pointer(where, "v", v);
  if (segments.empty()) ringattn::detail::fail(where, "segments is empty; expected one or more");
  for (std::size_t j = 0; j < segments.size(); ++j) {
    if (segments[j].count <= 0) {
      ringattn::detail::fail(where, "segments[", j, "].count is ", segments[j].count,
                             "; expected > 0");
    }
  }
  // The scalars exactly as cpu::adamw_step forms them (the same function), checks included.
  const cpu::AdamWScalars decayed =
      cpu::adamw_scalars(where, h, step, cpu::WeightDecay::apply, grad_scale);
  const cpu::AdamWScalars undecayed =
      cpu::adamw_scalars(where, h, step, cpu::WeightDecay::skip, grad_scale);
  std::int64_t offset = 0;
  for (std::size_t first = 0; first < segments.size(); first += kStepSegments) {
    StepSegments launch{};
    std::int64_t count = 0;
    for (std::size_t j = first; j < std::min(segments.size(), first + kStepSegments); ++j) {
      count += segments[j].count;
      launch.end[launch.count] = count;
      if (segments[j].decay == cpu::WeightDecay::apply) {
        launch.decay |= std::uint64_t{1} << launch.count;
      }
      ++launch.count;
    }
    const std::int64_t blocks = std::min((count + kStepTile - 1) / kStepTile, kStepMaxBlocks);
    bf16* copy = params_bf16 != nullptr ? params_bf16 + offset : nullptr;
    const auto aligned = [](const void* pointer, std::uintptr_t bytes) {
      return reinterpret_cast<std::uintptr_t>(pointer) % bytes == 0;
    };
    if (aligned(params + offset, 16) && aligned(grads + offset, 16) && aligned(m + offset, 16) &&
        aligned(v + offset, 16) && aligned(copy, 8)) {
      adamw_kernel<4><<<static_cast<unsigned>(blocks), kStepThreads, 0, stream>>>(
          params + offset, copy, grads + offset, m + offset, v + offset, count, launch, decayed,
          undecayed, device_grad_scale);
    } else {
      adamw_kernel<1><<<static_cast<unsigned>(blocks), kStepThreads, 0, stream>>>(
          params + offset, copy, grads + offset, m + offset, v + offset, count, launch, decayed,
          undecayed, device_grad_scale);
    }
    RINGATTN_CUDA_CHECK_LAUNCH();
    offset += count;
  }
}

}  // namespace

void adamw_step(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& h,
                std::int64_t step, float grad_scale, cudaStream_t stream) {
  launch_adamw("train::cuda::adamw_step", params, params_bf16, grads, m, v, segments, h, step,
               grad_scale, nullptr, stream);
}

void adamw_step_clipped(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                        std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& h,
                        std::int64_t step, const float* factor, cudaStream_t stream) {
  check_pointer("train::cuda::adamw_step_clipped", "factor", factor);
  launch_adamw("train::cuda::adamw_step_clipped", params, params_bf16, grads, m, v, segments, h,
               step, 1.0f, factor, stream);
}

}  // namespace ringattn::train::cuda
