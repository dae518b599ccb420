// FlashParams: the single contract between the host side of the CUDA local block and every
// kernel of it. Raw pointers and 64-bit strides in elements, so packed QKV buffers are views.
#pragma once

#include <cstdint>

#include "src/mask_rule.hpp"

namespace ringattn::cuda_detail {

struct FlashParams {
  // Inputs [batch, len, heads, head_dim] with unit stride along head_dim. Q, K, dQ and dK have
  // head_dim columns, V, O, dO and dV the kernel's value dim (equal, or 128 for head_dim 192): the
  // kernels take both widths from their template arguments.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  std::int64_t q_strides[3] = {};  // batch, row, head
  std::int64_t k_strides[3] = {};
  std::int64_t v_strides[3] = {};

  // Forward: O in the input dtype, or the running fp32 O in combine mode. Backward: the final O.
  void* o = nullptr;
  std::int64_t o_strides[3] = {};
  // [batch, heads, len] fp32: the forward writes or merges it, the backward reads it.
  float* lse = nullptr;
  std::int64_t lse_strides[3] = {};  // batch, head, row

  // Backward only.
  const void* dout = nullptr;
  std::int64_t dout_strides[3] = {};
  float* delta = nullptr;  // rowsum(dO * O), laid out like lse
  std::int64_t delta_strides[3] = {};
  float* dq = nullptr;  // fp32 accumulators, added into
  // fp32, added into, or overwritten when overwrite_key_gradients; T (the input dtype) when
  // round_key_gradients, overwritten
  void* dk = nullptr;
  void* dv = nullptr;
  std::int64_t dq_strides[3] = {};
  std::int64_t dk_strides[3] = {};
  std::int64_t dv_strides[3] = {};

  int batch = 0, q_len = 0, k_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int group = 1;  // q_heads / kv_heads
  float scale = 0.f;
  float scale_log2 = 0.f;  // scale * log2(e): the softmax runs in the exp2 domain
  bool causal = false;
  // Causal visibility in local indices: row i sees key j iff j <= i + shift,
  // shift = q_start - k_start (global positions of the first Q row and the first K row).
  std::int64_t shift = 0;
  // Sliding windows and documents (Mask::local()): the kCausal instantiations of both families
  // serve them (causal is then set, whatever rule.causal says) and take each row's keys
  // [first, last) and each key's rows from `rule` by global position instead of from `shift`.
  // rule is batch row 0's; rule.for_batch(b, document_stride) gives the others. The document
  // starts are in device memory.
  bool local = false;
  detail::MaskRule rule{};
  std::int64_t document_stride = 0, q_start = 0, k_start = 0;
  // Hopper backward without a mask: each key block's query rows are split over this many CTAs
  // (blockIdx.z = batch * row_splits + split), which then add into dk and dv with atomics.
  int row_splits = 1;
  // Causal Hopper grids: the (batch, head) pairs taken this many at a time, the blocks of a group
  // launched longest first and interleaved over its pairs (causal_grid_place).
  int schedule_group = 1;
  // dK and dV are written, not added into (every CTA writes its keys, zeros where it saw no row).
  bool overwrite_key_gradients = false;
  // dK and dV have the input dtype: each CTA rounds its keys' gradients once and writes them
  // (overwrite_key_gradients too; never with row splits, whose parts add).
  bool round_key_gradients = false;
  // RoPE of the keys, undone on each key's gradient before it is written or added: fp32 tables
  // [k_len, head_dim / 2] (row strides below, unit stride along a row); null for none.
  const float* key_cos = nullptr;
  const float* key_sin = nullptr;
  std::int64_t key_cos_stride = 0, key_sin_stride = 0;
};

}  // namespace ringattn::cuda_detail
