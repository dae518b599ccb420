// The ring's element-wise operations on the device: fill, convert-copy and add over strided views
// of rank <= 4. Memory-bound: the views are first reduced to rows of contiguous elements (adjacent
// axes merged where both views allow), and where the rows and pointers allow, each thread moves 16
// bytes at a time, the row index decomposed in 32 bits where it fits; otherwise one element a
// thread with its index decomposed in 64 bits (a shard may exceed 2^31 elements). Grid-stride
// loops over a capped grid.
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

// The views' axes as four, innermost last: axes of extent 1 dropped, each axis merged into the one
// inside it where every view steps through both as one (the same element order, fewer axes), and
// the rest padded with leading axes of extent 1.
template <int kViews>
void merged_indices(const TensorView* const (&views)[kViews], Index4 (&out)[kViews]) {
  const TensorView& first = *views[0];
  for (Index4& x : out) {
    for (int axis = 0; axis < 4; ++axis) {
      x.shape[axis] = 1;
      x.strides[axis] = 0;
    }
  }
  int inner = 4;  // out's axes [inner, 4) are filled
  for (int from = first.rank - 1; from >= 0; --from) {
    const std::int64_t extent = first.shape[from];
    if (extent == 1) continue;
    bool mergeable = inner < 4;
    for (int v = 0; v < kViews && mergeable; ++v) {
      const Index4& x = out[v];
      mergeable = views[v]->strides[from] == x.shape[inner] * x.strides[inner];
    }
    if (mergeable) {
      for (Index4& x : out) x.shape[inner] *= extent;
      continue;
    }
    --inner;  // at most four axes remain after dropping and merging (the views have rank <= 4)
    for (int v = 0; v < kViews; ++v) {
      out[v].shape[inner] = extent;
      out[v].strides[inner] = views[v]->strides[from];
    }
  }
  // A view of one element, or of axes all of extent 1: one contiguous row.
  if (inner == 4) {
    for (Index4& x : out) x.strides[3] = 1;
  }
}

__device__ std::int64_t offset_of(const Index4& index, std::int64_t linear) {
  std::int64_t offset = 0;
  for (int axis = 3; axis >= 0; --axis) {
    offset += (linear % index.shape[axis]) * index.strides[axis];
    linear /= index.shape[axis];
  }
  return offset;
}

// The offset of row `row` (the three outer axes) of a view whose innermost axis is contiguous,
// the row decomposed in I: 32-bit where the view's vectors fit (a 64-bit division costs several
// times a 32-bit one, and the rows kernels are otherwise a load and a store).
template <typename I>
__device__ std::int64_t row_offset(const Index4& index, I row) {
  const I shape1 = static_cast<I>(index.shape[1]), shape2 = static_cast<I>(index.shape[2]);
  const I i2 = row % shape2;
  row /= shape2;
  return static_cast<std::int64_t>(row / shape1) * index.strides[0] +
         static_cast<std::int64_t>(row % shape1) * index.strides[1] +
         static_cast<std::int64_t>(i2) * index.strides[2];
}

template <typename T, int kWidth>
struct alignas(sizeof(T) * kWidth) Vector {
  T value[kWidth];
};

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

// The same over rows (innermost axis contiguous), kWidth elements a thread: `vectors` is the
// element count / kWidth, and every row holds a whole number of vectors.
template <typename T, int kWidth, typename I>
__global__ void fill_rows_kernel(T* data, Index4 index, I vectors, T value) {
  const I per_row = static_cast<I>(index.shape[3] / kWidth);
  Vector<T, kWidth> v;
#pragma unroll
  for (int k = 0; k < kWidth; ++k) v.value[k] = value;
  for (I i = blockIdx.x * I{blockDim.x} + threadIdx.x; i < vectors; i += I{gridDim.x} * blockDim.x) {
    const I row = i / per_row, column = (i - row * per_row) * kWidth;
    *reinterpret_cast<Vector<T, kWidth>*>(data + row_offset(index, row) + column) = v;
  }
}

// dst = src converted, or with kAdd (S and D the same type) dst += src.
template <typename S, typename D, int kWidth, bool kAdd, typename I>
__global__ void copy_rows_kernel(const S* src, Index4 src_index, D* dst, Index4 dst_index,
                                 I vectors) {
  const I per_row = static_cast<I>(src_index.shape[3] / kWidth);
  for (I i = blockIdx.x * I{blockDim.x} + threadIdx.x; i < vectors; i += I{gridDim.x} * blockDim.x) {
    const I row = i / per_row, column = (i - row * per_row) * kWidth;
    const Vector<S, kWidth> in = *reinterpret_cast<const Vector<S, kWidth>*>(
        src + row_offset(src_index, row) + column);
    auto* target = reinterpret_cast<Vector<D, kWidth>*>(dst + row_offset(dst_index, row) + column);
    Vector<D, kWidth> out;
    if constexpr (kAdd) {
      out = *target;
#pragma unroll
      for (int k = 0; k < kWidth; ++k) out.value[k] += in.value[k];
    } else {
#pragma unroll
      for (int k = 0; k < kWidth; ++k) out.value[k] = from_double<D>(to_double(in.value[k]));
    }
    *target = out;
  }
}

unsigned blocks_for(std::int64_t count) {
  const std::int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Whether the rows kernels can take `index` over `base` kWidth elements of `bytes` at a time:
// a contiguous innermost axis of whole vectors, row starts on vector boundaries.
bool fits_rows(const Index4& index, const void* base, int width, std::size_t bytes) {
  if (index.strides[3] != 1 || index.shape[3] % width != 0) return false;
  for (int axis = 0; axis < 3; ++axis) {
    if (index.strides[axis] % width != 0) return false;
  }
  return reinterpret_cast<std::uintptr_t>(base) % (width * bytes) == 0;
}

// Calls f(count) with count as a std::uint32_t where every index of a grid-stride loop over it
// fits (count + the grid's threads < 2^32), else as itself.
template <typename F>
void with_index_type(std::int64_t count, F&& f) {
  if (count + kThreads * kMaxBlocks < (std::int64_t{1} << 32)) {
    f(static_cast<std::uint32_t>(count));
  } else {
    f(count);
  }
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
  Index4 index[1];
  merged_indices<1>({&t}, index);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch(t.dtype, [&](auto zero) {
    using T = decltype(zero);
    constexpr int kWidth = 16 / sizeof(T);
    if (fits_rows(index[0], t.data, kWidth, sizeof(T))) {
      with_index_type(count / kWidth, [&](auto vectors) {
        fill_rows_kernel<T, kWidth><<<blocks_for(vectors), kThreads, 0, cuda_stream>>>(
            t.as<T>(), index[0], vectors, from_double<T>(value));
      });
    } else {
      fill_kernel<T><<<blocks_for(count), kThreads, 0, cuda_stream>>>(t.as<T>(), index[0], count,
                                                                      from_double<T>(value));
    }
  });
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void copy(const TensorView& src, const TensorView& dst, void* stream) {
  const std::int64_t count = src.numel();
  if (count == 0) return;
  Index4 index[2];
  merged_indices<2>({&src, &dst}, index);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch(src.dtype, [&](auto src_zero) {
    using S = decltype(src_zero);
    dispatch(dst.dtype, [&](auto dst_zero) {
      using D = decltype(dst_zero);
      constexpr int kWidth = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
      if (fits_rows(index[0], src.data, kWidth, sizeof(S)) &&
          fits_rows(index[1], dst.data, kWidth, sizeof(D))) {
        with_index_type(count / kWidth, [&](auto vectors) {
          copy_rows_kernel<S, D, kWidth, false><<<blocks_for(vectors), kThreads, 0, cuda_stream>>>(
              src.as<const S>(), index[0], dst.as<D>(), index[1], vectors);
        });
      } else {
        copy_kernel<S, D><<<blocks_for(count), kThreads, 0, cuda_stream>>>(
            src.as<const S>(), index[0], dst.as<D>(), index[1], count);
      }
    });
  });
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void add(const TensorView& src, const TensorView& dst, void* stream) {
  const std::int64_t count = src.numel();
  if (count == 0) return;
  Index4 index[2];
  merged_indices<2>({&src, &dst}, index);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  auto launch = [&](auto zero) {
    using T = decltype(zero);
    constexpr int kWidth = 16 / sizeof(T);
    if (fits_rows(index[0], src.data, kWidth, sizeof(T)) &&
        fits_rows(index[1], dst.data, kWidth, sizeof(T))) {
      with_index_type(count / kWidth, [&](auto vectors) {
        copy_rows_kernel<T, T, kWidth, true><<<blocks_for(vectors), kThreads, 0, cuda_stream>>>(
            src.as<const T>(), index[0], dst.as<T>(), index[1], vectors);
      });
    } else {
      add_kernel<T><<<blocks_for(count), kThreads, 0, cuda_stream>>>(
          src.as<const T>(), index[0], dst.as<T>(), index[1], count);
    }
  };
  if (src.dtype == DType::f64) {
    launch(double{});
  } else {
    launch(float{});
  }
  RINGATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace ringattn::detail::device
