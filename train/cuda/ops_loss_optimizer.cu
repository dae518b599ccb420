// The loss and optimizer ops of train/cuda/ops.hpp: softmax cross-entropy fused with its
// gradient, the sum of squares of gradient clipping, and the AdamW step. The CPU twins
// (train/op_cross_entropy, train/op_adamw) define the math.
//
// Cross-entropy runs one block per token row and reads the row twice: once for its statistics
// (an online max / sum of exponentials in fp32, with the argmax), then, after a barrier, once
// more to write the gradient. Every element of the second pass is read and written by the same
// thread, so the gradient can overwrite the logits in place. Rows are read in 16-byte vectors
// between a scalar head (up to the row's first 16-byte boundary) and a scalar tail: vocab need
// not be a multiple of anything. The losses come back to the host, where the sums are formed in
// token order in double, as the CPU twin forms them.
//
// sum_of_squares: a grid that depends only on the element count, each block summing a fixed
// range in double; the block partials are added on the host in order (bitwise reproducible).
//
// adamw_step: elementwise, the CPU twin's fp32 expression operation for operation.
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

// exp(a) as ex2.approx(a * log2(e)) (__expf): two instructions where expf takes several, the
// kernel's arithmetic being most of its time. Relative error about 2^-21 plus |a| 2^-24 from the
// rounded product, which only matters for terms below e^-16 of the row's largest: the row's sum
// and the probabilities stay within ~1e-6 of the exact ones. exp(-inf) = 0, exp(NaN) = NaN.
__device__ __forceinline__ float exp_fast(float a) {
  return __expf(a);
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
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(low))) |
         static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(high))) << 16;
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

// One block per row t. vectorize: dlogits (when written) has the same alignment modulo 16 bytes
// as logits, so both rows split at the same indices.
template <bool kBackward>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_kernel(bf16* dlogits, float* losses, std::int32_t* predictions,
                         const bf16* logits, const std::int32_t* targets, const float* weights,
                         int vocab, double scale, bool vectorize) {
  __shared__ RowStats shared[kRowWarps + 1];
  const std::int64_t t = blockIdx.x;
  const bf16* row = logits + t * vocab;
  const int target = targets[t];
  const bool valid_target = target >= 0 && target < vocab;
  // Read before the barrier in reduce_block: after it, the row may be overwritten (in place).
  float target_logit = 0.0f;
  if (threadIdx.x == 0 && valid_target) target_logit = __bfloat162float(row[target]);

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

  // An invalid target has no loss: NaN, for the caller's check of the loss to catch, and a NaN
  // gradient row.
  const float lse = valid_target ? s.max + logf(s.sum) : __int_as_float(0x7fffffff);
  if (threadIdx.x == 0) {
    losses[t] = lse - target_logit;
    predictions[t] = s.argmax == kNoIndex ? 0 : s.argmax;  // kNoIndex: every logit is NaN
  }
  if constexpr (kBackward) {
    const float factor = static_cast<float>(static_cast<double>(weights[t]) * scale);
    bf16* out = dlogits + t * vocab;
    // (softmax - onehot) * factor; a weight of 0 gives exact zeros.
    auto gradient = [&](float x, int j) {
      const float p = exp_fast(x - lse);
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
#pragma unroll
      for (int k = 0; k < kVector; ++k) x[k] = gradient(x[k], j0 + k);
      out_vectors[i] = pack(x);
    }
    for (int j = split.tail + threadIdx.x; j < vocab; j += kRowThreads) {
      out[j] = __float2bfloat16_rn(gradient(__bfloat162float(row[j]), j));
    }
  }
}

// ---- sum of squares --------------------------------------------------------------------------

constexpr int kSumThreads = 256;
constexpr int kSumWarps = kSumThreads / 32;
// At most 1024 partial sums (8 KiB back to the host); at least 16384 elements per block, so a
// small tensor is not spread over blocks that would each read a few elements.
constexpr std::int64_t kSumMaxBlocks = 1024;
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
// same rounding: the result is the CPU twin's to the bit).
__global__ void __launch_bounds__(kStepThreads)
    adamw_kernel(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                 std::int64_t count, StepSegments segments, cpu::AdamWScalars decayed,
                 cpu::AdamWScalars undecayed) {
  __shared__ std::int64_t end[kStepSegments];
  for (int j = threadIdx.x; j < segments.count; j += kStepThreads) end[j] = segments.end[j];
  __syncthreads();
  // The two sets of scalars differ in `keep` only: one copy in registers, its keep chosen per
  // element.
  cpu::AdamWScalars s = decayed;
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
#pragma unroll
    for (int k = 0; k < kStepTile / kStepThreads; ++k) {
      const std::int64_t i = first + k * kStepThreads + threadIdx.x;
      if (i >= count) break;
      while (end[seg] <= i) ++seg;
      s.keep = (segments.decay >> seg) & 1u ? decayed.keep : undecayed.keep;
      const float p = cpu::adamw_update(params, grads, m, v, i, s);
      if (params_bf16 != nullptr) params_bf16[i] = __float2bfloat16_rn(p);
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

// backward = false: the forward alone (dlogits and scale unused).
cpu::CrossEntropySums run_cross_entropy(const char* where, bool backward, bf16* dlogits,
                                        float* losses, std::int32_t* predictions,
                                        const bf16* logits, const std::int32_t* targets,
                                        const float* weights, const cpu::CrossEntropyShape& s,
                                        double scale, float* host_losses, const float* host_weights,
                                        cudaStream_t stream) {
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
  check_pointer(where, "host_losses", host_losses, "host");
  check_pointer(where, "host_weights", host_weights, "host");
  if (backward) {
    check_pointer(where, "dlogits", dlogits);
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
  if (backward) {
    // Vector accesses need both rows to split at the same indices.
    const bool vectorize = reinterpret_cast<std::uintptr_t>(logits) % 16 ==
                           reinterpret_cast<std::uintptr_t>(dlogits) % 16;
    cross_entropy_kernel<true><<<grid, kRowThreads, 0, stream>>>(
        dlogits, losses, predictions, logits, targets, weights, vocab, scale, vectorize);
  } else {
    cross_entropy_kernel<false><<<grid, kRowThreads, 0, stream>>>(
        nullptr, losses, predictions, logits, targets, weights, vocab, 0.0, true);
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(host_losses, losses,
                                      static_cast<std::size_t>(s.tokens) * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));

  // In token order, in double, as the CPU twin sums.
  cpu::CrossEntropySums sums;
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    sums.loss_sum += double(host_weights[t]) * double(host_losses[t]);
    sums.weight_sum += double(host_weights[t]);
  }
  return sums;
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

}  // namespace

cpu::CrossEntropySums cross_entropy_forward(float* losses, std::int32_t* predictions,
                                            const bf16* logits, const std::int32_t* targets,
                                            const float* weights,
                                            const cpu::CrossEntropyShape& shape, float* host_losses,
                                            const float* host_weights, cudaStream_t stream) {
  return run_cross_entropy("train::cuda::cross_entropy_forward", false, nullptr, losses,
                           predictions, logits, targets, weights, shape, 0.0, host_losses,
                           host_weights, stream);
}

cpu::CrossEntropySums cross_entropy_forward_backward(
    bf16* dlogits, float* losses, std::int32_t* predictions, const bf16* logits,
    const std::int32_t* targets, const float* weights, const cpu::CrossEntropyShape& shape,
    double scale, float* host_losses, const float* host_weights, cudaStream_t stream) {
  return run_cross_entropy("train::cuda::cross_entropy_forward_backward", true, dlogits, losses,
                           predictions, logits, targets, weights, shape, scale, host_losses,
                           host_weights, stream);
}

double sum_of_squares(const float* grads, std::int64_t count, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::sum_of_squares";
  check_pointer(kWhere, "grads", grads);
  train::detail::check_positive(kWhere, "count", count);

  const std::int64_t blocks = sum_of_squares_blocks(count);
  const std::int64_t chunk = (count + blocks - 1) / blocks;
  const auto bytes = static_cast<std::size_t>(blocks) * sizeof(double);
  std::vector<double> partials(static_cast<std::size_t>(blocks));
  {
    const StreamAllocation device_partials(bytes, stream);
    sum_of_squares_kernel<<<static_cast<unsigned>(blocks), kSumThreads, 0, stream>>>(
        device_partials.as<double>(), grads, count, chunk);
    RINGATTN_CUDA_CHECK_LAUNCH();
    RINGATTN_CUDA_CHECK(cudaMemcpyAsync(partials.data(), device_partials.as<double>(), bytes,
                                        cudaMemcpyDeviceToHost, stream));
  }
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  double total = 0.0;
  for (const double partial : partials) total += partial;
  return total;
}

void adamw_step(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                std::int64_t count, const cpu::AdamWHyper& h, std::int64_t step,
                cpu::WeightDecay decay, float grad_scale, cudaStream_t stream) {
  train::detail::check_positive("train::cuda::adamw_step", "count", count);
  const cpu::AdamWSegment whole{count, decay};
  adamw_step(params, params_bf16, grads, m, v, {&whole, 1}, h, step, grad_scale, stream);
}

void adamw_step(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& h,
                std::int64_t step, float grad_scale, cudaStream_t stream) {
  constexpr const char* kWhere = "train::cuda::adamw_step";
  check_pointer(kWhere, "params", params);
  check_pointer(kWhere, "grads", grads);
  check_pointer(kWhere, "m", m);
  check_pointer(kWhere, "v", v);
  if (segments.empty()) ringattn::detail::fail(kWhere, "segments is empty; expected one or more");
  for (std::size_t j = 0; j < segments.size(); ++j) {
    if (segments[j].count <= 0) {
      ringattn::detail::fail(kWhere, "segments[", j, "].count is ", segments[j].count,
                             "; expected > 0");
    }
  }
  // The scalars exactly as cpu::adamw_step forms them (the same function), checks included.
  const cpu::AdamWScalars decayed =
      cpu::adamw_scalars(kWhere, h, step, cpu::WeightDecay::apply, grad_scale);
  const cpu::AdamWScalars undecayed =
      cpu::adamw_scalars(kWhere, h, step, cpu::WeightDecay::skip, grad_scale);
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
    adamw_kernel<<<static_cast<unsigned>(blocks), kStepThreads, 0, stream>>>(
        params + offset, params_bf16 != nullptr ? params_bf16 + offset : nullptr, grads + offset,
        m + offset, v + offset, count, launch, decayed, undecayed);
    RINGATTN_CUDA_CHECK_LAUNCH();
    offset += count;
  }
}

}  // namespace ringattn::train::cuda
