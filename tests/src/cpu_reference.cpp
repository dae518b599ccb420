// The fp64 oracle (ringattn::reference): its backward against central finite differences of its
// forward, its forward against an independent long-double computation and exact properties
// (one key, no visible key, GQA = expanded MHA, strided views = copies), and its argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::HostTensor;
using test::read_view;
using test::ThrowsNaming;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

HostTensor<double> random_tensor(std::initializer_list<std::int64_t> shape, std::mt19937_64& rng,
                                 double scale = 1.0) {
  HostTensor<double> t(shape);
  test::fill_normal(t.storage, rng, scale);
  return t;
}

// Q, K, V of one problem, N(0, 1) values; V (and O) of the shape's value_dim().
struct Problem {
  AttentionShape s;
  HostTensor<double> q, k, v;
  Problem(const AttentionShape& shape, std::mt19937_64& rng)
      : s(shape),
        q(random_tensor({s.batch, s.q_len, s.q_heads, s.head_dim}, rng)),
        k(random_tensor({s.batch, s.k_len, s.kv_heads, s.head_dim}, rng)),
        v(random_tensor({s.batch, s.k_len, s.kv_heads, s.value_dim()}, rng)) {}
  HostTensor<double> new_o() const { return HostTensor<double>({s.batch, s.q_len, s.q_heads, s.value_dim()}); }
  HostTensor<double> new_lse() const { return HostTensor<double>({s.batch, s.q_heads, s.q_len}); }
};

// ---------------------------------------------------------------------------------------------
// Backward = derivative of the forward (central finite differences).

struct FdCase {
  const char* name;
  AttentionShape s;
  Mask mask;
};

void PrintTo(const FdCase& c, std::ostream* out) { *out << c.name; }

class ReferenceGradient : public testing::TestWithParam<FdCase> {};

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

TEST_P(ReferenceGradient, MatchesFiniteDifferencesOfForward) {
  SCOPED_TRACE(test::seed_trace());
  const FdCase& c = GetParam();
  std::mt19937_64 rng = test::make_rng(1);
  Problem p(c.s, rng);
  const double scale = default_scale(c.s.head_dim);
  // loss = sum(O * W): its gradient with respect to O is W, so dO = W.
  const HostTensor<double> w = random_tensor({c.s.batch, c.s.q_len, c.s.q_heads, c.s.value_dim()}, rng);
  HostTensor<double> o = p.new_o();
  auto loss = [&]() {
    reference::attention_forward(p.q.view, p.k.view, p.v.view, c.mask, scale, o.view, TensorView{});
    return dot(o.storage, w.storage);
  };

  HostTensor<double> dq({c.s.batch, c.s.q_len, c.s.q_heads, c.s.head_dim});
  HostTensor<double> dk({c.s.batch, c.s.k_len, c.s.kv_heads, c.s.head_dim});
  HostTensor<double> dv({c.s.batch, c.s.k_len, c.s.kv_heads, c.s.value_dim()});
  reference::attention_backward(p.q.view, p.k.view, p.v.view, w.view, c.mask, scale, dq.view,
                                dk.view, dv.view);
  ASSERT_EQ(test::count_nan(dq.storage) + test::count_nan(dk.storage) + test::count_nan(dv.storage), 0u)
      << "the backward left gradient elements unwritten";

  struct Input {
    const char* name;
    HostTensor<double>* x;
    const HostTensor<double>* grad;
  };
  const Input inputs[] = {{"q", &p.q, &dq}, {"k", &p.k, &dk}, {"v", &p.v, &dv}};
  constexpr double kEps = 1e-5;
  for (const Input& in : inputs) {
    for (int direction = 0; direction < 3; ++direction) {
      // A unit direction that moves every element of the input.
      std::vector<double> u = test::normal_vector<double>(in.x->storage.size(), rng);
      const double norm = std::sqrt(dot(u, u));
      for (double& value : u) value /= norm;
      const std::vector<double> x0 = in.x->storage;
      for (std::size_t i = 0; i < u.size(); ++i) in.x->storage[i] = x0[i] + kEps * u[i];
      const double plus = loss();
      for (std::size_t i = 0; i < u.size(); ++i) in.x->storage[i] = x0[i] - kEps * u[i];
      const double minus = loss();
      in.x->storage = x0;

      const double numeric = (plus - minus) / (2.0 * kEps);
      const double analytic = dot(in.grad->storage, u);
      // The size of <grad, u> is set by ||grad * u|| (elementwise); dividing by it (or by the
      // value itself when larger) keeps the check meaningful when the sum happens to be small.
      double typical = 0.0;
      for (std::size_t i = 0; i < u.size(); ++i) typical += std::pow(in.grad->storage[i] * u[i], 2);
      const double denominator = std::max(std::fabs(analytic), std::sqrt(typical));
      ASSERT_GT(denominator, 0.0) << in.name << ": gradient is zero";
      const double rel = std::fabs(numeric - analytic) / denominator;
      EXPECT_LT(rel, 1e-6) << "d" << in.name << " direction " << direction << ": finite difference "
                           << numeric << " vs <grad, u> " << analytic;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ReferenceGradient,
    testing::Values(FdCase{"NonCausal", {2, 5, 7, 4, 2, 8}, {false, 0, 0}},
                    FdCase{"CausalQueriesAfterKeys", {2, 5, 7, 4, 2, 8}, {true, 3, 0}},
                    // q_start < k_start: rows 0, 1 see no key, row i >= 2 sees keys 0..i-2.
                    FdCase{"CausalSomeRowsSeeNothing", {2, 5, 7, 4, 2, 8}, {true, 0, 2}},
                    FdCase{"CausalMqa", {1, 6, 6, 3, 1, 5}, {true, 0, 0}},
                    // A value head dim of its own (d_v != d_qk), below and above d_qk.
                    FdCase{"ValueDimBelow", {2, 5, 7, 4, 2, 12, 8}, {false, 0, 0}},
                    FdCase{"ValueDimAboveCausal", {2, 5, 7, 4, 2, 5, 9}, {true, 3, 0}},
                    FdCase{"ValueDimCausalSomeRowsSeeNothing", {1, 5, 7, 2, 1, 6, 3},
                           {true, 0, 2}}),
    [](const testing::TestParamInfo<FdCase>& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Forward against an independent computation and exact properties.

struct ForwardCase {
  const char* name;
  AttentionShape s;
  Mask mask;
};

void PrintTo(const ForwardCase& c, std::ostream* out) { *out << c.name; }

class ReferenceForward : public testing::TestWithParam<ForwardCase> {};

TEST_P(ReferenceForward, MatchesLongDoubleAttention) {
  SCOPED_TRACE(test::seed_trace());
  const ForwardCase& c = GetParam();
  std::mt19937_64 rng = test::make_rng(2);
  Problem p(c.s, rng);
  const double scale = 0.7 / std::sqrt(static_cast<double>(c.s.head_dim));
  HostTensor<double> o = p.new_o(), lse = p.new_lse();
  reference::attention_forward(p.q.view, p.k.view, p.v.view, c.mask, scale, o.view, lse.view);

  std::vector<double> o_ref, lse_ref;
  test::naive_forward<long double>(c.s, p.q.values(), p.k.values(), p.v.values(), c.mask, scale,
                                   o_ref, lse_ref);
  EXPECT_TRUE(test::Close("O", o.values(), o_ref, 1e-13));
  EXPECT_TRUE(test::Close("LSE", lse.values(), lse_ref, 1e-13));
  // Rows that see no key: O exactly 0, LSE exactly -inf.
  for (std::int64_t b = 0; b < c.s.batch; ++b) {
    for (std::int64_t h = 0; h < c.s.q_heads; ++h) {
      for (std::int64_t i = 0; i < c.s.q_len; ++i) {
        if (c.mask.causal && c.mask.q_start + i < c.mask.k_start) {
          EXPECT_EQ(lse.storage[lse.view.offset(b, h, i)], kNegInf) << "row " << i;
          for (std::int64_t x = 0; x < c.s.value_dim(); ++x) {
            ASSERT_EQ(o.storage[o.view.offset(b, i, h, x)], 0.0) << "row " << i << " dim " << x;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ReferenceForward,
    testing::Values(ForwardCase{"NonCausal", {2, 9, 13, 4, 2, 8}, {false, 0, 0}},
                    ForwardCase{"Causal", {2, 13, 13, 6, 3, 5}, {true, 0, 0}},
                    ForwardCase{"CausalOffsets", {1, 9, 13, 4, 4, 8}, {true, 20, 15}},
                    ForwardCase{"CausalRowsWithoutKeys", {2, 11, 6, 4, 1, 8}, {true, 0, 5}},
                    ForwardCase{"CausalNoRowSeesAnything", {1, 4, 6, 2, 1, 8}, {true, 0, 10}},
                    ForwardCase{"ValueDim192x128Gqa", {1, 9, 13, 4, 2, 192, 128}, {false, 0, 0}},
                    ForwardCase{"ValueDim5x11CausalRowsWithoutKeys", {2, 11, 6, 4, 1, 5, 11},
                                {true, 0, 5}}),
    [](const testing::TestParamInfo<ForwardCase>& info) { return std::string(info.param.name); });

TEST(ReferenceAttention, SingleKeyGivesItsValue) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(3);
  const AttentionShape s{2, 7, 1, 6, 2, 16};
  Problem p(s, rng);
  const double scale = default_scale(s.head_dim);
  for (const Mask mask : {Mask{false, 0, 0}, Mask{true, 4, 4}, Mask{true, 9, 2}}) {
    HostTensor<double> o = p.new_o(), lse = p.new_lse();
    reference::attention_forward(p.q.view, p.k.view, p.v.view, mask, scale, o.view, lse.view);
    for (std::int64_t b = 0; b < s.batch; ++b) {
      for (std::int64_t h = 0; h < s.q_heads; ++h) {
        const std::int64_t g = h / (s.q_heads / s.kv_heads);
        for (std::int64_t i = 0; i < s.q_len; ++i) {
          for (std::int64_t x = 0; x < s.head_dim; ++x) {
            ASSERT_EQ(o.storage[o.view.offset(b, i, h, x)], p.v.storage[p.v.view.offset(b, 0, g, x)])
                << "b " << b << " row " << i << " head " << h << " dim " << x;
          }
          long double expected = 0;
          for (std::int64_t x = 0; x < s.head_dim; ++x) {
            expected += static_cast<long double>(p.q.storage[p.q.view.offset(b, i, h, x)]) *
                        p.k.storage[p.k.view.offset(b, 0, g, x)];
          }
          expected *= scale;
          const double got = lse.storage[lse.view.offset(b, h, i)];
          EXPECT_NEAR(got, static_cast<double>(expected), 1e-14 * (1.0 + std::fabs(static_cast<double>(expected))))
              << "LSE of b " << b << " head " << h << " row " << i;
        }
      }
    }
  }
}

TEST(ReferenceAttention, LseIsLogSumExpInLongDouble) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(4);
  const AttentionShape s{1, 6, 40, 2, 2, 8};
  Problem p(s, rng);
  // Scores spread over about +-60: a naive exp in double would still be fine, the point is the
  // value of log(sum(exp)) itself.
  for (double& value : p.q.storage) value *= 6.0;
  for (double& value : p.k.storage) value *= 3.0;
  const double scale = default_scale(s.head_dim);
  HostTensor<double> o = p.new_o(), lse = p.new_lse();
  reference::attention_forward(p.q.view, p.k.view, p.v.view, Mask{}, scale, o.view, lse.view);
  for (std::int64_t h = 0; h < s.q_heads; ++h) {
    for (std::int64_t i = 0; i < s.q_len; ++i) {
      long double sum = 0;
      for (std::int64_t j = 0; j < s.k_len; ++j) {
        long double score = 0;
        for (std::int64_t x = 0; x < s.head_dim; ++x) {
          score += static_cast<long double>(p.q.storage[p.q.view.offset(0, i, h, x)]) *
                   p.k.storage[p.k.view.offset(0, j, h, x)];
        }
        sum += std::exp(score * static_cast<long double>(scale));
      }
      const double expected = static_cast<double>(std::log(sum));
      EXPECT_NEAR(lse.storage[lse.view.offset(0, h, i)], expected, 1e-13 * (1.0 + std::fabs(expected)))
          << "head " << h << " row " << i;
    }
  }
}

// GQA: query head h attends with kv head h / group, exactly as MHA over K/V copied per q head.
TEST(ReferenceAttention, GqaEqualsExpandedMha) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(5);
  for (const AttentionShape s : {AttentionShape{2, 9, 11, 6, 2, 8}, AttentionShape{1, 7, 7, 4, 1, 8}}) {
    Problem p(s, rng);
    const std::int64_t group = s.q_heads / s.kv_heads;
    const Mask mask{true, 3, 0};
    const double scale = default_scale(s.head_dim);
    HostTensor<double> ke({s.batch, s.k_len, s.q_heads, s.head_dim});
    HostTensor<double> ve({s.batch, s.k_len, s.q_heads, s.head_dim});
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t j = 0; j < s.k_len; ++j)
        for (std::int64_t h = 0; h < s.q_heads; ++h)
          for (std::int64_t x = 0; x < s.head_dim; ++x) {
            ke.storage[ke.view.offset(b, j, h, x)] = p.k.storage[p.k.view.offset(b, j, h / group, x)];
            ve.storage[ve.view.offset(b, j, h, x)] = p.v.storage[p.v.view.offset(b, j, h / group, x)];
          }
    HostTensor<double> o = p.new_o(), lse = p.new_lse(), oe = p.new_o(), lsee = p.new_lse();
    reference::attention_forward(p.q.view, p.k.view, p.v.view, mask, scale, o.view, lse.view);
    reference::attention_forward(p.q.view, ke.view, ve.view, mask, scale, oe.view, lsee.view);
    EXPECT_TRUE(test::Close("O", o.values(), oe.values(), 1e-15));
    EXPECT_TRUE(test::Close("LSE", lse.values(), lsee.values(), 1e-15));

    // Backward: dQ alike; dK, dV of a kv head = the sum over its group of the expanded heads'.
    const HostTensor<double> dout = random_tensor({s.batch, s.q_len, s.q_heads, s.head_dim}, rng);
    HostTensor<double> dq = p.new_o(), dk({s.batch, s.k_len, s.kv_heads, s.head_dim}),
                       dv({s.batch, s.k_len, s.kv_heads, s.head_dim});
    HostTensor<double> dqe = p.new_o(), dke({s.batch, s.k_len, s.q_heads, s.head_dim}),
                       dve({s.batch, s.k_len, s.q_heads, s.head_dim});
    reference::attention_backward(p.q.view, p.k.view, p.v.view, dout.view, mask, scale, dq.view,
                                  dk.view, dv.view);
    reference::attention_backward(p.q.view, ke.view, ve.view, dout.view, mask, scale, dqe.view,
                                  dke.view, dve.view);
    std::vector<double> dk_sum(dk.storage.size(), 0.0), dv_sum(dv.storage.size(), 0.0);
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t j = 0; j < s.k_len; ++j)
        for (std::int64_t h = 0; h < s.q_heads; ++h)
          for (std::int64_t x = 0; x < s.head_dim; ++x) {
            dk_sum[dk.view.offset(b, j, h / group, x)] += dke.storage[dke.view.offset(b, j, h, x)];
            dv_sum[dv.view.offset(b, j, h / group, x)] += dve.storage[dve.view.offset(b, j, h, x)];
          }
    EXPECT_TRUE(test::Close("dQ", dq.values(), dqe.values(), 1e-14));
    EXPECT_TRUE(test::Close("dK", dk.values(), dk_sum, 1e-14));
    EXPECT_TRUE(test::Close("dV", dv.values(), dv_sum, 1e-14));
  }
}

// Strided views (a packed QKV buffer, and packed dQKV gradients) read and write the same values
// as contiguous copies.
TEST(ReferenceAttention, PackedViewsEqualContiguousCopies) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(6);
  for (const AttentionShape s : {AttentionShape{2, 13, 13, 4, 4, 8}, AttentionShape{2, 13, 13, 4, 2, 8}}) {
    const std::int64_t B = s.batch, S = s.q_len, Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim;
    const Mask mask{true, 0, 0};
    const double scale = default_scale(D);
    // [B, S, Hq + 2 Hkv, D]: for Hq == Hkv this is the familiar [B, S, 3, H, D].
    test::QkvBuffers<double> packed(s, test::Layout::packed, std::numeric_limits<double>::quiet_NaN());
    test::fill_normal(packed.q_storage, rng);
    HostTensor<double> q({B, S, Hq, D}), k({B, S, Hkv, D}), v({B, S, Hkv, D});
    test::write_view(q.view, read_view(packed.q));
    test::write_view(k.view, read_view(packed.k));
    test::write_view(v.view, read_view(packed.v));

    HostTensor<double> o({B, S, Hq, D}), lse({B, Hq, S});
    reference::attention_forward(q.view, k.view, v.view, mask, scale, o.view, lse.view);
    // Output into a strided view as well: every other row of a buffer twice as long.
    std::vector<double> o_storage(2 * B * S * Hq * D, 7.25);
    const TensorView o_strided =
        test::strided_view(o_storage, 0, {B, S, Hq, D}, {2 * S * Hq * D, 2 * Hq * D, D, 1});
    HostTensor<double> lse2({B, Hq, S});
    reference::attention_forward(packed.q, packed.k, packed.v, mask, scale, o_strided, lse2.view);
    EXPECT_EQ(read_view(o_strided), o.values());
    EXPECT_EQ(lse2.values(), lse.values());
    for (std::int64_t row = 0; row < B * S; ++row) {  // the rows between were left alone
      for (std::int64_t e = 0; e < Hq * D; ++e) ASSERT_EQ(o_storage[(2 * row + 1) * Hq * D + e], 7.25);
    }

    const HostTensor<double> dout = random_tensor({B, S, Hq, D}, rng);
    HostTensor<double> dq({B, S, Hq, D}), dk({B, S, Hkv, D}), dv({B, S, Hkv, D});
    reference::attention_backward(q.view, k.view, v.view, dout.view, mask, scale, dq.view, dk.view, dv.view);
    test::QkvBuffers<double> dpacked(s, test::Layout::packed, std::numeric_limits<double>::quiet_NaN());
    reference::attention_backward(packed.q, packed.k, packed.v, dout.view, mask, scale, dpacked.q,
                                  dpacked.k, dpacked.v);
    EXPECT_EQ(test::count_nan(dpacked.q_storage), 0u) << "packed gradients not fully written";
    EXPECT_EQ(read_view(dpacked.q), dq.values());
    EXPECT_EQ(read_view(dpacked.k), dk.values());
    EXPECT_EQ(read_view(dpacked.v), dv.values());
  }
}

// The backward overwrites its outputs (the CPU/CUDA blocks add; the oracle does not).
TEST(ReferenceAttention, BackwardOverwritesGradients) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(7);
  const AttentionShape s{1, 6, 8, 2, 1, 4};
  Problem p(s, rng);
  const HostTensor<double> dout = random_tensor({1, 6, 2, 4}, rng);
  HostTensor<double> dq1({1, 6, 2, 4}), dk1({1, 8, 1, 4}), dv1({1, 8, 1, 4});
  reference::attention_backward(p.q.view, p.k.view, p.v.view, dout.view, Mask{}, 0.5, dq1.view,
                                dk1.view, dv1.view);
  HostTensor<double> dq2 = random_tensor({1, 6, 2, 4}, rng), dk2 = random_tensor({1, 8, 1, 4}, rng),
                     dv2 = random_tensor({1, 8, 1, 4}, rng);
  reference::attention_backward(p.q.view, p.k.view, p.v.view, dout.view, Mask{}, 0.5, dq2.view,
                                dk2.view, dv2.view);
  EXPECT_EQ(dq1.storage, dq2.storage);
  EXPECT_EQ(dk1.storage, dk2.storage);
  EXPECT_EQ(dv1.storage, dv2.storage);
}

// ---------------------------------------------------------------------------------------------
// Argument checks: every error names the argument and its value, and writes nothing.

class ReferenceValidation : public testing::Test {
 protected:
  ReferenceValidation()
      : rng(test::make_rng(8)), p(AttentionShape{2, 5, 7, 4, 2, 8}, rng), o(p.new_o()),
        lse(p.new_lse()) {}

  testing::AssertionResult ForwardFails(const TensorView& q, const TensorView& k, const TensorView& v,
                                        double scale, const TensorView& o_view, const TensorView& lse_view,
                                        std::initializer_list<std::string_view> parts) {
    o.poison();
    testing::AssertionResult result = ThrowsNaming(
        [&] { reference::attention_forward(q, k, v, Mask{true, 0, 0}, scale, o_view, lse_view); },
        parts);
    if (result && test::count_nan(o.storage) != o.storage.size()) {
      return testing::AssertionFailure() << "the call wrote o before failing: " << result.message();
    }
    return result;
  }
  testing::AssertionResult Fails(const TensorView& q, const TensorView& k, const TensorView& v,
                                 std::initializer_list<std::string_view> parts) {
    return ForwardFails(q, k, v, 0.25, o.view, lse.view, parts);
  }

  std::mt19937_64 rng;
  Problem p;
  HostTensor<double> o, lse;
};

TEST_F(ReferenceValidation, ValidCallSucceeds) {
  EXPECT_NO_THROW(reference::attention_forward(p.q.view, p.k.view, p.v.view, Mask{}, 0.25, o.view, lse.view));
  EXPECT_EQ(test::count_nan(o.storage), 0u);
}

TEST_F(ReferenceValidation, RankOfQ) {
  const TensorView q3 = TensorView::contiguous(p.q.storage.data(), DType::f64, {2, 5, 32});
  EXPECT_TRUE(Fails(q3, p.k.view, p.v.view,
                    {"reference::attention_forward", "q has rank 3", "[2, 5, 32]", "expected rank 4"}));
}

TEST_F(ReferenceValidation, HeadDimOfK) {
  const TensorView k = TensorView::contiguous(p.k.storage.data(), DType::f64, {2, 7, 2, 7});
  EXPECT_TRUE(Fails(p.q.view, k, p.v.view, {"k has shape [2, 7, 2, 7]", "expected [2, 7, 2, 8]"}));
}

TEST_F(ReferenceValidation, BatchOfK) {
  const TensorView k = TensorView::contiguous(p.k.storage.data(), DType::f64, {1, 7, 2, 8});
  EXPECT_TRUE(Fails(p.q.view, k, p.v.view, {"k has shape [1, 7, 2, 8]", "expected [2, 7, 2, 8]"}));
}

TEST_F(ReferenceValidation, LengthOfV) {
  const TensorView v = TensorView::contiguous(p.v.storage.data(), DType::f64, {2, 6, 2, 8});
  EXPECT_TRUE(Fails(p.q.view, p.k.view, v, {"v has shape [2, 6, 2, 8]", "expected [2, 7, 2, 8]"}));
}

TEST_F(ReferenceValidation, QHeadsNotAMultipleOfKvHeads) {
  const TensorView q = TensorView::contiguous(p.q.storage.data(), DType::f64, {2, 5, 3, 8});
  EXPECT_TRUE(Fails(q, p.k.view, p.v.view, {"q has 3 heads", "2 heads of k and v"}));
}

TEST_F(ReferenceValidation, DtypeOfKDiffersFromQ) {
  std::vector<float> k32(p.k.storage.begin(), p.k.storage.end());
  const TensorView k = TensorView::contiguous(k32.data(), DType::f32, {2, 7, 2, 8});
  EXPECT_TRUE(Fails(p.q.view, k, p.v.view, {"k has dtype f32", "expected f64"}));
}

TEST_F(ReferenceValidation, Scale) {
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, 0.0, o.view, lse.view, {"scale is 0"}));
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, -0.5, o.view, lse.view, {"scale is -0.5"}));
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, std::numeric_limits<double>::quiet_NaN(),
                           o.view, lse.view, {"scale is", "nan"}));
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, std::numeric_limits<double>::infinity(),
                           o.view, lse.view, {"scale is", "inf"}));
}

TEST_F(ReferenceValidation, DeviceMemory) {
  TensorView q = p.q.view;
  q.memory = Memory::device;
  EXPECT_TRUE(Fails(q, p.k.view, p.v.view, {"q is in device memory", "expected host memory"}));
  TensorView o_device = o.view;
  o_device.memory = Memory::device;
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, 0.25, o_device, lse.view,
                           {"o is in device memory"}));
}

TEST_F(ReferenceValidation, NullPointer) {
  TensorView v = p.v.view;
  v.data = nullptr;
  EXPECT_TRUE(Fails(p.q.view, p.k.view, v, {"v is a null pointer"}));
  TensorView o_null = o.view;
  o_null.data = nullptr;
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, 0.25, o_null, lse.view, {"o is a null pointer"}));
}

TEST_F(ReferenceValidation, ShapeOfOutputs) {
  const TensorView lse_t = TensorView::contiguous(lse.storage.data(), DType::f64, {2, 5, 4});
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, 0.25, o.view, lse_t,
                           {"lse has shape [2, 5, 4]", "expected [2, 4, 5]"}));
  const TensorView o_t = TensorView::contiguous(o.storage.data(), DType::f64, {2, 4, 5, 8});
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, p.v.view, 0.25, o_t, lse.view,
                           {"o has shape [2, 4, 5, 8]", "expected [2, 5, 4, 8]"}));
}

TEST_F(ReferenceValidation, BackwardArguments) {
  HostTensor<double> dout = random_tensor({2, 5, 4, 8}, rng);
  HostTensor<double> dq({2, 5, 4, 8}), dk({2, 7, 2, 8}), dv({2, 7, 2, 8});
  auto backward = [&](const TensorView& g, const TensorView& a, const TensorView& b, const TensorView& c,
                      double scale) {
    return [&, g, a, b, c, scale] {
      reference::attention_backward(p.q.view, p.k.view, p.v.view, g, Mask{}, scale, a, b, c);
    };
  };
  EXPECT_NO_THROW(backward(dout.view, dq.view, dk.view, dv.view, 0.25)());
  const TensorView dout_t = TensorView::contiguous(dout.storage.data(), DType::f64, {2, 4, 5, 8});
  EXPECT_TRUE(ThrowsNaming(backward(dout_t, dq.view, dk.view, dv.view, 0.25),
                           {"reference::attention_backward", "dout has shape [2, 4, 5, 8]"}));
  const TensorView dk_t = TensorView::contiguous(dk.storage.data(), DType::f64, {2, 7, 1, 16});
  EXPECT_TRUE(ThrowsNaming(backward(dout.view, dq.view, dk_t, dv.view, 0.25),
                           {"dk has shape [2, 7, 1, 16]", "expected [2, 7, 2, 8]"}));
  TensorView dq_null = dq.view;
  dq_null.data = nullptr;
  EXPECT_TRUE(ThrowsNaming(backward(dout.view, dq_null, dk.view, dv.view, 0.25), {"dq is a null pointer"}));
  TensorView dv_device = dv.view;
  dv_device.memory = Memory::device;
  EXPECT_TRUE(ThrowsNaming(backward(dout.view, dq.view, dk.view, dv_device, 0.25), {"dv is in device memory"}));
  EXPECT_TRUE(ThrowsNaming(backward(dout.view, dq.view, dk.view, dv.view, -2.0), {"scale is -2"}));
}

// V of a head dim of its own (d_v 6 against d_qk 8): o, dout and dv must have it, and are named
// with both head dims when they have d_qk instead; dq and dk keep d_qk; V's other extents are K's.
TEST_F(ReferenceValidation, ValueHeadDimOfItsOwn) {
  HostTensor<double> v6 = random_tensor({2, 7, 2, 6}, rng), o6({2, 5, 4, 6});
  HostTensor<double> dout6 = random_tensor({2, 5, 4, 6}, rng);
  HostTensor<double> dq({2, 5, 4, 8}), dk({2, 7, 2, 8}), dv6({2, 7, 2, 6}), dv8({2, 7, 2, 8});
  EXPECT_NO_THROW(reference::attention_forward(p.q.view, p.k.view, v6.view, Mask{}, 0.25, o6.view,
                                               lse.view));
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, v6.view, 0.25, o.view, lse.view,
                           {"reference::attention_forward: o has head_dim 8", "[2, 5, 4, 8]",
                            "expected 6, the head_dim of v (q and k have head_dim 8)"}));
  const TensorView v_short = TensorView::contiguous(v6.storage.data(), DType::f64, {2, 6, 2, 6});
  EXPECT_TRUE(ForwardFails(p.q.view, p.k.view, v_short, 0.25, o6.view, lse.view,
                           {"v has shape [2, 6, 2, 6]", "expected [2, 7, 2, 6]",
                            "batch, k_len and kv_heads of k"}));
  auto backward = [&](const TensorView& g, const TensorView& a, const TensorView& b,
                      const TensorView& c) {
    return [&, g, a, b, c] {
      reference::attention_backward(p.q.view, p.k.view, v6.view, g, Mask{}, 0.25, a, b, c);
    };
  };
  EXPECT_NO_THROW(backward(dout6.view, dq.view, dk.view, dv6.view)());
  HostTensor<double> dout8 = random_tensor({2, 5, 4, 8}, rng);
  EXPECT_TRUE(ThrowsNaming(backward(dout8.view, dq.view, dk.view, dv6.view),
                           {"reference::attention_backward: dout has head_dim 8",
                            "expected 6, the head_dim of v (q and k have head_dim 8)"}));
  EXPECT_TRUE(ThrowsNaming(backward(dout6.view, dq.view, dk.view, dv8.view),
                           {"dv has head_dim 8", "expected 6, the head_dim of v"}));
  EXPECT_TRUE(ThrowsNaming(backward(dout6.view, dq.view, dv6.view, dv6.view),
                           {"dk has shape [2, 7, 2, 6]", "expected [2, 7, 2, 8]",
                            "the shape of k"}));
}

}  // namespace
}  // namespace ringattn
