// The ring's element-wise operations on the device: fill, convert-copy and add over strided views
// of rank <= 4. Memory-bound and tiny next to the block; one thread per element in a grid-stride
// loop, indices decomposed from a linear index (64-bit: a shard may exceed 2^31 elements).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "parallel/local_block.hpp"
#include "ringattn/error.hpp"
#include "src/cuda/cuda_check.hpp"

namespace ringattn::detail::device {
namespace {

// 256 threads a block: full occupancy on sm_80/sm_90 for a kernel of a few registers; the grid
// is capped because the loop strides over the rest.
constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 65535;

struct Index4 {
  std::int64_t shape[4];
  std::int64_t strides[4];
};

Index4 index_of(const TensorView& t) {
  Index4 index{{1, 1, 1, 1}, {0, 0, 0, 0}};
  for (int i = 0; i < t.rank; ++i) {
    index.shape[i] = t.shape[i];
    index.strides[i] = t.strides[i];
  }
  return index;
}

__device__ std::int64_t offset_of(const Index4& index, std::int64_t linear) {
  std::int64_t offset = 0;
  for (int axis = 3; axis >= 0; --axis) {
    offset += (linear % index.shape[axis]) * index.strides[axis];
    linear /= index.shape[axis];
  }
  return offset;
}

template <typename T>
__device__ float to_float(T value) {
  return static_cast<float>(value);
}
template <>
__device__ float to_float(__half value) {
  return __half2float(value);
}
template <>
__device__ float to_float(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

// Conversions go through double for f64 and through float otherwise (16-bit results round once,
// to nearest even, as the host conversions of dtype.hpp do). Host and device: fill converts its
// value on the host.
template <typename T>
__host__ __device__ T from_double(double value) {
  return static_cast<T>(value);
}
template <>
__host__ __device__ __half from_double(double value) {
  return __float2half_rn(static_cast<float>(value));
}
template <>
__host__ __device__ __nv_bfloat16 from_double(double value) {
  return __float2bfloat16_rn(static_cast<float>(value));
}
template <typename T>
__device__ double to_double(T value) {
  return static_cast<double>(to_float(value));
}
template <>
__device__ double to_double(double value) {
  return value;
}

template <typename T>
__global__ void fill_kernel(T* data, Index4 index, std::int64_t count, T value) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < count;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    data[offset_of(index, i)] = value;
  }
}

template <typename S, typename D>
__global__ void copy_kernel(const S* src, Index4 src_index, D* dst, Index4 dst_index,
                            std::int64_t count) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < count;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    dst[offset_of(dst_index, i)] = from_double<D>(to_double(src[offset_of(src_index, i)]));
  }
}

template <typename T>
__global__ void add_kernel(const T* src, Index4 src_index, T* dst, Index4 dst_index,
                           std::int64_t count) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < count;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    dst[offset_of(dst_index, i)] += src[offset_of(src_index, i)];
  }
}

unsigned blocks_for(std::int64_t count) {
  const std::int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Calls f(T{}) with T the CUDA type of `dtype`.
template <typename F>
void dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32:
      return f(float{});
    case DType::f64:
      return f(double{});
    case DType::f16:
      return f(__half{});
    case DType::bf16:
      return f(__nv_bfloat16{});
  }
}

}  // namespace

void fill(const TensorView& t, double value, void* stream) {
  const std::int64_t count = t.numel();
  if (count == 0) return;
  dispatch(t.dtype, [&](auto zero) {
    using T = decltype(zero);
    fill_kernel<T><<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        t.as<T>(), index_of(t), count, from_double<T>(value));
  });
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void copy(const TensorView& src, const TensorView& dst, void* stream) {
  const std::int64_t count = src.numel();
  if (count == 0) return;
  dispatch(src.dtype, [&](auto src_zero) {
    using S = decltype(src_zero);
    dispatch(dst.dtype, [&](auto dst_zero) {
      using D = decltype(dst_zero);
      copy_kernel<S, D><<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          src.as<const S>(), index_of(src), dst.as<D>(), index_of(dst), count);
    });
  });
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void add(const TensorView& src, const TensorView& dst, void* stream) {
  const std::int64_t count = src.numel();
  if (count == 0) return;
  auto launch = [&](auto zero) {
    using T = decltype(zero);
    add_kernel<T><<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        src.as<const T>(), index_of(src), dst.as<T>(), index_of(dst), count);
  };
  if (src.dtype == DType::f64) {
    launch(double{});
  } else {
    launch(float{});
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace ringattn::detail::device
