// The CPU flash block with a value head dim d_v of its own (V, O, dO, dV [.., d_v]; Q, K, dQ, dK
// [.., d_qk]), as multi-head latent attention uses (192/128), and head dims the CUDA block has no
// kernels for (96, 256, odd sizes): forward, combine mode and backward against the fp64 oracle,
// the backward against central finite differences of the block's own forward, the backward's
// prepare with a dQ of d_qk, and the checks that name both head dims.
//
// Criteria (tests/TESTING.md): f64 inputs ||out - ref|| / ||ref|| < 1e-12, f32 inputs < 1e-5
// against the oracle on the same (rounded) inputs; gradients against finite differences in fp64,
// relative error under 1e-6. The softmax scale is 1/sqrt(d_qk) throughout.
#include <gtest/gtest.h>

#include <algorithm>
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
using test::Layout;
using test::read_view;
using test::ThrowsNaming;

template <typename T>
constexpr double kTolerance = std::is_same_v<T, double> ? 1e-12 : 1e-5;

struct Case {
  const char* name;
  AttentionShape s;  // v_head_dim set: d_v
  Mask mask;
  Layout layout = Layout::contiguous;
};

void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

enum class Precision { f64, f32 };
std::string precision_name(Precision p) { return p == Precision::f64 ? "f64" : "f32"; }
void PrintTo(Precision p, std::ostream* out) { *out << precision_name(p); }

// Shapes that break the 64 x 64 tiles on either side, GQA 1, 2, 4 and 8, causal masks with
// global offsets (rows that see nothing, masked tiles), strided layouts, and d_v below, above and
// equal to d_qk.
const Case kCases[] = {
    {"Mla192x128S130CausalGqa2", {1, 130, 130, 4, 2, 192, 128}, {true, 0, 0}},
    {"Mla192x128S1Batch2", {2, 1, 1, 4, 4, 192, 128}, {}},
    {"D32Dv64S127", {2, 127, 127, 2, 2, 32, 64}, {}},
    {"D96Dv96S65CausalGqa4", {1, 65, 65, 4, 1, 96, 96}, {true, 0, 0}},
    {"D256Dv256S70Causal", {1, 70, 70, 2, 1, 256, 256}, {true, 0, 0}},
    {"D40Dv24Sq17Sk129Batch2", {2, 17, 129, 4, 4, 40, 24}, {true, 100, 0}},
    {"D24Dv40CausalRowsWithoutKeys", {1, 127, 65, 4, 2, 24, 40}, {true, 64, 100}},
    {"D40Dv24S100CausalGqa8", {1, 100, 100, 8, 1, 40, 24}, {true, 0, 0}},
    {"D64Dv1", {1, 33, 40, 2, 1, 64, 1}, {}},
    {"D1Dv7Causal", {2, 20, 20, 2, 2, 1, 7}, {true, 0, 0}},
    {"PackedD48Dv16CausalGqa", {2, 127, 127, 4, 2, 48, 16}, {true, 0, 0}, Layout::packed},
    {"HeadMajorD16Dv48SqNeSk", {2, 100, 130, 4, 4, 16, 48}, {true, 80, 0}, Layout::head_major},
};

// One problem: inputs in `layout` (rounded to T), O and LSE of the block's forward, dO.
template <typename T>
struct Problem {
  AttentionShape s;
  Mask mask;
  double scale;
  test::QkvBuffers<T> qkv;
  HostTensor<T> dout, o, lse, delta;

  Problem(const Case& c, std::mt19937_64& rng)
      : s(c.s), mask(c.mask), scale(default_scale(c.s.head_dim)),
        qkv(c.s, c.layout, std::numeric_limits<T>::quiet_NaN()),
        dout({s.batch, s.q_len, s.q_heads, s.v_head_dim}),
        o({s.batch, s.q_len, s.q_heads, s.v_head_dim}), lse({s.batch, s.q_heads, s.q_len}),
        delta({s.batch, s.q_heads, s.q_len}) {
    for (const TensorView* t : {&qkv.q, &qkv.k, &qkv.v, &dout.view}) {
      std::vector<double> values = test::normal_vector<double>(t->numel(), rng);
      for (double& x : values) x = static_cast<double>(static_cast<T>(x));
      test::write_view(*t, values);
    }
  }

  ForwardArgs forward_args() const {
    ForwardArgs args;
    args.q = qkv.q;
    args.k = qkv.k;
    args.v = qkv.v;
    args.o = o.view;
    args.lse = lse.view;
    args.scale = scale;
    args.mask = mask;
    return args;
  }
  void forward_and_prepare() {
    o.poison();
    lse.poison();
    delta.poison();
    cpu::flash_forward(forward_args());
    cpu::flash_backward_prepare(o.view, dout.view, delta.view);
  }
  BackwardArgs backward_args(const test::QkvBuffers<T>& grads) const {
    BackwardArgs args;
    args.q = qkv.q;
    args.k = qkv.k;
    args.v = qkv.v;
    args.dout = dout.view;
    args.lse = lse.view;
    args.delta = delta.view;
    args.dq = grads.q;
    args.dk = grads.k;
    args.dv = grads.v;
    args.scale = scale;
    args.mask = mask;
    return args;
  }

  struct Expected {
    std::vector<double> o, lse, dq, dk, dv;
  };
  Expected oracle() const {
    HostTensor<double> ro({s.batch, s.q_len, s.q_heads, s.v_head_dim});
    HostTensor<double> rlse({s.batch, s.q_heads, s.q_len});
    HostTensor<double> dq({s.batch, s.q_len, s.q_heads, s.head_dim});
    HostTensor<double> dk({s.batch, s.k_len, s.kv_heads, s.head_dim});
    HostTensor<double> dv({s.batch, s.k_len, s.kv_heads, s.v_head_dim});
    reference::attention_forward(qkv.q, qkv.k, qkv.v, mask, scale, ro.view, rlse.view);
    reference::attention_backward(qkv.q, qkv.k, qkv.v, dout.view, mask, scale, dq.view, dk.view,
                                  dv.view);
    return {ro.values(), rlse.values(), dq.values(), dk.values(), dv.values()};
  }
};

class FlashValueDims : public testing::TestWithParam<std::tuple<Case, Precision>> {};

// Forward (O, LSE, and delta = rowsum(dO * O) over d_v) and backward against the oracle; the
// gradients go to buffers of the case's layout holding random values R, which the block adds to.
template <typename T>
void run_case(const Case& c) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(60);
  Problem<T> p(c, rng);
  p.forward_and_prepare();
  const auto ref = p.oracle();
  EXPECT_TRUE(test::Close("O", p.o.values(), ref.o, kTolerance<T>));
  EXPECT_TRUE(test::Close("LSE", p.lse.values(), ref.lse, kTolerance<T>));

  std::vector<double> delta(p.delta.storage.size());
  const std::vector<double> o = p.o.values(), g = p.dout.values();
  const std::int64_t dv = p.s.v_head_dim;
  for (std::int64_t row = 0; row < p.s.batch * p.s.q_len * p.s.q_heads; ++row) {
    const std::int64_t h = row % p.s.q_heads, i = row / p.s.q_heads % p.s.q_len,
                       b = row / (p.s.q_heads * p.s.q_len);
    long double sum = 0;
    for (std::int64_t x = 0; x < dv; ++x) {
      sum += static_cast<long double>(o[row * dv + x]) * g[row * dv + x];
    }
    delta[(b * p.s.q_heads + h) * p.s.q_len + i] = static_cast<double>(sum);
  }
  EXPECT_TRUE(test::Close("delta", p.delta.values(), delta, kTolerance<T>));

  test::QkvBuffers<T> grads(p.s, c.layout, T(0));
  std::vector<double> r[3];
  const TensorView* views[] = {&grads.q, &grads.k, &grads.v};
  for (int i = 0; i < 3; ++i) {
    r[i] = test::normal_vector<double>(views[i]->numel(), rng);
    for (double& x : r[i]) x = static_cast<double>(static_cast<T>(x));
    test::write_view(*views[i], r[i]);
  }
  cpu::flash_backward(p.backward_args(grads));
  EXPECT_TRUE(test::Close("dQ", test::minus(read_view(grads.q), r[0]), ref.dq, kTolerance<T>));
  EXPECT_TRUE(test::Close("dK", test::minus(read_view(grads.k), r[1]), ref.dk, kTolerance<T>));
  EXPECT_TRUE(test::Close("dV", test::minus(read_view(grads.v), r[2]), ref.dv, kTolerance<T>));
}

TEST_P(FlashValueDims, ForwardAndBackwardMatchTheOracle) {
  const auto& [c, precision] = GetParam();
  if (precision == Precision::f64) {
    run_case<double>(c);
  } else {
    run_case<float>(c);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FlashValueDims,
    testing::Combine(testing::ValuesIn(kCases), testing::Values(Precision::f64, Precision::f32)),
    [](const testing::TestParamInfo<std::tuple<Case, Precision>>& info) {
      return std::string(std::get<0>(info.param).name) + "_" +
             precision_name(std::get<1>(info.param));
    });

// Combine mode: a running fp64 (O, LSE) of d_v merged over K/V chunks (out of order, one of them
// masked for some rows) equals attention over all of them, and the backward summed over the same
// chunks with the final O and LSE (how the ring calls it) equals the whole backward.
TEST(FlashValueDimsChunks, CombinedChunksAndSummedGradientsEqualOneShot) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(61);
  const Case c{"", {2, 120, 300, 4, 2, 48, 80}, {true, 100, 0}};
  Problem<double> p(c, rng);
  const std::int64_t bounds[] = {0, 130, 220, 300};
  HostTensor<double> o({p.s.batch, p.s.q_len, p.s.q_heads, p.s.v_head_dim}, 0.0);
  HostTensor<double> lse({p.s.batch, p.s.q_heads, p.s.q_len},
                         -std::numeric_limits<double>::infinity());
  auto chunk_of = [&](TensorView t, int chunk) {
    t.data = static_cast<double*>(t.data) + bounds[chunk] * t.strides[1];
    t.shape[1] = bounds[chunk + 1] - bounds[chunk];
    return t;
  };
  for (const int chunk : {1, 2, 0}) {
    ForwardArgs args = p.forward_args();
    args.k = chunk_of(p.qkv.k, chunk);
    args.v = chunk_of(p.qkv.v, chunk);
    args.o = o.view;
    args.lse = lse.view;
    args.mask.k_start = bounds[chunk];
    args.combine = true;
    cpu::flash_forward(args);
  }
  const auto ref = p.oracle();
  EXPECT_TRUE(test::Close("O (combined)", o.values(), ref.o, 1e-12));
  EXPECT_TRUE(test::Close("LSE (combined)", lse.values(), ref.lse, 1e-12));

  p.forward_and_prepare();
  test::QkvBuffers<double> grads(p.s, Layout::contiguous, 0.0);
  for (const int chunk : {2, 0, 1}) {
    BackwardArgs args = p.backward_args(grads);
    args.k = chunk_of(p.qkv.k, chunk);
    args.v = chunk_of(p.qkv.v, chunk);
    args.dk = chunk_of(grads.k, chunk);
    args.dv = chunk_of(grads.v, chunk);
    args.mask.k_start = bounds[chunk];
    cpu::flash_backward(args);
  }
  EXPECT_TRUE(test::Close("dQ (summed)", read_view(grads.q), ref.dq, 1e-12));
  EXPECT_TRUE(test::Close("dK (summed)", read_view(grads.k), ref.dk, 1e-12));
  EXPECT_TRUE(test::Close("dV (summed)", read_view(grads.v), ref.dv, 1e-12));
}

// ---------------------------------------------------------------------------------------------
// The block's backward is the derivative of the block's forward: loss = sum(O * W) with O from
// cpu::flash_forward, so dO = W; the gradient along random unit directions that move every element
// of q, k or v against central finite differences.

struct FdCase {
  const char* name;
  AttentionShape s;
  Mask mask;
};

void PrintTo(const FdCase& c, std::ostream* out) { *out << c.name; }

class FlashValueDimsGradient : public testing::TestWithParam<FdCase> {};

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

TEST_P(FlashValueDimsGradient, MatchesFiniteDifferencesOfTheForward) {
  SCOPED_TRACE(test::seed_trace());
  const FdCase& fd = GetParam();
  std::mt19937_64 rng = test::make_rng(62);
  Problem<double> p(Case{fd.name, fd.s, fd.mask}, rng);
  const AttentionShape& s = p.s;
  auto loss = [&] {
    p.o.poison();
    p.lse.poison();
    cpu::flash_forward(p.forward_args());
    return dot(p.o.storage, p.dout.storage);
  };
  p.forward_and_prepare();
  test::QkvBuffers<double> grads(s, Layout::contiguous, 0.0);
  cpu::flash_backward(p.backward_args(grads));
  ASSERT_EQ(test::count_nan(grads.q_storage) + test::count_nan(grads.k_storage) +
                test::count_nan(grads.v_storage),
            0u);

  struct Input {
    const char* name;
    std::vector<double>* x;
    const std::vector<double>* grad;
  };
  const Input inputs[] = {{"q", &p.qkv.q_storage, &grads.q_storage},
                          {"k", &p.qkv.k_storage, &grads.k_storage},
                          {"v", &p.qkv.v_storage, &grads.v_storage}};
  constexpr double kEps = 1e-5;
  for (const Input& in : inputs) {
    for (int direction = 0; direction < 3; ++direction) {
      std::vector<double> u = test::normal_vector<double>(in.x->size(), rng);
      const double norm = std::sqrt(dot(u, u));
      for (double& value : u) value /= norm;
      const std::vector<double> x0 = *in.x;
      for (std::size_t i = 0; i < u.size(); ++i) (*in.x)[i] = x0[i] + kEps * u[i];
      const double plus = loss();
      for (std::size_t i = 0; i < u.size(); ++i) (*in.x)[i] = x0[i] - kEps * u[i];
      const double minus = loss();
      *in.x = x0;
      const double numeric = (plus - minus) / (2.0 * kEps);
      const double analytic = dot(*in.grad, u);
      // As in the oracle's test (tests/src/cpu_reference.cpp): the scale of <grad, u>.
      double typical = 0.0;
      for (std::size_t i = 0; i < u.size(); ++i) typical += std::pow((*in.grad)[i] * u[i], 2);
      const double denominator = std::max(std::fabs(analytic), std::sqrt(typical));
      ASSERT_GT(denominator, 0.0) << in.name << ": gradient is zero";
      EXPECT_LT(std::fabs(numeric - analytic) / denominator, 1e-6)
          << "d" << in.name << " direction " << direction << ": finite difference " << numeric
          << " vs <grad, u> " << analytic;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FlashValueDimsGradient,
    testing::Values(FdCase{"D12Dv5NonCausal", {2, 9, 11, 4, 2, 12, 5}, {}},
                    FdCase{"D5Dv12CausalQueriesAfterKeys", {2, 9, 11, 4, 2, 5, 12}, {true, 4, 0}},
                    // Rows 0 and 1 see no key; the rest see a growing prefix.
                    FdCase{"D7Dv3CausalSomeRowsSeeNothing", {1, 8, 10, 2, 1, 7, 3}, {true, 0, 2}},
                    // 70 rows and keys: two tiles each way, a masked tile pair.
                    FdCase{"D6Dv10CausalTwoTilesMqa", {1, 70, 70, 3, 1, 6, 10}, {true, 0, 0}}),
    [](const testing::TestParamInfo<FdCase>& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// The backward's prepare: delta over O's d_v, a dQ to zero of d_qk zeroed whole and nothing else.

TEST(FlashValueDimsPrepare, ZeroesADqOfTheQueryHeadDim) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(63);
  Problem<double> p(Case{"", {2, 9, 9, 4, 2, 24, 8}, {}}, rng);
  cpu::flash_forward(p.forward_args());
  // dq [2, 9, 4, 24] inside rows of 30 elements: 6 of padding a head that must keep their 7.
  std::vector<double> wide(2 * 9 * 4 * 30, 7.0);
  const TensorView dq = test::strided_view(wide, 0, {2, 9, 4, 24}, {9 * 4 * 30, 4 * 30, 30, 1});
  cpu::flash_backward_prepare(p.o.view, p.dout.view, p.delta.view, &dq);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < wide.size(); ++i) wrong += wide[i] != (i % 30 < 24 ? 0.0 : 7.0);
  EXPECT_EQ(wrong, 0u);
  TensorView short_dq = dq;
  short_dq.shape[2] = 3;
  EXPECT_TRUE(ThrowsNaming(
      [&] { cpu::flash_backward_prepare(p.o.view, p.dout.view, p.delta.view, &short_dq); },
      {"cpu::flash_backward_prepare", "dq has shape [2, 9, 3, 24]", "expected [2, 9, 4, 24]"}));
}

// ---------------------------------------------------------------------------------------------
// Argument checks: a tensor of d_v with another head dim is named with both head dims; V's other
// extents are those of K; a zero d_v is refused.

class FlashValueDimsValidation : public testing::Test {
 protected:
  FlashValueDimsValidation()
      : rng(test::make_rng(64)), p(Case{"", {2, 5, 7, 4, 2, 12, 8}, {}}, rng) {
    p.forward_and_prepare();
  }
  std::mt19937_64 rng;
  Problem<double> p;
};

TEST_F(FlashValueDimsValidation, ValidCallsSucceed) {
  EXPECT_NO_THROW(cpu::flash_forward(p.forward_args()));
  test::QkvBuffers<double> grads(p.s, Layout::contiguous, 0.0);
  EXPECT_NO_THROW(cpu::flash_backward(p.backward_args(grads)));
}

TEST_F(FlashValueDimsValidation, OutputsOfTheQueryHeadDimAreNamedWithBothHeadDims) {
  HostTensor<double> o_qk({2, 5, 4, 12});
  ForwardArgs args = p.forward_args();
  args.o = o_qk.view;
  EXPECT_TRUE(ThrowsNaming([&] { cpu::flash_forward(args); },
                           {"cpu::flash_forward: o has head_dim 12", "[2, 5, 4, 12]",
                            "expected 8, the head_dim of v (q and k have head_dim 12)"}));
  test::QkvBuffers<double> grads(p.s, Layout::contiguous, 0.0);
  HostTensor<double> dout_qk({2, 5, 4, 12}, 0.5), dv_qk({2, 7, 2, 12}, 0.0);
  BackwardArgs backward = p.backward_args(grads);
  backward.dout = dout_qk.view;
  EXPECT_TRUE(ThrowsNaming([&] { cpu::flash_backward(backward); },
                           {"cpu::flash_backward: dout has head_dim 12",
                            "expected 8, the head_dim of v (q and k have head_dim 12)"}));
  backward = p.backward_args(grads);
  backward.dv = dv_qk.view;
  EXPECT_TRUE(ThrowsNaming([&] { cpu::flash_backward(backward); },
                           {"dv has head_dim 12", "expected 8, the head_dim of v"}));
  // dq and dk keep d_qk: one of d_v is named against q's or k's shape.
  HostTensor<double> dq_v({2, 5, 4, 8}, 0.0), dk_v({2, 7, 2, 8}, 0.0);
  backward = p.backward_args(grads);
  backward.dq = dq_v.view;
  EXPECT_TRUE(ThrowsNaming([&] { cpu::flash_backward(backward); },
                           {"dq has shape [2, 5, 4, 8]", "expected [2, 5, 4, 12]",
                            "the shape of q"}));
  backward = p.backward_args(grads);
  backward.dk = dk_v.view;
  EXPECT_TRUE(ThrowsNaming([&] { cpu::flash_backward(backward); },
                           {"dk has shape [2, 7, 2, 8]", "expected [2, 7, 2, 12]",
                            "the shape of k"}));
}

TEST_F(FlashValueDimsValidation, ValueExtentsOtherThanTheHeadDimAreThoseOfK) {
  ForwardArgs args = p.forward_args();
  args.v.shape[1] = 6;
  EXPECT_TRUE(ThrowsNaming([&] { cpu::flash_forward(args); },
                           {"v has shape [2, 6, 2, 8]", "expected [2, 7, 2, 8]",
                            "batch, k_len and kv_heads of k"}));
  args = p.forward_args();
  args.v.shape[3] = 0;
  EXPECT_TRUE(ThrowsNaming([&] { cpu::flash_forward(args); }, {"v has head_dim 0", ">= 1"}));
}

}  // namespace
}  // namespace ringattn
