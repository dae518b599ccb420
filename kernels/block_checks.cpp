#include "kernels/block_checks.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

#include "ringattn/error.hpp"

namespace ringattn::detail {

bool cuda_block_takes_head_dim(std::int64_t head_dim) {
  for (const std::int64_t supported : kCudaBlockHeadDims) {
    if (head_dim == supported) return true;
  }
  return false;
}

namespace {

// "32, 64 or 128".
template <std::size_t kCount>
std::string head_dims_text(const std::int64_t (&dims)[kCount]) {
  std::string text;
  for (std::size_t i = 0; i < kCount; ++i) {
    text += (i == 0 ? "" : i + 1 == kCount ? " or " : ", ") + std::to_string(dims[i]);
  }
  return text;
}

// "head_dim 192 with v_head_dim 128" (pairs joined as head dims are; empty for none).
template <std::size_t kCount>
std::string value_dims_text(const std::array<HeadDimPair, kCount>& pairs) {
  std::string text;
  std::size_t i = 0;
  for (const HeadDimPair& pair : pairs) {
    text += (i == 0 ? "" : i + 1 == kCount ? " or " : ", ") + std::string("head_dim ") +
            std::to_string(pair.head_dim) + " with v_head_dim " + std::to_string(pair.v_head_dim);
    ++i;
  }
  return text;
}

}  // namespace

std::string cuda_block_head_dims_text() { return head_dims_text(kCudaBlockHeadDims); }

bool cuda_block_takes_value_dim(std::int64_t head_dim, std::int64_t v_head_dim) {
  for (const HeadDimPair& pair : kCudaBlockValueDimPairs) {
    if (pair.head_dim == head_dim && pair.v_head_dim == v_head_dim) return true;
  }
  return false;
}

std::string cuda_block_value_dims_text() { return value_dims_text(kCudaBlockValueDimPairs); }

void check_block_dtype(DType dtype, std::int64_t head_dim, std::int64_t v_head_dim, Memory memory,
                       const char* where) {
  if (memory == Memory::host) {
    if (dtype != DType::f32 && dtype != DType::f64) {
      fail(
          where, "q has dtype ", dtype_name(dtype),
          "; host tensors run on the CPU block, which takes f32 or f64 (bf16 and f16 run on CUDA)");
    }
    return;
  }
  if (dtype != DType::bf16 && dtype != DType::f16) {
    fail(where, "q has dtype ", dtype_name(dtype),
         "; device tensors run on the CUDA block, which takes bf16 or f16");
  }
  // The CUDA kernels are compiled for their head dims (tiles, shared memory and registers are
  // sized by them), so a V of another width than Q and K has kernels only for the pairs that were
  // instantiated, whatever the two sizes.
  if (v_head_dim != head_dim && !cuda_block_takes_value_dim(head_dim, v_head_dim)) {
    const std::string pairs = cuda_block_value_dims_text();
    for (const HeadDimPair& known : kAllCudaBlockValueDimPairs) {
      if (known.head_dim == head_dim && known.v_head_dim == v_head_dim) {
        fail_as(ErrorKind::unsupported, where, "head_dim ", head_dim, " with v_head_dim ",
                v_head_dim,
                " was left out of this build (RINGATTN_CUDA_HEAD_DIMS); the CUDA block here takes "
                "one head_dim for q, k and v (",
                cuda_block_head_dims_text(), ")", pairs.empty() ? "" : ", or " + pairs,
                ", and a build with all takes ", value_dims_text(kAllCudaBlockValueDimPairs),
                " too");
      }
    }
    fail_as(ErrorKind::unsupported, where, "v has head_dim ", v_head_dim, " but q and k have ",
            head_dim, "; the CUDA block takes one head_dim for q, k and v (",
            cuda_block_head_dims_text(), ")", pairs.empty() ? "" : ", or " + pairs,
            "; other v_head_dims run on the CPU block only");
  }
  if (!cuda_block_takes_head_dim(head_dim)) {
    for (const std::int64_t known : kAllCudaBlockHeadDims) {
      if (head_dim == known) {
        fail_as(ErrorKind::unsupported, where, "head_dim ", head_dim,
                " was left out of this build (RINGATTN_CUDA_HEAD_DIMS); the CUDA block here takes ",
                cuda_block_head_dims_text(), ", and a build with all takes ",
                head_dims_text(kAllCudaBlockHeadDims));
      }
    }
    fail_as(ErrorKind::unsupported, where, "head_dim ", head_dim,
            " is not supported; the CUDA block takes ", cuda_block_head_dims_text());
  }
}

void check_block_dtype(DType dtype, std::int64_t head_dim, Memory memory, const char* where) {
  check_block_dtype(dtype, head_dim, head_dim, memory, where);
}

// 16-bit rows move in 16-byte copies (cp.async), fp32 accumulators in 8-byte pairs.
void check_block_layout(const TensorView& t, const char* name, const char* where) {
  if (t.memory != Memory::device || t.rank != 4) return;
  const std::int64_t elements = t.dtype == DType::f32 ? 2 : 8;
  const std::int64_t bytes = elements * static_cast<std::int64_t>(dtype_size(t.dtype));
  if (t.shape[3] > 1 && t.strides[3] != 1) {
    fail(where, name, " has stride ", t.strides[3], " along head_dim; expected 1");
  }
  for (int axis = 0; axis < 3; ++axis) {
    if (t.shape[axis] > 1 && t.strides[axis] % elements != 0) {
      fail(where, name, " has stride ", t.strides[axis], " on axis ", axis,
           "; expected a multiple of ", elements, " elements (", bytes, "-byte rows)");
    }
  }
  if (reinterpret_cast<std::uintptr_t>(t.data) % bytes != 0) {
    fail(where, name, " (", t.data, ") is not ", bytes, "-byte aligned");
  }
}

}  // namespace ringattn::detail
