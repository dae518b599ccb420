// Helpers of the C API tests: C tensor descriptors over a host vector or device memory.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "ringattn/ringattn.h"

namespace ringattn::test {

// A row-major f64 host descriptor of `shape` at `data`. Strides stop growing where they would
// overflow int64 (a shape whose element count does, for tests of that refusal).
inline ringattn_tensor_t describe_at(void* data, std::initializer_list<std::int64_t> shape) {
  ringattn_tensor_t t{};
  t.data = data;
  t.dtype = RINGATTN_F64;
  t.memory = RINGATTN_HOST;
  t.rank = static_cast<int32_t>(shape.size());
  int axis = 0;
  for (std::int64_t extent : shape) t.shape[axis++] = extent;
  std::int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.strides[i] = stride;
    if (i > 0 && __builtin_mul_overflow(stride, t.shape[i], &stride)) stride = 1;
  }
  return t;
}

// The same in device memory, of C API dtype code `dtype`.
inline ringattn_tensor_t describe_device_at(void* data, int32_t dtype, std::initializer_list<std::int64_t> shape) {
  ringattn_tensor_t t = describe_at(data, shape);
  t.dtype = dtype;
  t.memory = RINGATTN_DEVICE;
  return t;
}

// The same over a vector's elements.
inline ringattn_tensor_t describe(std::vector<double>& data, std::initializer_list<std::int64_t> shape) {
  return describe_at(data.data(), shape);
}

// The backward's parameters for a forward's: its q, k, v, lse, scale and whole mask (causal,
// q_start, k_start, window, documents), with dout, delta and the gradients given; a struct of
// this version (struct_size = sizeof).
inline ringattn_backward_params_t backward_params_of(const ringattn_forward_params_t& p,
                                                     const ringattn_tensor_t& dout,
                                                     const ringattn_tensor_t& delta,
                                                     const ringattn_tensor_t& dq,
                                                     const ringattn_tensor_t& dk,
                                                     const ringattn_tensor_t& dv) {
  ringattn_backward_params_t bp{};
  bp.struct_size = sizeof(bp);
  bp.q = p.q;
  bp.k = p.k;
  bp.v = p.v;
  bp.dout = dout;
  bp.lse = p.lse;
  bp.delta = delta;
  bp.dq = dq;
  bp.dk = dk;
  bp.dv = dv;
  bp.scale = p.scale;
  bp.causal = p.causal;
  bp.q_start = p.q_start;
  bp.k_start = p.k_start;
  bp.window_left = p.window_left;
  bp.window_right = p.window_right;
  bp.document_starts = p.document_starts;
  bp.num_documents = p.num_documents;
  bp.document_batch_stride = p.document_batch_stride;
  return bp;
}

// The ring's backward parameters for a ring forward's: its q, k, v, o, lse, scale, causal flag,
// window and documents, with dout and the gradients given; a struct of this version.
inline ringattn_ring_backward_params_t ring_backward_params_of(
    const ringattn_ring_forward_params_t& p, const ringattn_tensor_t& dout,
    const ringattn_tensor_t& dq, const ringattn_tensor_t& dk, const ringattn_tensor_t& dv) {
  ringattn_ring_backward_params_t bp{};
  bp.struct_size = sizeof(bp);
  bp.q = p.q;
  bp.k = p.k;
  bp.v = p.v;
  bp.o = p.o;
  bp.lse = p.lse;
  bp.dout = dout;
  bp.dq = dq;
  bp.dk = dk;
  bp.dv = dv;
  bp.scale = p.scale;
  bp.causal = p.causal;
  bp.window_left = p.window_left;
  bp.window_right = p.window_right;
  bp.document_starts = p.document_starts;
  bp.num_documents = p.num_documents;
  bp.document_batch_stride = p.document_batch_stride;
  return bp;
}

}  // namespace ringattn::test
