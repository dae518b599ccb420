// The CPU flash block's test problems (tests/kernels/cpu_flash_*.cpp): one case's inputs rounded
// to f32 or f64 in a memory layout, the block's forward and the backward's prepare with their
// outputs poisoned, gradient buffers holding random values for the block to add into, the fp64
// oracle on the same rounded inputs, and the check of the backward against it. A value head dim
// of its own (AttentionShape::v_head_dim) gives V, O, dO and dV that width; Q, K, dQ and dK keep
// head_dim.
//
// Criteria (TESTING.md): f64 inputs ||out - ref|| / ||ref|| < 1e-12, f32 inputs < 1e-5
// (test::kTolerance of op_testing.hpp, which also holds the ThreadCountGuard and dot these use).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ringattn/attention.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn::test {

// The input dtype of a parameterised test (f64 and f32: the dtypes of the CPU block).
enum class Precision { f64, f32 };
inline std::string precision_name(Precision p) {
  return p == Precision::f64 ? "f64" : "f32";
}
inline void PrintTo(Precision p, std::ostream* out) {
  *out << precision_name(p);
}

enum class Logits { normal, large_offset };

struct FlashCase {
  const char* name;
  AttentionShape s;  // v_head_dim 0: d_v = head_dim
  Mask mask;
  Layout layout = Layout::contiguous;
  Logits logits = Logits::normal;
};

inline void PrintTo(const FlashCase& c, std::ostream* out) {
  *out << c.name;
}

// "<case>_<precision>": the name of a (case, precision) parameter.
inline std::string case_precision_name(
    const ::testing::TestParamInfo<std::tuple<FlashCase, Precision>>& info) {
  return std::string(std::get<0>(info.param).name) + "_" + precision_name(std::get<1>(info.param));
}

// One problem: inputs in the case's layout (rounded to T), O and LSE of the block's forward (in
// the accumulator dtype, which for f32/f64 is T itself), delta, and dO.
template <typename T>
struct FlashProblem {
  AttentionShape s;
  Mask mask;
  double scale;
  Logits logits;
  QkvBuffers<T> qkv;
  HostTensor<T> dout, o, lse, delta;
  std::vector<double> q, k, v, g;  // logical values of the inputs

  FlashProblem(const FlashCase& c, std::mt19937_64& rng)
      : s(c.s),
        mask(c.mask),
        scale(default_scale(c.s.head_dim)),
        logits(c.logits),
        qkv(c.s, c.layout, std::numeric_limits<T>::quiet_NaN()),
        dout({s.batch, s.q_len, s.q_heads, s.value_dim()}),
        o({s.batch, s.q_len, s.q_heads, s.value_dim()}),
        lse({s.batch, s.q_heads, s.q_len}),
        delta({s.batch, s.q_heads, s.q_len}) {
    q = normal_vector<double>(qkv.q.numel(), rng);
    k = normal_vector<double>(qkv.k.numel(), rng);
    v = normal_vector<double>(qkv.v.numel(), rng);
    g = normal_vector<double>(dout.view.numel(), rng);
    if (logits == Logits::large_offset) {
      // Dimension 0 of every q and k about A with A^2 * scale = 1e4: scores = 1e4 + O(1).
      const double a = std::sqrt(1e4 / scale);
      std::normal_distribution<double> jitter(0.0, 1e-4);
      for (std::size_t i = 0; i < q.size(); i += s.head_dim) q[i] = a * (1.0 + jitter(rng));
      for (std::size_t i = 0; i < k.size(); i += s.head_dim) k[i] = a * (1.0 + jitter(rng));
    }
    for (auto* values : {&q, &k, &v, &g}) {
      for (double& x : *values) x = static_cast<double>(static_cast<T>(x));
    }
    write_view(qkv.q, q);
    write_view(qkv.k, k);
    write_view(qkv.v, v);
    write_view(dout.view, g);
  }

  ForwardArgs forward_args() const { return {qkv.q, qkv.k, qkv.v, o.view, lse.view, scale, mask}; }
  void forward() {
    o.poison();
    lse.poison();
    cpu::flash_forward(forward_args());
  }
  void prepare() {
    delta.poison();
    cpu::flash_backward_prepare(o.view, dout.view, delta.view);
  }
  BackwardArgs backward_args(const TensorView& dq, const TensorView& dk,
                             const TensorView& dv) const {
    return {qkv.q, qkv.k, qkv.v, dout.view, lse.view, delta.view, dq, dk, dv, scale, mask};
  }
  BackwardArgs backward_args(const QkvBuffers<T>& grads) const {
    return backward_args(grads.q, grads.k, grads.v);
  }

  struct Forward {
    std::vector<double> o, lse;
  };
  struct Grads {
    std::vector<double> dq, dk, dv;
  };
  // The fp64 oracle on the same (rounded) inputs: O and LSE, and the textbook backward.
  Forward oracle_forward() const {
    HostTensor<double> ro({s.batch, s.q_len, s.q_heads, s.value_dim()});
    HostTensor<double> rlse({s.batch, s.q_heads, s.q_len});
    reference::attention_forward(qkv.q, qkv.k, qkv.v, mask, scale, ro.view, rlse.view);
    return {ro.values(), rlse.values()};
  }
  Grads oracle() const {
    HostTensor<double> dq({s.batch, s.q_len, s.q_heads, s.head_dim});
    HostTensor<double> dk({s.batch, s.k_len, s.kv_heads, s.head_dim});
    HostTensor<double> dv({s.batch, s.k_len, s.kv_heads, s.value_dim()});
    reference::attention_backward(qkv.q, qkv.k, qkv.v, dout.view, mask, scale, dq.view, dk.view,
                                  dv.view);
    return {dq.values(), dk.values(), dv.values()};
  }
};

// Gradient buffers in a layout, pre-filled with random values R (the kernel adds into them).
template <typename T>
struct GradBuffers {
  QkvBuffers<T> buffers;
  std::vector<double> r_q, r_k, r_v;
  GradBuffers(const AttentionShape& s, Layout layout, std::mt19937_64& rng)
      : buffers(s, layout, std::numeric_limits<T>::quiet_NaN()) {
    r_q = normal_vector<double>(buffers.q.numel(), rng);
    r_k = normal_vector<double>(buffers.k.numel(), rng);
    r_v = normal_vector<double>(buffers.v.numel(), rng);
    for (auto* values : {&r_q, &r_k, &r_v}) {
      for (double& x : *values) x = static_cast<double>(static_cast<T>(x));
    }
    write_view(buffers.q, r_q);
    write_view(buffers.k, r_k);
    write_view(buffers.v, r_v);
  }
  // What the kernel added: the buffer minus R.
  std::vector<double> added_q() const { return minus(read_view(buffers.q), r_q); }
  std::vector<double> added_k() const { return minus(read_view(buffers.k), r_k); }
  std::vector<double> added_v() const { return minus(read_view(buffers.v), r_v); }
};

// The backward of a problem whose forward and prepare have run: delta = rowsum(dO * O) against a
// long-double sum over the block's own O, then the gradients added into buffers of `layout`
// holding random values R against the oracle. With logits near 1e4 the f32 problem is
// ill-conditioned (scores carry ~1e-3 absolute rounding error), so there the bound is twice the
// error of the naive backward in the input precision.
template <typename T>
void check_backward(const FlashProblem<T>& p, Layout layout, std::mt19937_64& rng) {
  const AttentionShape& s = p.s;
  std::vector<double> expected(p.delta.storage.size());
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.q_heads; ++h)
      for (std::int64_t i = 0; i < s.q_len; ++i) {
        long double sum = 0;
        for (std::int64_t x = 0; x < s.value_dim(); ++x) {
          sum += static_cast<long double>(p.o.storage[p.o.view.offset(b, i, h, x)]) *
                 p.dout.storage[p.dout.view.offset(b, i, h, x)];
        }
        expected[p.delta.view.offset(b, h, i)] = static_cast<double>(sum);
      }
  EXPECT_TRUE(Close("delta", p.delta.values(), expected, kTolerance<T>));

  GradBuffers<T> grads(s, layout, rng);
  cpu::flash_backward(p.backward_args(grads.buffers));
  const auto ref = p.oracle();
  double tol_q = kTolerance<T>, tol_k = kTolerance<T>, tol_v = kTolerance<T>;
  if (p.logits != Logits::normal) {
    std::vector<double> lq, lk, lv;
    naive_backward<T>(s, p.q, p.k, p.v, p.g, p.mask, p.scale, lq, lk, lv);
    const Diff dq = compare(lq, ref.dq), dk = compare(lk, ref.dk), dv = compare(lv, ref.dv);
    tol_q = std::max(tol_q, 2.0 * dq.rel);
    tol_k = std::max(tol_k, 2.0 * dk.rel);
    tol_v = std::max(tol_v, 2.0 * dv.rel);
    std::printf("  [large logits] naive in input precision: dQ %s\n  dK %s\n  dV %s\n",
                describe(dq).c_str(), describe(dk).c_str(), describe(dv).c_str());
  }
  EXPECT_TRUE(Close("dQ", grads.added_q(), ref.dq, tol_q));
  EXPECT_TRUE(Close("dK", grads.added_k(), ref.dk, tol_k));
  EXPECT_TRUE(Close("dV", grads.added_v(), ref.dv, tol_v));
}

}  // namespace ringattn::test
