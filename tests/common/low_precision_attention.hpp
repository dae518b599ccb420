// The baseline of the FlashAttention criterion: naive attention computed the way a framework
// computes it in bf16/f16 (every matmul and softmax output rounded to the input dtype, fp32 inside
// each operation), on the same rounded inputs. Its distance to the fp64 oracle is the error the
// input precision itself costs; a kernel passes when it stays within twice that (TESTING.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/dtype.hpp"
#include "src/thread_pool.hpp"
#include "tests/common/attention_testing.hpp"

namespace ringattn::test {

inline double round_to(DType dtype, double value) {
  const float f = static_cast<float>(value);
  switch (dtype) {
    case DType::bf16: return bf16_to_float(float_to_bf16(f));
    case DType::f16: return f16_to_float(float_to_f16(f));
    case DType::f32: return f;
    case DType::f64: return value;
  }
  return value;
}

// The error of one rounding to `dtype` is u |x| (u = 2^-8 bf16, 2^-11 f16) above the smallest
// normal, and at most half the subnormals' spacing below it: this is that half, which a bound of
// one rounding adds (2^-25 for f16's subnormals near 6e-5; 2^-134 for bf16; 0 for fp32 and fp64).
inline double half_subnormal_spacing(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 0x1p-134;
    case DType::f16: return 0x1p-25;
    case DType::f32:
    case DType::f64: return 0.0;
  }
  return 0.0;
}

struct AttentionResult {
  std::vector<double> o, lse, dq, dk, dv;  // logical [B,S,H,D] / [B,H,S] order
};

// q, k, v, dout hold logical values already representable in `dtype`; v, dout, o and dv have
// s.value_dim() columns, q, k, dq and dk s.head_dim.
inline AttentionResult low_precision_attention(const AttentionShape& s, DType dtype,
                                               const std::vector<double>& q,
                                               const std::vector<double>& k,
                                               const std::vector<double>& v,
                                               const std::vector<double>& dout, const Mask& mask,
                                               double scale) {
  const std::int64_t B = s.batch, Sq = s.q_len, Sk = s.k_len, Hq = s.q_heads, Hkv = s.kv_heads,
                     D = s.head_dim, Dv = s.value_dim(), group = Hq / Hkv;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  auto r = [dtype](double x) { return static_cast<float>(round_to(dtype, x)); };
  AttentionResult out;
  out.o.assign(B * Sq * Hq * Dv, 0.0);
  out.lse.assign(B * Hq * Sq, 0.0);
  out.dq.assign(B * Sq * Hq * D, 0.0);
  std::vector<double> dk_sum(B * Sk * Hkv * D, 0.0), dv_sum(B * Sk * Hkv * Dv, 0.0);
  auto qi = [&](std::int64_t b, std::int64_t i, std::int64_t h) { return ((b * Sq + i) * Hq + h) * D; };
  auto kj = [&](std::int64_t b, std::int64_t j, std::int64_t g) { return ((b * Sk + j) * Hkv + g) * D; };
  // The same rows of O and dO, and of V and dV.
  auto oi = [&](std::int64_t b, std::int64_t i, std::int64_t h) { return ((b * Sq + i) * Hq + h) * Dv; };
  auto vj = [&](std::int64_t b, std::int64_t j, std::int64_t g) { return ((b * Sk + j) * Hkv + g) * Dv; };
  // One task per (batch, kv head): it owns that head's dK/dV sums and its query heads' outputs.
  ringattn::detail::parallel_for(B * Hkv, [&](std::int64_t task) {
    const std::int64_t b = task / Hkv, g = task % Hkv;
    std::vector<float> qs(Sq * D), p(Sq * Sk), ds(Sq * Sk);
    for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (std::int64_t i = 0; i < Sq; ++i) {
        for (std::int64_t x = 0; x < D; ++x) qs[i * D + x] = r(q[qi(b, i, h) + x] * scale);
      }
      for (std::int64_t i = 0; i < Sq; ++i) {
        float row_max = kNegInf;
        for (std::int64_t j = 0; j < Sk; ++j) {
          float score = kNegInf;
          if (sees(mask, b, i, j)) {
            float dot = 0.f;
            for (std::int64_t x = 0; x < D; ++x) dot += qs[i * D + x] * static_cast<float>(k[kj(b, j, g) + x]);
            score = r(dot);
          }
          p[i * Sk + j] = score;
          row_max = std::max(row_max, score);
        }
        float sum = 0.f;
        for (std::int64_t j = 0; j < Sk; ++j) {
          p[i * Sk + j] = row_max == kNegInf ? 0.f : std::exp(p[i * Sk + j] - row_max);
          sum += p[i * Sk + j];
        }
        out.lse[(b * Hq + h) * Sq + i] = sum > 0 ? row_max + std::log(sum) : -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < Sk; ++j) p[i * Sk + j] = sum > 0 ? r(p[i * Sk + j] / sum) : 0.f;
        for (std::int64_t x = 0; x < Dv; ++x) {
          float acc = 0.f;
          for (std::int64_t j = 0; j < Sk; ++j) acc += p[i * Sk + j] * static_cast<float>(v[vj(b, j, g) + x]);
          out.o[oi(b, i, h) + x] = r(acc);
        }
        // Backward of this row: dP = dO V^T, dS = P (dP - sum(P dP)), each rounded.
        float row_dot = 0.f;
        for (std::int64_t j = 0; j < Sk; ++j) {
          float dp = 0.f;
          for (std::int64_t x = 0; x < Dv; ++x) dp += static_cast<float>(dout[oi(b, i, h) + x] * v[vj(b, j, g) + x]);
          ds[i * Sk + j] = r(dp);
          row_dot += p[i * Sk + j] * ds[i * Sk + j];
        }
        for (std::int64_t j = 0; j < Sk; ++j) ds[i * Sk + j] = r(p[i * Sk + j] * (ds[i * Sk + j] - row_dot));
      }
      for (std::int64_t i = 0; i < Sq; ++i) {
        for (std::int64_t x = 0; x < D; ++x) {
          float acc = 0.f;
          for (std::int64_t j = 0; j < Sk; ++j) acc += ds[i * Sk + j] * static_cast<float>(k[kj(b, j, g) + x]);
          out.dq[qi(b, i, h) + x] = r(r(acc) * scale);
        }
      }
      for (std::int64_t j = 0; j < Sk; ++j) {
        for (std::int64_t x = 0; x < D; ++x) {
          float acc_k = 0.f;
          for (std::int64_t i = 0; i < Sq; ++i) acc_k += ds[i * Sk + j] * qs[i * D + x];
          dk_sum[kj(b, j, g) + x] += r(acc_k);
        }
        for (std::int64_t x = 0; x < Dv; ++x) {
          float acc_v = 0.f;
          for (std::int64_t i = 0; i < Sq; ++i) {
            acc_v += p[i * Sk + j] * static_cast<float>(dout[oi(b, i, h) + x]);
          }
          dv_sum[vj(b, j, g) + x] += r(acc_v);
        }
      }
    }
  });
  // GQA: the group's per-head gradients are summed, then rounded once more.
  out.dk.resize(dk_sum.size());
  out.dv.resize(dv_sum.size());
  for (std::size_t i = 0; i < dk_sum.size(); ++i) out.dk[i] = r(dk_sum[i]);
  for (std::size_t i = 0; i < dv_sum.size(); ++i) out.dv[i] = r(dv_sum[i]);
  return out;
}

// max |a - b| over entries where ref is finite; infinities must match exactly (else +inf).
inline double max_abs_diff(const std::vector<double>& out, const std::vector<double>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) {
      if (out[i] != ref[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    const double diff = std::fabs(out[i] - ref[i]);
    if (!(diff <= worst)) worst = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(worst, diff);
  }
  return worst;
}

// The FlashAttention criterion: max|out - ref| <= 2 max|low - ref| + 1e-5, plus `allowance` where
// a caller states an error the baseline cannot show (its derivation beside the call).
inline ::testing::AssertionResult WithinFlashCriterion(const char* what,
                                                       const std::vector<double>& out,
                                                       const std::vector<double>& low,
                                                       const std::vector<double>& ref,
                                                       double allowance = 0.0) {
  const double kernel_error = max_abs_diff(out, ref);
  const double low_error = max_abs_diff(low, ref);
  const double bound = 2.0 * low_error + 1e-5 + allowance;
  auto result = kernel_error <= bound ? ::testing::AssertionSuccess() : ::testing::AssertionFailure();
  return result << what << ": max|kernel - fp64| = " << kernel_error
                << ", max|low-precision naive - fp64| = " << low_error << ", bound " << bound;
}

}  // namespace ringattn::test
