// Helpers of the C API tests: C tensor descriptors over a host vector or device memory.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "ringattn/attention.hpp"
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

// The window and documents of the mask fields every parameter struct ends with, from `from` to `to`.
template <typename From, typename To>
void copy_window_and_documents(const From& from, To& to) {
  to.window_left = from.window_left;
  to.window_right = from.window_right;
  to.document_starts = from.document_starts;
  to.num_documents = from.num_documents;
  to.document_batch_stride = from.document_batch_stride;
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
  copy_window_and_documents(p, bp);
  return bp;
}

// A ring forward's parameters (a struct of this version) over the descriptors given, under
// `mask`'s causal flag, window and documents (their starts in host memory; q_start and k_start
// unused).
inline ringattn_ring_forward_params_t ring_forward_params(
    const ringattn_tensor_t& q, const ringattn_tensor_t& k, const ringattn_tensor_t& v,
    const ringattn_tensor_t& o, const ringattn_tensor_t& lse, double scale,
    const ringattn::Mask& mask) {
  ringattn_ring_forward_params_t fp{};
  fp.struct_size = sizeof(fp);
  fp.q = q;
  fp.k = k;
  fp.v = v;
  fp.o = o;
  fp.lse = lse;
  fp.scale = scale;
  fp.causal = mask.causal ? 1 : 0;
  fp.window_left = mask.window_left;
  fp.window_right = mask.window_right;
  fp.document_starts = mask.documents.data;
  fp.num_documents = mask.documents.count;
  fp.document_batch_stride = mask.documents.batch_stride;
  return fp;
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
  copy_window_and_documents(p, bp);
  return bp;
}

}  // namespace ringattn::test
