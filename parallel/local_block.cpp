// Host side of the backend switch. The element-wise operations move O(tokens * heads * head_dim)
// values a few times per call, against O(tokens^2) work in the block: plain loops suffice, spread
// over the CPU backend's threads by rows.
#include "parallel/local_block.hpp"

#include <cstdint>
#include <cstring>

#include "ringattn/config.h"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"
#include "src/element_access.hpp"
#include "src/thread_pool.hpp"

#if RINGATTN_WITH_CUDA
#include "src/cuda/cuda_check.hpp"
#endif

namespace ringattn::detail {
namespace {

void check_same_shape(const TensorView& a, const char* a_name, const TensorView& b,
                      const char* b_name, const char* where) {
  bool same = a.rank == b.rank && a.memory == b.memory;
  for (int i = 0; same && i < a.rank; ++i) same = a.shape[i] == b.shape[i];
  if (!same) {
    fail(where, a_name, " is ", a.describe(), " but ", b_name, " is ", b.describe(),
         "; expected the same shape and memory");
  }
}

// Calls f(offset) for every element of a rank <= 4 view, the outer two axes spread over threads.
template <typename F>
void for_each_element(const TensorView& t, F&& f) {
  std::int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  for (int i = 0; i < t.rank; ++i) {
    shape[i] = t.shape[i];
    strides[i] = t.strides[i];
  }
  if (t.numel() == 0) return;
  parallel_for(shape[0] * shape[1], [&](std::int64_t outer) {
    const std::int64_t base = (outer / shape[1]) * strides[0] + (outer % shape[1]) * strides[1];
    for (std::int64_t c = 0; c < shape[2]; ++c) {
      for (std::int64_t d = 0; d < shape[3]; ++d) f(base + c * strides[2] + d * strides[3]);
    }
  });
}

// Offsets of two same-shape views walked together.
template <typename F>
void for_each_pair(const TensorView& a, const TensorView& b, F&& f) {
  std::int64_t shape[4] = {1, 1, 1, 1}, sa[4] = {0, 0, 0, 0}, sb[4] = {0, 0, 0, 0};
  for (int i = 0; i < a.rank; ++i) {
    shape[i] = a.shape[i];
    sa[i] = a.strides[i];
    sb[i] = b.strides[i];
  }
  if (a.numel() == 0) return;
  parallel_for(shape[0] * shape[1], [&](std::int64_t outer) {
    const std::int64_t i0 = outer / shape[1], i1 = outer % shape[1];
    const std::int64_t base_a = i0 * sa[0] + i1 * sa[1], base_b = i0 * sb[0] + i1 * sb[1];
    for (std::int64_t c = 0; c < shape[2]; ++c) {
      for (std::int64_t d = 0; d < shape[3]; ++d) {
        f(base_a + c * sa[2] + d * sa[3], base_b + c * sb[2] + d * sb[3]);
      }
    }
  });
}

template <typename T>
void add_typed(const TensorView& src, const TensorView& dst) {
  const T* s = src.as<const T>();
  T* d = dst.as<T>();
  for_each_pair(src, dst, [&](std::int64_t a, std::int64_t b) { d[b] += s[a]; });
}

}  // namespace

void fill(const TensorView& t, double value, void* stream) {
  if (t.memory == Memory::device) return device::fill(t, value, stream);
  switch (t.dtype) {
    case DType::f32: {
      float* d = t.as<float>();
      const float v = static_cast<float>(value);
      return for_each_element(t, [&](std::int64_t i) { d[i] = v; });
    }
    case DType::f64: {
      double* d = t.as<double>();
      return for_each_element(t, [&](std::int64_t i) { d[i] = value; });
    }
    default:
      return for_each_element(t, [&](std::int64_t i) { store_element(t, i, value); });
  }
}

void copy(const TensorView& src, const TensorView& dst, void* stream) {
  check_same_shape(src, "src", dst, "dst", "copy");
  if (src.memory == Memory::device) return device::copy(src, dst, stream);
  if (src.dtype == dst.dtype) {
    const std::size_t size = dtype_size(src.dtype);
    const auto* s = static_cast<const unsigned char*>(src.data);
    auto* d = static_cast<unsigned char*>(dst.data);
    return for_each_pair(src, dst, [&](std::int64_t a, std::int64_t b) {
      std::memcpy(d + b * size, s + a * size, size);
    });
  }
  for_each_pair(src, dst, [&](std::int64_t a, std::int64_t b) {
    store_element(dst, b, load_element(src, a));
  });
}

void add(const TensorView& src, const TensorView& dst, void* stream) {
  check_same_shape(src, "src", dst, "dst", "add");
  if (src.dtype != dst.dtype || (src.dtype != DType::f32 && src.dtype != DType::f64)) {
    fail("add", "src is ", src.describe(), " and dst ", dst.describe(),
         "; expected one accumulator dtype (f32 or f64)");
  }
  if (src.memory == Memory::device) return device::add(src, dst, stream);
  if (src.dtype == DType::f32) return add_typed<float>(src, dst);
  add_typed<double>(src, dst);
}

void copy_to_host(const void* src, Memory memory, std::size_t bytes, void* dst, void* stream) {
  if (bytes == 0) return;
  if (memory == Memory::host) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if RINGATTN_WITH_CUDA
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cuda_stream));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
#else
  (void)stream;
  fail("copy_to_host", "device memory needs a library built with CUDA");
#endif
}

}  // namespace ringattn::detail
