// Helpers of the attention tests (reference, CPU flash block, ring): owned host buffers with
// views in several layouts, reading and writing views of any dtype and strides, an independent
// naive attention in a chosen precision, error measures and error-message checks.
//
// The naive attention here is deliberately written apart from src/reference_attention.cpp (its
// own loops, any accumulation type) so that a test can check the oracle itself, and compute the
// "same algorithm in the kernel's input precision" baseline of the FlashAttention criterion.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "src/element_access.hpp"
#include "tests/common/random.hpp"

namespace ringattn::test {

template <typename T>
constexpr DType dtype_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  return std::is_same_v<T, float> ? DType::f32 : DType::f64;
}

// ---------------------------------------------------------------------------------------------
// Reading and writing views of any rank, dtype and strides, in logical row-major order.

namespace detail_views {
template <typename F>
void for_each_offset(const TensorView& t, F&& f) {
  std::array<std::int64_t, 4> shape{1, 1, 1, 1}, strides{0, 0, 0, 0};
  for (int i = 0; i < t.rank; ++i) {
    shape[i] = t.shape[i];
    strides[i] = t.strides[i];
  }
  std::int64_t index = 0;
  for (std::int64_t a = 0; a < shape[0]; ++a)
    for (std::int64_t b = 0; b < shape[1]; ++b)
      for (std::int64_t c = 0; c < shape[2]; ++c)
        for (std::int64_t d = 0; d < shape[3]; ++d)
          f(index++, a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]);
}
}  // namespace detail_views

inline std::vector<double> read_view(const TensorView& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  detail_views::for_each_offset(t, [&](std::int64_t i, std::int64_t offset) {
    out[i] = ringattn::detail::load_element(t, offset);
  });
  return out;
}

inline void write_view(const TensorView& t, const std::vector<double>& values) {
  detail_views::for_each_offset(t, [&](std::int64_t i, std::int64_t offset) {
    ringattn::detail::store_element(t, offset, values[i]);
  });
}

// The bytes of every element of a view (for bitwise comparisons, NaN-safe).
inline std::vector<unsigned char> view_bytes(const TensorView& t) {
  const std::size_t size = dtype_size(t.dtype);
  std::vector<unsigned char> out(static_cast<std::size_t>(t.numel()) * size);
  detail_views::for_each_offset(t, [&](std::int64_t i, std::int64_t offset) {
    std::memcpy(&out[i * size], static_cast<const unsigned char*>(t.data) + offset * size, size);
  });
  return out;
}

// A view `shape` into `storage` starting at element `offset` with explicit strides.
template <typename T>
TensorView strided_view(std::vector<T>& storage, std::int64_t offset,
                        std::initializer_list<std::int64_t> shape,
                        std::initializer_list<std::int64_t> strides) {
  TensorView view = TensorView::contiguous(storage.data() + offset, dtype_of<T>(), shape);
  return view.with_strides(strides);
}

// A contiguous host tensor that owns its storage (NaN-poisoned unless told otherwise). Moves keep
// the view valid (a moved vector keeps its buffer); copies are not allowed.
template <typename T>
struct HostTensor {
  std::vector<T> storage;
  TensorView view;

  HostTensor() = default;
  explicit HostTensor(std::initializer_list<std::int64_t> shape,
                      T fill = std::numeric_limits<T>::quiet_NaN()) {
    std::int64_t count = 1;
    for (std::int64_t extent : shape) count *= extent;
    storage.assign(static_cast<std::size_t>(count), fill);
    view = TensorView::contiguous(storage.data(), dtype_of<T>(), shape);
  }
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;

  void poison() { fill_nan(storage); }
  std::vector<double> values() const { return read_view(view); }
};

// ---------------------------------------------------------------------------------------------
// Q, K, V in three memory layouts.

enum class Layout {
  contiguous,  // separate [B, S, H, D] buffers
  packed,      // one [B, S, Hq + 2 Hkv, D] buffer (needs Sq == Sk): Q, K, V are strided views
  head_major,  // [B, H, S, D] buffers viewed as [B, S, H, D] (sequence stride D)
};

inline const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::contiguous: return "contiguous";
    case Layout::packed: return "packed";
    case Layout::head_major: return "head_major";
  }
  return "?";
}

// Storage for q/k/v-like triples (also for dq/dk/dv): views of the given layout; v has the
// shape's value_dim() (d_v), q and k its head_dim (d_qk).
template <typename T>
struct QkvBuffers {
  std::vector<T> q_storage, k_storage, v_storage;  // packed: everything in q_storage
  TensorView q, k, v;

  QkvBuffers(const AttentionShape& s, Layout layout, T fill) {
    const std::int64_t B = s.batch, Sq = s.q_len, Sk = s.k_len, Hq = s.q_heads,
                       Hkv = s.kv_heads, D = s.head_dim, Dv = s.value_dim();
    switch (layout) {
      case Layout::contiguous:
        q_storage.assign(B * Sq * Hq * D, fill);
        k_storage.assign(B * Sk * Hkv * D, fill);
        v_storage.assign(B * Sk * Hkv * Dv, fill);
        q = TensorView::contiguous(q_storage.data(), dtype_of<T>(), {B, Sq, Hq, D});
        k = TensorView::contiguous(k_storage.data(), dtype_of<T>(), {B, Sk, Hkv, D});
        v = TensorView::contiguous(v_storage.data(), dtype_of<T>(), {B, Sk, Hkv, Dv});
        break;
      case Layout::packed: {
        const std::int64_t row = (Hq + Hkv) * D + Hkv * Dv;  // one token: its q, k and v heads
        q_storage.assign(B * Sq * row, fill);
        q = strided_view(q_storage, 0, {B, Sq, Hq, D}, {Sq * row, row, D, 1});
        k = strided_view(q_storage, Hq * D, {B, Sk, Hkv, D}, {Sk * row, row, D, 1});
        v = strided_view(q_storage, (Hq + Hkv) * D, {B, Sk, Hkv, Dv}, {Sk * row, row, Dv, 1});
        break;
      }
      case Layout::head_major:
        q_storage.assign(B * Sq * Hq * D, fill);
        k_storage.assign(B * Sk * Hkv * D, fill);
        v_storage.assign(B * Sk * Hkv * Dv, fill);
        q = strided_view(q_storage, 0, {B, Sq, Hq, D}, {Hq * Sq * D, D, Sq * D, 1});
        k = strided_view(k_storage, 0, {B, Sk, Hkv, D}, {Hkv * Sk * D, D, Sk * D, 1});
        v = strided_view(v_storage, 0, {B, Sk, Hkv, Dv}, {Hkv * Sk * Dv, Dv, Sk * Dv, 1});
        break;
    }
  }
  QkvBuffers(const QkvBuffers&) = delete;
  QkvBuffers& operator=(const QkvBuffers&) = delete;
};

// An output [B, S, H, D] view over a [B, S, H, D + 3] buffer: a write past the end of a head's row
// shows up in the padding. The padding holds `sentinel`, the view itself starts NaN-poisoned.
template <typename T>
struct PaddedTensor {
  static constexpr std::int64_t kPad = 3;
  std::vector<T> storage;
  TensorView view;
  T sentinel;

  PaddedTensor(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d, T sentinel_value)
      : sentinel(sentinel_value) {
    const std::int64_t dp = d + kPad;
    storage.assign(b * s * h * dp, sentinel);
    view = strided_view(storage, 0, {b, s, h, d}, {s * h * dp, h * dp, dp, 1});
    write_view(view, std::vector<double>(view.numel(), std::numeric_limits<double>::quiet_NaN()));
  }
  PaddedTensor(const PaddedTensor&) = delete;
  PaddedTensor& operator=(const PaddedTensor&) = delete;

  // Elements outside the view that no longer hold the sentinel.
  std::int64_t padding_changed() const {
    const std::int64_t dp = view.shape[3] + kPad;
    std::int64_t changed = 0;
    for (std::size_t i = 0; i < storage.size(); ++i) {
      if (static_cast<std::int64_t>(i % dp) >= view.shape[3] &&
          std::memcmp(&storage[i], &sentinel, sizeof(T)) != 0) {
        ++changed;
      }
    }
    return changed;
  }
};

// ---------------------------------------------------------------------------------------------
// Independent naive attention on logical [B, S, H, D] values (V, O, dO, dV: [B, S, H, Dv] with
// Dv = s.value_dim(); LSE [B, Hq, Sq]), every operation in `Acc`: long double for an independent
// check of the oracle, float for the "same inputs in fp32" baseline. Returns O and LSE as doubles.

// The mask's definition (ringattn/attention.hpp) for batch row b, written once more: two
// positions share a document when no start lies in (min, max] of them. Host document lists only.
inline bool sees(const Mask& mask, std::int64_t b, std::int64_t i, std::int64_t j) {
  const long double query = static_cast<long double>(mask.q_start) + i;
  const long double key = static_cast<long double>(mask.k_start) + j;
  if (mask.causal && key > query) return false;
  if (mask.window_left > 0 && query - key >= mask.window_left) return false;
  if (mask.window_right > 0 && key - query >= mask.window_right) return false;
  const std::int64_t* starts = mask.documents.data + b * mask.documents.batch_stride;
  const std::int64_t low = std::min(mask.q_start + i, mask.k_start + j);
  const std::int64_t high = std::max(mask.q_start + i, mask.k_start + j);
  for (std::int64_t n = 0; n < mask.documents.count; ++n) {
    if (starts[n] > low && starts[n] <= high) return false;
  }
  return true;
}

template <typename Acc>
void naive_forward(const AttentionShape& s, const std::vector<double>& q,
                   const std::vector<double>& k, const std::vector<double>& v, const Mask& mask,
                   double scale, std::vector<double>& o, std::vector<double>& lse) {
  const std::int64_t B = s.batch, Sq = s.q_len, Sk = s.k_len, Hq = s.q_heads, Hkv = s.kv_heads,
                     D = s.head_dim, Dv = s.value_dim(), group = Hq / Hkv;
  o.assign(B * Sq * Hq * Dv, 0.0);
  lse.assign(B * Hq * Sq, 0.0);
  std::vector<Acc> scores(Sk), out(Dv);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t g = h / group;
      for (std::int64_t i = 0; i < Sq; ++i) {
        const double* qi = &q[((b * Sq + i) * Hq + h) * D];
        Acc row_max = -std::numeric_limits<Acc>::infinity();
        for (std::int64_t j = 0; j < Sk; ++j) {
          if (!sees(mask, b, i, j)) continue;
          const double* kj = &k[((b * Sk + j) * Hkv + g) * D];
          Acc dot = 0;
          for (std::int64_t x = 0; x < D; ++x) dot += static_cast<Acc>(qi[x]) * static_cast<Acc>(kj[x]);
          scores[j] = dot * static_cast<Acc>(scale);
          row_max = std::max(row_max, scores[j]);
        }
        std::fill(out.begin(), out.end(), Acc(0));
        Acc sum = 0;
        if (row_max != -std::numeric_limits<Acc>::infinity()) {
          for (std::int64_t j = 0; j < Sk; ++j) {
            if (!sees(mask, b, i, j)) continue;
            const Acc p = std::exp(scores[j] - row_max);
            sum += p;
            const double* vj = &v[((b * Sk + j) * Hkv + g) * Dv];
            for (std::int64_t x = 0; x < Dv; ++x) out[x] += p * static_cast<Acc>(vj[x]);
          }
        }
        double* oi = &o[((b * Sq + i) * Hq + h) * Dv];
        for (std::int64_t x = 0; x < Dv; ++x) oi[x] = sum > 0 ? static_cast<double>(out[x] / sum) : 0.0;
        lse[(b * Hq + h) * Sq + i] = sum > 0 ? static_cast<double>(row_max + std::log(sum))
                                             : -std::numeric_limits<double>::infinity();
      }
    }
  }
}

// Textbook backward in `Acc` (P recomputed, dS = P * (dP - rowsum(P * dP))).
template <typename Acc>
void naive_backward(const AttentionShape& s, const std::vector<double>& q,
                    const std::vector<double>& k, const std::vector<double>& v,
                    const std::vector<double>& dout, const Mask& mask, double scale,
                    std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv) {
  const std::int64_t B = s.batch, Sq = s.q_len, Sk = s.k_len, Hq = s.q_heads, Hkv = s.kv_heads,
                     D = s.head_dim, Dv = s.value_dim(), group = Hq / Hkv;
  std::vector<Acc> dq_acc(B * Sq * Hq * D, 0), dk_acc(B * Sk * Hkv * D, 0),
      dv_acc(B * Sk * Hkv * Dv, 0);
  std::vector<Acc> p(Sk), dp(Sk);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t g = h / group;
      for (std::int64_t i = 0; i < Sq; ++i) {
        const double* qi = &q[((b * Sq + i) * Hq + h) * D];
        const double* gi = &dout[((b * Sq + i) * Hq + h) * Dv];
        Acc row_max = -std::numeric_limits<Acc>::infinity();
        for (std::int64_t j = 0; j < Sk; ++j) {
          p[j] = 0;
          if (!sees(mask, b, i, j)) continue;
          const double* kj = &k[((b * Sk + j) * Hkv + g) * D];
          Acc dot = 0;
          for (std::int64_t x = 0; x < D; ++x) dot += static_cast<Acc>(qi[x]) * static_cast<Acc>(kj[x]);
          p[j] = dot * static_cast<Acc>(scale);
          row_max = std::max(row_max, p[j]);
        }
        if (row_max == -std::numeric_limits<Acc>::infinity()) continue;
        Acc sum = 0;
        for (std::int64_t j = 0; j < Sk; ++j) {
          p[j] = sees(mask, b, i, j) ? std::exp(p[j] - row_max) : Acc(0);
          sum += p[j];
        }
        Acc row_dot = 0;
        for (std::int64_t j = 0; j < Sk; ++j) {
          p[j] /= sum;
          const double* vj = &v[((b * Sk + j) * Hkv + g) * Dv];
          Acc dot = 0;
          for (std::int64_t x = 0; x < Dv; ++x) dot += static_cast<Acc>(gi[x]) * static_cast<Acc>(vj[x]);
          dp[j] = dot;
          row_dot += p[j] * dot;
        }
        for (std::int64_t j = 0; j < Sk; ++j) {
          if (p[j] == 0) continue;
          const Acc ds = p[j] * (dp[j] - row_dot) * static_cast<Acc>(scale);
          const double* kj = &k[((b * Sk + j) * Hkv + g) * D];
          Acc* dqi = &dq_acc[((b * Sq + i) * Hq + h) * D];
          Acc* dkj = &dk_acc[((b * Sk + j) * Hkv + g) * D];
          Acc* dvj = &dv_acc[((b * Sk + j) * Hkv + g) * Dv];
          for (std::int64_t x = 0; x < D; ++x) {
            dqi[x] += ds * static_cast<Acc>(kj[x]);
            dkj[x] += ds * static_cast<Acc>(qi[x]);
          }
          for (std::int64_t x = 0; x < Dv; ++x) dvj[x] += p[j] * static_cast<Acc>(gi[x]);
        }
      }
    }
  }
  dq.assign(dq_acc.begin(), dq_acc.end());
  dk.assign(dk_acc.begin(), dk_acc.end());
  dv.assign(dv_acc.begin(), dv_acc.end());
}

// ---------------------------------------------------------------------------------------------
// RoPE of the keys (BackwardArgs::key_rotation): tables of random angles, and the transpose of the
// rotation applied in double to gradients of contiguous [batch, k_len, kv_heads, head_dim].

template <typename T>
struct KeyRotationTables {
  std::int64_t rows = 0, half = 0;
  std::vector<T> cos, sin;  // [rows, half]
};

template <typename T>
KeyRotationTables<T> random_key_rotation(std::int64_t rows, std::int64_t head_dim,
                                         std::mt19937_64& rng) {
  KeyRotationTables<T> t{rows, head_dim / 2, {}, {}};
  std::uniform_real_distribution<double> angle(-4.0, 4.0);
  for (std::int64_t i = 0; i < rows * t.half; ++i) {
    const double a = angle(rng);
    t.cos.push_back(static_cast<T>(std::cos(a)));
    t.sin.push_back(static_cast<T>(std::sin(a)));
  }
  return t;
}

// dk (the gradient with respect to rotated keys) -> the gradient with respect to the keys before
// the rotation; also |x c| + |y s| of each element (the scale of its rounding in a kernel).
template <typename T>
void rotate_keys_back(const std::vector<double>& dk, const AttentionShape& s,
                      const KeyRotationTables<T>& t, std::vector<double>& out,
                      std::vector<double>& magnitude) {
  const std::int64_t d = s.head_dim, half = d / 2;
  out.assign(dk.size(), 0.0);
  magnitude.assign(dk.size(), 0.0);
  for (std::size_t at = 0; at < dk.size(); at += static_cast<std::size_t>(d)) {
    const std::int64_t key = static_cast<std::int64_t>(at) / (d * s.kv_heads) % s.k_len;
    for (std::int64_t i = 0; i < half; ++i) {
      const double c = t.cos[key * half + i], sn = t.sin[key * half + i];
      const double x = dk[at + i], y = dk[at + i + half];
      out[at + i] = x * c + y * sn;
      out[at + i + half] = y * c - x * sn;
      magnitude[at + i] = magnitude[at + i + half] = std::abs(x * c) + std::abs(y * sn) +
                                                     std::abs(x * sn) + std::abs(y * c);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Error measures.

// ||out - ref|| / ||ref|| over the finite entries of `ref`; infinite entries must match exactly
// and no output may be NaN (a NaN is an element the call did not write, or a real NaN).
struct Diff {
  double rel = 0.0;
  double max_abs = 0.0;
  std::int64_t nan = 0;
  std::int64_t inf_mismatch = 0;
  std::int64_t first_bad = -1;  // index of the first NaN or infinity mismatch
  std::int64_t count = 0;
};

inline Diff compare(const std::vector<double>& out, const std::vector<double>& ref) {
  Diff d;
  d.count = static_cast<std::int64_t>(ref.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double o = out[i], r = ref[i];
    if (std::isnan(o) || std::isnan(r)) {
      ++d.nan;
      if (d.first_bad < 0) d.first_bad = static_cast<std::int64_t>(i);
      continue;
    }
    if (std::isinf(o) || std::isinf(r)) {
      if (o != r) {
        ++d.inf_mismatch;
        if (d.first_bad < 0) d.first_bad = static_cast<std::int64_t>(i);
      }
      continue;
    }
    num += (o - r) * (o - r);
    den += r * r;
    d.max_abs = std::max(d.max_abs, std::fabs(o - r));
  }
  d.rel = den > 0.0 ? std::sqrt(num / den) : (num > 0.0 ? std::numeric_limits<double>::infinity() : 0.0);
  return d;
}

inline std::string describe(const Diff& d) {
  std::ostringstream out;
  out.precision(3);
  out << "relative error " << d.rel << ", max abs error " << d.max_abs << ", " << d.nan
      << " NaN, " << d.inf_mismatch << " infinity mismatches";
  if (d.first_bad >= 0) out << " (first at logical index " << d.first_bad << ")";
  out << ", " << d.count << " elements";
  return out.str();
}

// Passes when out matches ref within `tolerance` relative error, with no NaN and exact infinities.
inline ::testing::AssertionResult Close(const char* what, const std::vector<double>& out,
                                        const std::vector<double>& ref, double tolerance) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << what << ": " << out.size() << " values, expected "
                                         << ref.size();
  }
  const Diff d = compare(out, ref);
  if (d.nan == 0 && d.inf_mismatch == 0 && d.rel <= tolerance) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << what << ": " << describe(d) << "; tolerance "
                                       << tolerance << " [" << seed_trace() << "]";
}

// Element-wise sum / difference of logical vectors.
inline std::vector<double> minus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

// ---------------------------------------------------------------------------------------------
// Error messages: the call throws ringattn::Error whose message contains every part.

template <typename F>
::testing::AssertionResult ThrowsNaming(F&& call, std::initializer_list<std::string_view> parts) {
  std::string message;
  try {
    call();
    return ::testing::AssertionFailure() << "no ringattn::Error was thrown";
  } catch (const Error& error) {
    message = error.what();
  } catch (const std::exception& error) {
    return ::testing::AssertionFailure() << "threw a non-ringattn exception: " << error.what();
  }
  for (std::string_view part : parts) {
    if (message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "the message \"" << message << "\" does not contain \""
                                           << part << "\"";
    }
  }
  return ::testing::AssertionSuccess() << message;
}

}  // namespace ringattn::test
