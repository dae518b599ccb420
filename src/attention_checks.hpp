// The pieces of the local block's argument checks, for implementations with other dtype rules
// (the fp64 oracle accepts any dtype; the CUDA kernels add alignment and pointer checks).
#pragma once

#include <initializer_list>

#include "ringattn/attention.hpp"

namespace ringattn::detail {

// Q, K, V: rank 4, same batch and head_dim, K and V alike, q_heads % kv_heads == 0, one dtype,
// scale finite and > 0.
AttentionShape check_attention_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                                      double scale, Memory memory, const char* where);
// Rank, memory kind, non-negative extents, positive strides and a non-null pointer.
void check_view(const TensorView& t, const char* name, int rank, Memory memory, const char* where);
void check_shape(const TensorView& t, const char* name, std::initializer_list<std::int64_t> expected,
                 const char* what, const char* where);
void check_dtype(const TensorView& t, const char* name, DType expected, const char* what,
                 const char* where);

}  // namespace ringattn::detail
