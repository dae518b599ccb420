// The CPU RMSNorm (train/op_rmsnorm): forward and backward against fp64 (the backward through the
// explicit Jacobian, not the op's closed form), both write modes, fp64 central differences,
// deterministic dg, argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"
#include "train/op_rmsnorm.hpp"

namespace ringattn::train {
namespace {

using cpu::RmsNormShape;

constexpr double kEps = 1e-5;

struct Reference {
  std::vector<double> y, inv_rms, dx, dg;
};

// y_i = x_i r g_i with r = (mean(x^2) + eps)^(-1/2); dr/dx_j = -r^3 x_j / dim, so
// dy_i/dx_j = g_i (r delta_ij - x_i x_j r^3 / dim): dx_j = sum_i dy_i dy_i/dx_j.
Reference reference(const std::vector<double>& x, const std::vector<double>& g,
                    const std::vector<double>& dy, const RmsNormShape& s) {
  Reference ref{std::vector<double>(x.size()), std::vector<double>(s.rows),
                std::vector<double>(x.size()), std::vector<double>(s.dim, 0.0)};
  for (std::int64_t r = 0; r < s.rows; ++r) {
    const double* xr = x.data() + r * s.dim;
    const double* dyr = dy.data() + r * s.dim;
    double squares = 0.0;
    for (std::int64_t c = 0; c < s.dim; ++c) squares += xr[c] * xr[c];
    const double inv = 1.0 / std::sqrt(squares / double(s.dim) + kEps);
    ref.inv_rms[r] = inv;
    for (std::int64_t i = 0; i < s.dim; ++i) {
      ref.y[r * s.dim + i] = xr[i] * inv * g[i];
      ref.dg[i] += dyr[i] * xr[i] * inv;
    }
    for (std::int64_t j = 0; j < s.dim; ++j) {
      double sum = 0.0;
      for (std::int64_t i = 0; i < s.dim; ++i) {
        const double jacobian =
            g[i] * ((i == j ? inv : 0.0) - xr[i] * xr[j] * inv * inv * inv / double(s.dim));
        sum += dyr[i] * jacobian;
      }
      ref.dx[r * s.dim + j] = sum;
    }
  }
  return ref;
}

template <typename T>
void check(const RmsNormShape& s) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(s.rows * 1009 + s.dim);
  // Rows of different scales: the normalisation must remove them.
  std::vector<double> x64 = test::normal_vector<double>(s.rows * s.dim, rng);
  for (std::int64_t r = 0; r < s.rows; ++r) {
    const double scale = std::pow(10.0, double(r % 5) - 2.0);
    for (std::int64_t c = 0; c < s.dim; ++c) x64[r * s.dim + c] *= scale;
  }
  const auto x = test::rounded<T>(x64);
  const auto g = test::rounded<T>(test::normal_vector<double>(s.dim, rng));
  const auto dy = test::rounded<T>(test::normal_vector<double>(s.rows * s.dim, rng));
  const Reference ref = reference(test::widened(x), test::widened(g), test::widened(dy), s);
  const double tolerance = test::kTolerance<T>;

  std::vector<T> y = test::nan_vector<T>(x.size()), inv_rms = test::nan_vector<T>(s.rows);
  cpu::rmsnorm_forward<T>(y, inv_rms, x, g, s, kEps);
  EXPECT_TRUE(test::Close("y", test::widened(y), ref.y, tolerance));
  EXPECT_TRUE(test::Close("inv_rms", test::widened(inv_rms), ref.inv_rms, tolerance));

  std::vector<T> dx = test::nan_vector<T>(x.size()), dg = test::nan_vector<T>(s.dim);
  cpu::rmsnorm_backward<T>(dx, dg, dy, x, g, inv_rms, s);
  EXPECT_TRUE(test::Close("dx", test::widened(dx), ref.dx, tolerance));
  EXPECT_TRUE(test::Close("dg", test::widened(dg), ref.dg, tolerance));

  // Write::add: the residual's gradient already in dx, the last micro-batch's in dg.
  const auto dx0 = test::rounded<T>(test::normal_vector<double>(x.size(), rng));
  const auto dg0 = test::rounded<T>(test::normal_vector<double>(s.dim, rng));
  dx = dx0;
  dg = dg0;
  cpu::rmsnorm_backward<T>(dx, dg, dy, x, g, inv_rms, s, Write::add, Write::add);
  std::vector<double> dx_sum = test::widened(dx0), dg_sum = test::widened(dg0);
  for (std::size_t i = 0; i < dx_sum.size(); ++i) dx_sum[i] += ref.dx[i];
  for (std::size_t i = 0; i < dg_sum.size(); ++i) dg_sum[i] += ref.dg[i];
  EXPECT_TRUE(test::Close("dx (add)", test::widened(dx), dx_sum, tolerance));
  EXPECT_TRUE(test::Close("dg (add)", test::widened(dg), dg_sum, tolerance));
}

TEST(RmsNorm, F32MatchesFp64Reference) {
  check<float>({.rows = 1, .dim = 1});
  check<float>({.rows = 5, .dim = 7});
  check<float>({.rows = 130, .dim = 64});
  check<float>({.rows = 9, .dim = 1000});
}

TEST(RmsNorm, F64MatchesFp64Reference) {
  check<double>({.rows = 1, .dim = 1});
  check<double>({.rows = 5, .dim = 7});
  check<double>({.rows = 130, .dim = 64});
  check<double>({.rows = 9, .dim = 1000});
}

TEST(RmsNorm, GradientsMatchFiniteDifferences) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const RmsNormShape s{.rows = 4, .dim = 6};
  const auto x = test::normal_vector<double>(s.rows * s.dim, rng);
  const auto g = test::normal_vector<double>(s.dim, rng);
  const auto r = test::normal_vector<double>(s.rows * s.dim, rng);  // L = <r, y>
  const auto loss = [&](const std::vector<double>& xv, const std::vector<double>& gv) {
    std::vector<double> y(xv.size()), inv(s.rows);
    cpu::rmsnorm_forward<double>(y, inv, xv, gv, s, kEps);
    return test::dot(r, y);
  };
  std::vector<double> y(x.size()), inv(s.rows), dx(x.size()), dg(s.dim);
  cpu::rmsnorm_forward<double>(y, inv, x, g, s, kEps);
  cpu::rmsnorm_backward<double>(dx, dg, r, x, g, inv, s);
  EXPECT_TRUE(test::GradientMatches(
      "x", [&](const std::vector<double>& v) { return loss(v, g); }, x, dx, rng));
  EXPECT_TRUE(test::GradientMatches(
      "g", [&](const std::vector<double>& v) { return loss(x, v); }, g, dg, rng));
}

TEST(RmsNorm, BackwardBitwiseEqualAcrossThreadCounts) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(2);
  const RmsNormShape s{.rows = 2000, .dim = 200};
  const auto x = test::normal_vector<float>(s.rows * s.dim, rng);
  const auto g = test::normal_vector<float>(s.dim, rng);
  const auto dy = test::normal_vector<float>(s.rows * s.dim, rng);
  const auto run = [&](int threads) {
    test::ThreadCountGuard guard;
    ringattn::cpu::set_num_threads(threads);
    std::vector<float> y(x.size()), inv(s.rows), dx(x.size()), dg(s.dim);
    cpu::rmsnorm_forward<float>(y, inv, x, g, s, kEps);
    cpu::rmsnorm_backward<float>(dx, dg, dy, x, g, inv, s);
    return std::vector<std::vector<float>>{y, inv, dx, dg};
  };
  const auto one = run(1), again = run(1), three = run(3);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(one[i] == again[i]) << "output " << i << " differs between two runs";
    EXPECT_TRUE(one[i] == three[i]) << "output " << i << " differs between 1 and 3 threads";
  }
}

TEST(RmsNorm, RejectsBadArguments) {
  const RmsNormShape s{.rows = 2, .dim = 3};
  std::vector<float> y(6), inv(2), x(6), g(3), short_g(2);
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::rmsnorm_forward<float>(y, inv, x, g, s, 0.0); },
                                 {"train::cpu::rmsnorm_forward", "eps is 0", "expected"}));
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::rmsnorm_backward<float>(y, g, x, x, short_g, inv, s); },
                                 {"train::cpu::rmsnorm_backward", "g has 2 elements", "dim = 3"}));
}

}  // namespace
}  // namespace ringattn::train
