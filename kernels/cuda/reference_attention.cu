// Streaming GPU reference attention: fp32 arithmetic on CUDA cores, no tensor cores, no tiling
// tricks, O(S) memory. It checks long sequences (ring gradient checks at 128k tokens and more)
// where the fp64 CPU oracle would take hours. One warp per query row (forward, dQ) or per key
// row (dK, dV); lanes split head_dim and meet in a shuffle reduction for each dot product.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"
#include "src/cuda/cuda_check.hpp"
#include "src/mask_rule.hpp"

namespace ringattn::cuda {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;
constexpr int kWarpsPerBlock = 8;

struct View4 {
  const void* data;
  DType dtype;
  std::int64_t s0, s1, s2, s3;
};
struct Out4 {
  float* data;
  std::int64_t s0, s1, s2, s3;
};
struct Rows {  // [batch, heads, len] fp32
  float* data;
  std::int64_t s0, s1, s2;
};

struct RefParams {
  View4 q, k, v, dout;
  Out4 o, dq, dk, dv;
  Rows lse, delta;
  int batch, q_len, k_len, q_heads, kv_heads, head_dim, v_head_dim;  // d_qk of q, k; d_v of v, o
  float scale;
  detail::MaskRule rule;  // batch row 0's; rule.for_batch(b, document_stride) for the others
  std::int64_t document_stride, q_start, k_start;
};

__device__ float load(const View4& t, std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t x) {
  const std::int64_t offset = b * t.s0 + i * t.s1 + h * t.s2 + x * t.s3;
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[offset];
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(t.data)[offset]);
    case DType::f16: return __half2float(static_cast<const __half*>(t.data)[offset]);
    default: return 0.f;
  }
}

__device__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// This lane's share of a row: elements lane, lane + 32, ... of head_dim.
__device__ void load_row(const View4& t, std::int64_t b, std::int64_t i, std::int64_t h, int d,
                         float (&out)[kPerLane]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) out[e] = lane + 32 * e < d ? load(t, b, i, h, lane + 32 * e) : 0.f;
}

__device__ float dot(const float (&a)[kPerLane], const float (&b)[kPerLane]) {
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) sum += a[e] * b[e];
  return warp_sum(sum);
}

using detail::LocalRange;
using detail::local_range;

// The keys query row `row` of batch row b sees, and the query rows that see key row `key`.
__device__ LocalRange keys_of(const RefParams& p, int b, std::int64_t row) {
  return local_range(p.rule.for_batch(b, p.document_stride).keys_of(p.q_start + row), p.k_start, p.k_len);
}
__device__ LocalRange queries_of(const RefParams& p, int b, std::int64_t key) {
  return local_range(p.rule.for_batch(b, p.document_stride).queries_of(p.k_start + key), p.q_start,
                     p.q_len);
}

__global__ void reference_forward_kernel(const RefParams p) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int h = blockIdx.y, b = blockIdx.z, kv_h = h / (p.q_heads / p.kv_heads), lane = threadIdx.x % 32;
  if (row >= p.q_len) return;
  float q[kPerLane], k[kPerLane], v[kPerLane], acc[kPerLane] = {};
  load_row(p.q, b, row, h, p.head_dim, q);
  float row_max = -INFINITY, row_sum = 0.f;
  const LocalRange keys = keys_of(p, b, row);
  for (std::int64_t j = keys.first; j < keys.last; ++j) {
    load_row(p.k, b, j, kv_h, p.head_dim, k);
    const float s = dot(q, k) * p.scale;
    const float new_max = fmaxf(row_max, s);
    const float correction = expf(row_max - new_max);
    const float weight = expf(s - new_max);
    load_row(p.v, b, j, kv_h, p.v_head_dim, v);
    row_sum = row_sum * correction + weight;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e] = acc[e] * correction + weight * v[e];
    row_max = new_max;
  }
  float* o = p.o.data + b * p.o.s0 + row * p.o.s1 + h * p.o.s2;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    if (lane + 32 * e < p.v_head_dim) o[(lane + 32 * e) * p.o.s3] = row_sum > 0.f ? acc[e] / row_sum : 0.f;
  }
  if (lane == 0) {
    p.lse.data[b * p.lse.s0 + h * p.lse.s1 + row * p.lse.s2] =
        row_sum > 0.f ? row_max + logf(row_sum) : -INFINITY;
  }
}

// delta = rowsum(dO * O) and dQ, one warp a query row.
__global__ void reference_dq_kernel(const RefParams p) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int h = blockIdx.y, b = blockIdx.z, kv_h = h / (p.q_heads / p.kv_heads), lane = threadIdx.x % 32;
  if (row >= p.q_len) return;
  float q[kPerLane], g[kPerLane], o[kPerLane], k[kPerLane], v[kPerLane], dq[kPerLane] = {};
  load_row(p.q, b, row, h, p.head_dim, q);
  load_row(p.dout, b, row, h, p.v_head_dim, g);
  const float* o_row = p.o.data + b * p.o.s0 + row * p.o.s1 + h * p.o.s2;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) o[e] = lane + 32 * e < p.v_head_dim ? o_row[(lane + 32 * e) * p.o.s3] : 0.f;
  const float delta = dot(g, o);
  const float lse = p.lse.data[b * p.lse.s0 + h * p.lse.s1 + row * p.lse.s2];
  if (lane == 0) p.delta.data[b * p.delta.s0 + h * p.delta.s1 + row * p.delta.s2] = delta;
  if (lse != -INFINITY) {
    const LocalRange keys = keys_of(p, b, row);
    for (std::int64_t j = keys.first; j < keys.last; ++j) {
      load_row(p.k, b, j, kv_h, p.head_dim, k);
      load_row(p.v, b, j, kv_h, p.v_head_dim, v);
      const float prob = expf(dot(q, k) * p.scale - lse);
      const float ds = prob * (dot(g, v) - delta);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) dq[e] += ds * k[e];
    }
  }
  float* out = p.dq.data + b * p.dq.s0 + row * p.dq.s1 + h * p.dq.s2;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    if (lane + 32 * e < p.head_dim) out[(lane + 32 * e) * p.dq.s3] = dq[e] * p.scale;
  }
}

// dK and dV, one warp a key row, summed over every query row and every query head of the group.
__global__ void reference_dkdv_kernel(const RefParams p) {
  const std::int64_t key = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int kv_h = blockIdx.y, b = blockIdx.z, group = p.q_heads / p.kv_heads, lane = threadIdx.x % 32;
  if (key >= p.k_len) return;
  float k[kPerLane], v[kPerLane], q[kPerLane], g[kPerLane], dk[kPerLane] = {}, dv[kPerLane] = {};
  load_row(p.k, b, key, kv_h, p.head_dim, k);
  load_row(p.v, b, key, kv_h, p.v_head_dim, v);
  const LocalRange rows = queries_of(p, b, key);
  for (int h = kv_h * group; h < (kv_h + 1) * group; ++h) {
    for (std::int64_t i = rows.first; i < rows.last; ++i) {
      const float lse = p.lse.data[b * p.lse.s0 + h * p.lse.s1 + i * p.lse.s2];
      if (lse == -INFINITY) continue;
      const float delta = p.delta.data[b * p.delta.s0 + h * p.delta.s1 + i * p.delta.s2];
      load_row(p.q, b, i, h, p.head_dim, q);
      load_row(p.dout, b, i, h, p.v_head_dim, g);
      const float prob = expf(dot(q, k) * p.scale - lse);
      const float ds = prob * (dot(g, v) - delta);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        dv[e] += prob * g[e];
        dk[e] += ds * q[e];
      }
    }
  }
  float* out_k = p.dk.data + b * p.dk.s0 + key * p.dk.s1 + kv_h * p.dk.s2;
  float* out_v = p.dv.data + b * p.dv.s0 + key * p.dv.s1 + kv_h * p.dv.s2;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    if (lane + 32 * e < p.head_dim) out_k[(lane + 32 * e) * p.dk.s3] = dk[e] * p.scale;
    if (lane + 32 * e < p.v_head_dim) out_v[(lane + 32 * e) * p.dv.s3] = dv[e];
  }
}

View4 in_view(const TensorView& t) {
  return {t.data, t.dtype, t.strides[0], t.strides[1], t.strides[2], t.strides[3]};
}
Out4 out_view(const TensorView& t) {
  return {static_cast<float*>(t.data), t.strides[0], t.strides[1], t.strides[2], t.strides[3]};
}
Rows rows_view(const TensorView& t) {
  return {static_cast<float*>(t.data), t.strides[0], t.strides[1], t.strides[2]};
}

RefParams common(const TensorView& q, const TensorView& k, const TensorView& v, const Mask& mask,
                 double scale, const char* where) {
  const AttentionShape s = detail::check_attention_inputs(q, k, v, scale, Memory::device, where);
  detail::check_mask(mask, s, Memory::device, where);
  if (q.dtype == DType::f64) detail::fail(where, "q has dtype f64; the GPU reference takes f32, bf16 or f16");
  if (s.head_dim > kMaxHeadDim) detail::fail(where, "head_dim ", s.head_dim, " exceeds ", kMaxHeadDim);
  if (s.v_head_dim > kMaxHeadDim) {
    detail::fail(where, "v_head_dim ", s.v_head_dim, " exceeds ", kMaxHeadDim);
  }
  if (s.batch > 65535 || s.q_heads > 65535) detail::fail(where, "batch and heads must be at most 65535");
  RefParams p{};
  p.q = in_view(q);
  p.k = in_view(k);
  p.v = in_view(v);
  p.batch = static_cast<int>(s.batch);
  p.q_len = static_cast<int>(s.q_len);
  p.k_len = static_cast<int>(s.k_len);
  p.q_heads = static_cast<int>(s.q_heads);
  p.kv_heads = static_cast<int>(s.kv_heads);
  p.head_dim = static_cast<int>(s.head_dim);
  p.v_head_dim = static_cast<int>(s.v_head_dim);
  p.scale = static_cast<float>(scale);
  p.rule = detail::MaskRule::of(mask);
  p.document_stride = mask.documents.batch_stride;
  p.q_start = mask.q_start;
  p.k_start = mask.k_start;
  return p;
}

void check_f32(const TensorView& t, const char* name, int rank, std::initializer_list<std::int64_t> shape,
               const char* where) {
  detail::check_view(t, name, rank, Memory::device, where);
  detail::check_shape(t, name, shape, "the reference's output shape", where);
  detail::check_dtype(t, name, DType::f32, "the GPU reference writes fp32", where);
}

dim3 grid_of(std::int64_t rows, std::int64_t heads, std::int64_t batch) {
  return dim3(static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock), heads, batch);
}

}  // namespace

void reference_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const Mask& mask, double scale, const TensorView& o, const TensorView& lse,
                       void* stream) {
  constexpr const char* kWhere = "cuda::reference_forward";
  RefParams p = common(q, k, v, mask, scale, kWhere);
  check_f32(o, "o", 4, {p.batch, p.q_len, p.q_heads, p.v_head_dim}, kWhere);
  check_f32(lse, "lse", 3, {p.batch, p.q_heads, p.q_len}, kWhere);
  p.o = out_view(o);
  p.lse = rows_view(lse);
  if (p.q_len == 0 || p.batch == 0) return;
  reference_forward_kernel<<<grid_of(p.q_len, p.q_heads, p.batch), kWarpsPerBlock * 32, 0,
                             static_cast<cudaStream_t>(stream)>>>(p);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

void reference_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse, const TensorView& dout,
                        const Mask& mask, double scale, const TensorView& delta,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        void* stream) {
  constexpr const char* kWhere = "cuda::reference_backward";
  RefParams p = common(q, k, v, mask, scale, kWhere);
  check_f32(o, "o", 4, {p.batch, p.q_len, p.q_heads, p.v_head_dim}, kWhere);
  check_f32(lse, "lse", 3, {p.batch, p.q_heads, p.q_len}, kWhere);
  check_f32(delta, "delta", 3, {p.batch, p.q_heads, p.q_len}, kWhere);
  check_f32(dq, "dq", 4, {p.batch, p.q_len, p.q_heads, p.head_dim}, kWhere);
  check_f32(dk, "dk", 4, {p.batch, p.k_len, p.kv_heads, p.head_dim}, kWhere);
  check_f32(dv, "dv", 4, {p.batch, p.k_len, p.kv_heads, p.v_head_dim}, kWhere);
  detail::check_view(dout, "dout", 4, Memory::device, kWhere);
  detail::check_shape(dout, "dout", {p.batch, p.q_len, p.q_heads, p.v_head_dim}, "the shape of o", kWhere);
  detail::check_dtype(dout, "dout", q.dtype, "the dtype of q", kWhere);
  p.dout = in_view(dout);
  p.o = out_view(o);
  p.lse = rows_view(lse);
  p.delta = rows_view(delta);
  p.dq = out_view(dq);
  p.dk = out_view(dk);
  p.dv = out_view(dv);
  if (p.batch == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.q_len > 0) {
    reference_dq_kernel<<<grid_of(p.q_len, p.q_heads, p.batch), kWarpsPerBlock * 32, 0, s>>>(p);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
  if (p.k_len > 0) {
    reference_dkdv_kernel<<<grid_of(p.k_len, p.kv_heads, p.batch), kWarpsPerBlock * 32, 0, s>>>(p);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace ringattn::cuda
