// The ring's one backend switch: the local attention block and the few element-wise operations
// around it, on the CPU block for host tensors and on the CUDA block (queued on a stream) for
// device tensors. The ring schedule calls only these, so it is written once for both backends.
#pragma once

#include "ringattn/attention.hpp"

namespace ringattn::detail {

// The block of the tensors' memory (args.q.memory); `stream` is a cudaStream_t, ignored on the
// host.
void block_forward(const ForwardArgs& args, void* stream);
void block_backward_prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
                            void* stream);
void block_backward(const BackwardArgs& args, void* stream);

// What the block of `memory` checks again at every call, checked once before a ring starts (a
// rank that fails inside the ring would leave its peers waiting): the input dtypes and head dims
// it runs, and on the device its layout rules for one tensor (unit stride along head_dim, rows
// in 16-byte units for 16-bit tensors and 8-byte units for fp32 ones, aligned data). Rank-3 row
// statistics have no layout rule.
void check_block_dtype(DType dtype, std::int64_t head_dim, Memory memory, const char* where);
void check_block_layout(const TensorView& t, const char* name, const char* where);

// Element-wise on views of the same shape (any strides, same memory), queued on `stream` for
// device tensors:
void fill(const TensorView& t, double value, void* stream);             // t = value
void copy(const TensorView& src, const TensorView& dst, void* stream);  // dst = src, converted
void add(const TensorView& src, const TensorView& dst, void* stream);   // dst += src

// The device side of the element-wise operations (parallel/cuda/local_block_cuda.cu); a library
// built without CUDA throws Error (parallel/cuda_unavailable.cpp).
namespace device {
void fill(const TensorView& t, double value, void* stream);
void copy(const TensorView& src, const TensorView& dst, void* stream);
void add(const TensorView& src, const TensorView& dst, void* stream);
}  // namespace device

}  // namespace ringattn::detail
