// The ring's one backend switch: the local attention block and the few element-wise operations
// around it, on the CPU block for host tensors and on the CUDA block (queued on a stream) for
// device tensors. The ring schedule calls only these, so it is written once for both backends.
#pragma once

#include <cstddef>

#include "kernels/block_checks.hpp"
#include "ringattn/attention.hpp"

namespace ringattn::detail {

// Element-wise on views of the same shape (any strides, same memory), queued on `stream` for
// device tensors:
void fill(const TensorView& t, double value, void* stream);             // t = value
void copy(const TensorView& src, const TensorView& dst, void* stream);  // dst = src, converted
void add(const TensorView& src, const TensorView& dst, void* stream);   // dst += src

// `bytes` of `src` (in `memory`) to the host buffer `dst`, complete when it returns: for device
// memory, queued on `stream` behind its work and waited for. For the small metadata a call must
// read on the host before it starts (the document starts a ring plans from).
void copy_to_host(const void* src, Memory memory, std::size_t bytes, void* dst, void* stream);

// The device side of the element-wise operations (parallel/cuda/local_block_cuda.cu); a library
// built without CUDA throws Error (parallel/cuda_unavailable.cpp).
namespace device {
void fill(const TensorView& t, double value, void* stream);
void copy(const TensorView& src, const TensorView& dst, void* stream);
void add(const TensorView& src, const TensorView& dst, void* stream);
}  // namespace device

}  // namespace ringattn::detail
