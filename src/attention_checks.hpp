// The pieces of the local block's argument checks, for implementations with other dtype rules
// (the fp64 oracle accepts any dtype; the CUDA kernels add alignment and pointer checks).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>

#include "ringattn/attention.hpp"

namespace ringattn::detail {

// The largest extents the local block takes, in either memory. They are the CUDA kernels' index
// types (kernels/cuda/flash_params.hpp, kernels/cuda/flash_launch.cuh); host tensors get the same
// limits, so that one contract holds for both memories and a call refused on the device is
// refused on the host. Within them every size the blocks form from a shape fits in int64
// (q_len x k_len for the oracle's scores, a tile's rows x head_dim).
//   rows (q_len, k_len): FlashParams holds them as int, and the launches and kernels form row
//     indices in int up to the length rounded up to a whole tile ((q_len + kRows - 1) / kRows,
//     tiles of at most 128 rows or keys today; 256 of margin).
//   batch, heads: blockIdx.z and blockIdx.y of every launch (grid (row blocks, heads, batch)),
//     at most 65535 in CUDA.
//   head_dim: an int in FlashParams (the CUDA block itself takes only kCudaBlockHeadDims).
inline constexpr std::int64_t kMaxRows = std::numeric_limits<std::int32_t>::max() - 256;
inline constexpr std::int64_t kMaxBatch = 65535;
inline constexpr std::int64_t kMaxHeads = 65535;
inline constexpr std::int64_t kMaxHeadDim = std::numeric_limits<std::int32_t>::max();

// Q, K, V: rank 4, same batch, K with the head_dim of Q (d_qk), V with the batch, length and heads
// of K and a head_dim of its own (d_v, AttentionShape::v_head_dim), q_heads % kv_heads == 0, one
// dtype, extents within the limits above, scale finite and > 0.
AttentionShape check_attention_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                                      double scale, Memory memory, const char* where);
// Rank, memory kind, non-negative extents and an element count that fits in int64; for a view
// with elements, also strides >= 1 on every axis of more than one element, a non-null pointer,
// and a span in bytes (first element to one past the last) that fits in int64 and in the
// address space. A view's strides may still reach past the caller's allocation: the API is given
// no allocation sizes to check them against.
void check_view(const TensorView& t, const char* name, int rank, Memory memory, const char* where);
// A tensor of d_v (o, dout, dv): [batch, len, heads, s.v_head_dim]. A wrong head_dim alone is named
// with both head dims ("o has head_dim 192 ...; expected 128, the head_dim of v (q and k have
// head_dim 192)"); other extents as check_shape does, with `what` saying where they come from.
void check_value_shape(const TensorView& t, const char* name, std::int64_t batch,
                       std::int64_t len, std::int64_t heads, const AttentionShape& s,
                       const char* what, const char* where);
// A [batch, len, heads, head_dim] view within kMaxBatch, kMaxRows, kMaxHeads and kMaxHeadDim.
void check_extent_limits(const TensorView& t, const char* name, const char* where);
void check_shape(const TensorView& t, const char* name, std::initializer_list<std::int64_t> expected,
                 const char* what, const char* where);
void check_dtype(const TensorView& t, const char* name, DType expected, const char* what,
                 const char* where);

// The positions of the mask within int64: q_start + q_len and k_start + k_len (the blocks form
// row and key positions up to them), and every query position minus every key position (the blocks
// compare them through shift = q_start - k_start); windows >= 0; a document list with a count
// >= 0, a pointer when the count is positive, a batch_stride >= 0 and, in host memory
// (documents_memory), non-decreasing starts in every batch row. Error naming the field and its
// value otherwise.
void check_mask(const Mask& mask, const AttentionShape& s, Memory documents_memory,
                const char* where);

// Bytes from the first element of a view checked by check_view to one past its last; 0 for a
// view without elements. Error naming `name` when it overflows int64.
std::int64_t span_bytes(const TensorView& t, const char* name, const char* where);

struct NamedTensor {
  const char* name;
  const TensorView* view;
};
// Refuses an output that may share a byte with another output or with an input, naming both and
// their byte ranges: "o overlaps q (o [0x7f.., 0x7f..), q [0x7f.., 0x7f..))". Inputs may overlap
// each other, and an output that a call reads and writes (a running O and LSE, gradients added
// into) is one tensor, not two. Views interleaved in one buffer without sharing an element (dQ,
// dK and dV of a packed [B, S, 3, H, D] gradient) are told apart by their strides; views whose
// layout this cannot prove apart are refused. Every view must have passed check_view.
void check_no_overlap(std::initializer_list<NamedTensor> outputs,
                      std::initializer_list<NamedTensor> inputs, const char* where);

// backward_prepare's views, ahead of either backend's own checks: o and dout [B, S, H, D] and
// delta [B, H, S] in the memory of o, within the limits above, delta sharing no memory with o or
// dout.
void check_prepare_views(const TensorView& o, const TensorView& dout, const TensorView& delta,
                         const char* where);

}  // namespace ringattn::detail
