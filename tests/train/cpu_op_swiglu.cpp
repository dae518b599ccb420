// The CPU SwiGLU (train/op_swiglu): forward and backward against fp64 formulas (including gates of
// magnitude up to 1e3, where exp overflows), fp64 central differences, argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"
#include "train/op_swiglu.hpp"

namespace ringattn::train {
namespace {

using cpu::SwigluShape;

// sigmoid in long double; silu(a) b and its partial derivatives.
long double sigmoid(long double a) {
  return 1.0L / (1.0L + std::exp(-a));
}

template <typename T>
void check(const SwigluShape& s, double gate_scale) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(s.rows * 101 + s.hidden + std::int64_t(gate_scale));
  std::vector<double> in = test::normal_vector<double>(s.rows * 2 * s.hidden, rng);
  for (std::int64_t r = 0; r < s.rows; ++r) {
    for (std::int64_t c = 0; c < s.hidden; ++c) in[r * 2 * s.hidden + c] *= gate_scale;
  }
  const auto gate_up = test::rounded<T>(in);
  const auto dout = test::rounded<T>(test::normal_vector<double>(s.rows * s.hidden, rng));

  std::vector<double> out_ref(s.rows * s.hidden), dgate_up_ref(gate_up.size());
  for (std::int64_t r = 0; r < s.rows; ++r) {
    for (std::int64_t c = 0; c < s.hidden; ++c) {
      const long double a = gate_up[r * 2 * s.hidden + c];
      const long double b = gate_up[r * 2 * s.hidden + s.hidden + c];
      const long double d = dout[r * s.hidden + c];
      const long double sg = sigmoid(a);
      out_ref[r * s.hidden + c] = static_cast<double>(a * sg * b);
      // d(a sigmoid(a))/da = sigmoid(a) + a sigmoid(a) (1 - sigmoid(a))
      dgate_up_ref[r * 2 * s.hidden + c] = static_cast<double>(d * b * (sg + a * sg * (1 - sg)));
      dgate_up_ref[r * 2 * s.hidden + s.hidden + c] = static_cast<double>(d * a * sg);
    }
  }

  std::vector<T> out = test::nan_vector<T>(s.rows * s.hidden);
  cpu::swiglu_forward<T>(out, gate_up, s);
  EXPECT_TRUE(test::Close("out", test::widened(out), out_ref, test::kTolerance<T>));
  std::vector<T> dgate_up = test::nan_vector<T>(gate_up.size());
  cpu::swiglu_backward<T>(dgate_up, dout, gate_up, s);
  EXPECT_TRUE(test::Close("dgate_up", test::widened(dgate_up), dgate_up_ref, test::kTolerance<T>));
}

TEST(Swiglu, F32MatchesFp64Reference) {
  check<float>({.rows = 1, .hidden = 1}, 1.0);
  check<float>({.rows = 7, .hidden = 33}, 1.0);
  check<float>({.rows = 300, .hidden = 200}, 3.0);
  check<float>({.rows = 20, .hidden = 50}, 1000.0);  // saturated gates, exp(-a) overflows
}

TEST(Swiglu, F64MatchesFp64Reference) {
  check<double>({.rows = 1, .hidden = 1}, 1.0);
  check<double>({.rows = 7, .hidden = 33}, 1.0);
  check<double>({.rows = 300, .hidden = 200}, 3.0);
  check<double>({.rows = 20, .hidden = 50}, 1000.0);
}

TEST(Swiglu, GradientMatchesFiniteDifferences) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const SwigluShape s{.rows = 3, .hidden = 5};
  const auto gate_up = test::normal_vector<double>(s.rows * 2 * s.hidden, rng, 2.0);
  const auto r = test::normal_vector<double>(s.rows * s.hidden, rng);  // L = <r, out>
  std::vector<double> dgate_up(gate_up.size());
  cpu::swiglu_backward<double>(dgate_up, r, gate_up, s);
  EXPECT_TRUE(test::GradientMatches(
      "gate_up",
      [&](const std::vector<double>& v) {
        std::vector<double> out(s.rows * s.hidden);
        cpu::swiglu_forward<double>(out, v, s);
        return test::dot(r, out);
      },
      gate_up, dgate_up, rng));
}

TEST(Swiglu, RejectsBadArguments) {
  std::vector<float> out(6), gate_up(11), dout(6);
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::swiglu_forward<float>(out, gate_up, {.rows = 2, .hidden = 3}); },
      {"train::cpu::swiglu_forward", "gate_up has 11 elements", "rows * 2 * hidden = 12"}));
  std::vector<float> good(12);
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::swiglu_backward<float>(good, dout, good, {.rows = 2, .hidden = -3}); },
      {"train::cpu::swiglu_backward", "shape.hidden is -3"}));
}

}  // namespace
}  // namespace ringattn::train
