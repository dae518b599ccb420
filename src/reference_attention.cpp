// The fp64 oracle: attention with materialised scores, written for clarity rather than speed.
// Every kernel of ringattn is checked against it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"
#include "src/element_access.hpp"
#include "src/thread_pool.hpp"

namespace ringattn::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The mask as its definition states it (ringattn/attention.hpp), for batch row b; independent of
// the interval form the kernels use (src/mask_rule.hpp).
std::int64_t document_index(const Mask& mask, std::int64_t b, std::int64_t position) {
  const std::int64_t* starts = mask.documents.data + b * mask.documents.batch_stride;
  std::int64_t index = 0;
  for (std::int64_t n = 0; n < mask.documents.count; ++n) index += starts[n] <= position ? 1 : 0;
  return index;
}

// a - b >= limit (limit > 0) for any int64 a and b: a difference past int64 exceeds every limit.
bool distance_at_least(std::int64_t a, std::int64_t b, std::int64_t limit) {
  std::int64_t difference = 0;
  if (__builtin_sub_overflow(a, b, &difference)) return a > b;
  return difference >= limit;
}

bool visible(const Mask& mask, std::int64_t b, std::int64_t i, std::int64_t j) {
  const std::int64_t query = mask.q_start + i, key = mask.k_start + j;  // fit: check_mask
  if (mask.causal && key > query) return false;
  if (mask.window_left > 0 && distance_at_least(query, key, mask.window_left)) return false;
  if (mask.window_right > 0 && distance_at_least(key, query, mask.window_right)) return false;
  if (mask.documents.active() &&
      document_index(mask, b, query) != document_index(mask, b, key)) {
    return false;
  }
  return true;
}

// rows x head_dim of one (batch, head) of a [batch, seq, heads, head_dim] view, as doubles (each
// view's own head_dim: d_qk for q and k, d_v for v and dout).
std::vector<double> gather(const TensorView& t, std::int64_t b, std::int64_t h) {
  const std::int64_t rows = t.shape[1], d = t.shape[3];
  std::vector<double> out(rows * d);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t x = 0; x < d; ++x) out[i * d + x] = detail::load_element(t, t.offset(b, i, h, x));
  }
  return out;
}

double dot(const double* a, const double* b, std::int64_t d) {
  double sum = 0.0;
  for (std::int64_t x = 0; x < d; ++x) sum += a[x] * b[x];
  return sum;
}

// Softmax probabilities P[i * sk + j] of one (batch b, q head) and each row's log-sum-exp.
void probabilities(const std::vector<double>& q, const std::vector<double>& k, std::int64_t sq,
                   std::int64_t sk, std::int64_t d, const Mask& mask, std::int64_t b, double scale,
                   std::vector<double>& p, std::vector<double>& lse) {
  p.assign(sq * sk, 0.0);
  lse.assign(sq, kNegInf);
  for (std::int64_t i = 0; i < sq; ++i) {
    double row_max = kNegInf;
    for (std::int64_t j = 0; j < sk; ++j) {
      if (!visible(mask, b, i, j)) continue;
      p[i * sk + j] = dot(&q[i * d], &k[j * d], d) * scale;
      row_max = std::max(row_max, p[i * sk + j]);
    }
    if (row_max == kNegInf) continue;  // no visible key: P = 0, LSE = -inf
    double sum = 0.0;
    for (std::int64_t j = 0; j < sk; ++j) {
      if (!visible(mask, b, i, j)) continue;
      p[i * sk + j] = std::exp(p[i * sk + j] - row_max);
      sum += p[i * sk + j];
    }
    for (std::int64_t j = 0; j < sk; ++j) p[i * sk + j] /= sum;
    lse[i] = row_max + std::log(sum);
  }
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const Mask& mask, double scale, const TensorView& o, const TensorView& lse) {
  constexpr const char* kWhere = "reference::attention_forward";
  const AttentionShape s = detail::check_attention_inputs(q, k, v, scale, Memory::host, kWhere);
  detail::check_mask(mask, s, Memory::host, kWhere);
  detail::check_view(o, "o", 4, Memory::host, kWhere);
  detail::check_value_shape(o, "o", s.batch, s.q_len, s.q_heads, s,
                            "batch, q_len and q_heads of q, head_dim of v", kWhere);
  const bool write_lse = lse.data != nullptr;
  if (write_lse) {
    detail::check_view(lse, "lse", 3, Memory::host, kWhere);
    detail::check_shape(lse, "lse", {s.batch, s.q_heads, s.q_len}, "[batch, q_heads, q_len]",
                        kWhere);
  }
  const std::int64_t group = s.q_heads / s.kv_heads;

  detail::parallel_for(s.batch * s.q_heads, [&](std::int64_t task) {
    const std::int64_t b = task / s.q_heads, h = task % s.q_heads, kv_h = h / group;
    const std::int64_t sq = s.q_len, sk = s.k_len, d = s.head_dim, dv = s.v_head_dim;
    const std::vector<double> qh = gather(q, b, h), kh = gather(k, b, kv_h), vh = gather(v, b, kv_h);
    std::vector<double> p, row_lse;
    probabilities(qh, kh, sq, sk, d, mask, b, scale, p, row_lse);
    std::vector<double> out(dv);
    for (std::int64_t i = 0; i < sq; ++i) {
      std::fill(out.begin(), out.end(), 0.0);
      for (std::int64_t j = 0; j < sk; ++j) {
        for (std::int64_t x = 0; x < dv; ++x) out[x] += p[i * sk + j] * vh[j * dv + x];
      }
      for (std::int64_t x = 0; x < dv; ++x) detail::store_element(o, o.offset(b, i, h, x), out[x]);
      if (write_lse) detail::store_element(lse, lse.offset(b, h, i), row_lse[i]);
    }
  });
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& dout, const Mask& mask, double scale,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  constexpr const char* kWhere = "reference::attention_backward";
  const AttentionShape s = detail::check_attention_inputs(q, k, v, scale, Memory::host, kWhere);
  detail::check_mask(mask, s, Memory::host, kWhere);
  detail::check_view(dout, "dout", 4, Memory::host, kWhere);
  detail::check_value_shape(dout, "dout", s.batch, s.q_len, s.q_heads, s,
                            "batch, q_len and q_heads of q, head_dim of v", kWhere);
  detail::check_view(dq, "dq", 4, Memory::host, kWhere);
  detail::check_shape(dq, "dq", {s.batch, s.q_len, s.q_heads, s.head_dim}, "the shape of q",
                      kWhere);
  detail::check_view(dk, "dk", 4, Memory::host, kWhere);
  detail::check_shape(dk, "dk", {s.batch, s.k_len, s.kv_heads, s.head_dim}, "the shape of k",
                      kWhere);
  detail::check_view(dv, "dv", 4, Memory::host, kWhere);
  detail::check_value_shape(dv, "dv", s.batch, s.k_len, s.kv_heads, s, "the shape of v", kWhere);
  const std::int64_t group = s.q_heads / s.kv_heads;
  const std::int64_t sq = s.q_len, sk = s.k_len, d = s.head_dim, d_v = s.v_head_dim;

  // One task per (batch, kv head): it owns dK and dV of that head and dQ of its query heads.
  detail::parallel_for(s.batch * s.kv_heads, [&](std::int64_t task) {
    const std::int64_t b = task / s.kv_heads, kv_h = task % s.kv_heads;
    const std::vector<double> kh = gather(k, b, kv_h), vh = gather(v, b, kv_h);
    std::vector<double> dk_acc(sk * d, 0.0), dv_acc(sk * d_v, 0.0), dq_acc(sq * d);
    std::vector<double> p, row_lse, ds(sq * sk);
    for (std::int64_t h = kv_h * group; h < (kv_h + 1) * group; ++h) {
      const std::vector<double> qh = gather(q, b, h), gh = gather(dout, b, h);
      probabilities(qh, kh, sq, sk, d, mask, b, scale, p, row_lse);
      for (std::int64_t i = 0; i < sq; ++i) {
        double row_dot = 0.0;  // sum_j P_ij dP_ij
        for (std::int64_t j = 0; j < sk; ++j) {
          ds[i * sk + j] = dot(&gh[i * d_v], &vh[j * d_v], d_v);  // dP_ij
          row_dot += p[i * sk + j] * ds[i * sk + j];
        }
        for (std::int64_t j = 0; j < sk; ++j) ds[i * sk + j] = p[i * sk + j] * (ds[i * sk + j] - row_dot);
      }
      std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
      for (std::int64_t i = 0; i < sq; ++i) {
        for (std::int64_t j = 0; j < sk; ++j) {
          const double dsij = ds[i * sk + j], pij = p[i * sk + j];
          for (std::int64_t x = 0; x < d; ++x) {
            dq_acc[i * d + x] += dsij * kh[j * d + x] * scale;
            dk_acc[j * d + x] += dsij * qh[i * d + x] * scale;
          }
          for (std::int64_t x = 0; x < d_v; ++x) dv_acc[j * d_v + x] += pij * gh[i * d_v + x];
        }
      }
      for (std::int64_t i = 0; i < sq; ++i) {
        for (std::int64_t x = 0; x < d; ++x) {
          detail::store_element(dq, dq.offset(b, i, h, x), dq_acc[i * d + x]);
        }
      }
    }
    for (std::int64_t j = 0; j < sk; ++j) {
      for (std::int64_t x = 0; x < d; ++x) {
        detail::store_element(dk, dk.offset(b, j, kv_h, x), dk_acc[j * d + x]);
      }
      for (std::int64_t x = 0; x < d_v; ++x) {
        detail::store_element(dv, dv.offset(b, j, kv_h, x), dv_acc[j * d_v + x]);
      }
    }
  });
}

}  // namespace ringattn::reference
