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
#include <random>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/cpu_flash_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::FlashCase;
using test::FlashProblem;
using test::HostTensor;
using test::kTolerance;
using test::Layout;
using test::Precision;
using test::read_view;
using test::ThrowsNaming;

// Shapes that break the 64 x 64 tiles on either side, GQA 1, 2, 4 and 8, causal masks with
// global offsets (rows that see nothing, masked tiles), strided layouts, and d_v below, above and
// equal to d_qk.
const FlashCase kCases[] = {
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

class FlashValueDims : public testing::TestWithParam<std::tuple<FlashCase, Precision>> {};

// Forward (O, LSE, and delta = rowsum(dO * O) over d_v) and backward against the oracle; the
// gradients go to buffers of the case's layout holding random values R, which the block adds to.
template <typename T>
void run_case(const FlashCase& c) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(60);
  FlashProblem<T> p(c, rng);
  p.forward();
  p.prepare();
  const auto ref = p.oracle_forward();
  EXPECT_TRUE(test::Close("O", p.o.values(), ref.o, kTolerance<T>));
  EXPECT_TRUE(test::Close("LSE", p.lse.values(), ref.lse, kTolerance<T>));
  test::check_backward(p, c.layout, rng);
}

TEST_P(FlashValueDims, ForwardAndBackwardMatchTheOracle) {
  const auto& [c, precision] = GetParam();
  if (precision == Precision::f64) {
    run_case<double>(c);
  } else {
    run_case<float>(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlashValueDims,
                         testing::Combine(testing::ValuesIn(kCases),
                                          testing::Values(Precision::f64, Precision::f32)),
                         test::case_precision_name);

// Combine mode: a running fp64 (O, LSE) of d_v merged over K/V chunks (out of order, one of them
// masked for some rows) equals attention over all of them, and the backward summed over the same
// chunks with the final O and LSE (how the ring calls it) equals the whole backward.
TEST(FlashValueDimsChunks, CombinedChunksAndSummedGradientsEqualOneShot) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(61);
  const FlashCase c{"", {2, 120, 300, 4, 2, 48, 80}, {true, 100, 0}};
  FlashProblem<double> p(c, rng);
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
  const auto ref = p.oracle_forward();
  EXPECT_TRUE(test::Close("O (combined)", o.values(), ref.o, 1e-12));
  EXPECT_TRUE(test::Close("LSE (combined)", lse.values(), ref.lse, 1e-12));

  p.forward();
  p.prepare();
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
  const auto ref_grads = p.oracle();
  EXPECT_TRUE(test::Close("dQ (summed)", read_view(grads.q), ref_grads.dq, 1e-12));
  EXPECT_TRUE(test::Close("dK (summed)", read_view(grads.k), ref_grads.dk, 1e-12));
  EXPECT_TRUE(test::Close("dV (summed)", read_view(grads.v), ref_grads.dv, 1e-12));
}

// ---------------------------------------------------------------------------------------------
// The block's backward is the derivative of the block's forward: loss = sum(O * W) with O from
// cpu::flash_forward, so dO = W; the gradient along random unit directions that move every element
// of q, k or v against central finite differences.

class FlashValueDimsGradient : public testing::TestWithParam<FlashCase> {};

TEST_P(FlashValueDimsGradient, MatchesFiniteDifferencesOfTheForward) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(62);
  FlashProblem<double> p(GetParam(), rng);
  const AttentionShape& s = p.s;
  auto loss = [&] {
    p.o.poison();
    p.lse.poison();
    cpu::flash_forward(p.forward_args());
    return test::dot(p.o.storage, p.dout.storage);
  };
  p.forward();
  p.prepare();
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
      const double norm = std::sqrt(test::dot(u, u));
      for (double& value : u) value /= norm;
      const std::vector<double> x0 = *in.x;
      for (std::size_t i = 0; i < u.size(); ++i) (*in.x)[i] = x0[i] + kEps * u[i];
      const double plus = loss();
      for (std::size_t i = 0; i < u.size(); ++i) (*in.x)[i] = x0[i] - kEps * u[i];
      const double minus = loss();
      *in.x = x0;
      const double numeric = (plus - minus) / (2.0 * kEps);
      const double analytic = test::dot(*in.grad, u);
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
    testing::Values(
        FlashCase{"D12Dv5NonCausal", {2, 9, 11, 4, 2, 12, 5}, {}},
        FlashCase{"D5Dv12CausalQueriesAfterKeys", {2, 9, 11, 4, 2, 5, 12}, {true, 4, 0}},
        // Rows 0 and 1 see no key; the rest see a growing prefix.
        FlashCase{"D7Dv3CausalSomeRowsSeeNothing", {1, 8, 10, 2, 1, 7, 3}, {true, 0, 2}},
        // 70 rows and keys: two tiles each way, a masked tile pair.
        FlashCase{"D6Dv10CausalTwoTilesMqa", {1, 70, 70, 3, 1, 6, 10}, {true, 0, 0}}),
    [](const testing::TestParamInfo<FlashCase>& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// The backward's prepare: delta over O's d_v, a dQ to zero of d_qk zeroed whole and nothing else.

TEST(FlashValueDimsPrepare, ZeroesADqOfTheQueryHeadDim) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(63);
  FlashProblem<double> p(FlashCase{"", {2, 9, 9, 4, 2, 24, 8}, {}}, rng);
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
      : rng(test::make_rng(64)), p(FlashCase{"", {2, 5, 7, 4, 2, 12, 8}, {}}, rng) {
    p.forward();
    p.prepare();
  }
  std::mt19937_64 rng;
  FlashProblem<double> p;
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
