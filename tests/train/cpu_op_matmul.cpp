// The CPU linear layer (train/op_matmul): forward, input and weight gradients against fp64 loops
// on shapes that break the 6 x 16 micro-tile and the 96 x 256 x 256 blocks, in both write modes;
// fp64 central differences; bitwise determinism across thread counts; argument checks.
//
// Criteria (tests/TESTING.md): ||out - ref|| / ||ref|| < 1e-5 (f32) and 1e-12 (f64), the reference
// computed in fp64 from the same (rounded) inputs; gradients within 1e-6 of finite differences.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"
#include "train/op_matmul.hpp"

namespace ringattn::train {
namespace cpu {
// Found by argument-dependent lookup: names the parameterised cases.
void PrintTo(const MatmulShape& s, std::ostream* out) {
  *out << "rows " << s.rows << " in " << s.in_features << " out " << s.out_features;
}
}  // namespace cpu

namespace {

using cpu::MatmulShape;

// C[i, j] = sum_p A[i * a_row + p * a_col] * B[p * b_row + j * b_col], in fp64.
std::vector<double> product(const std::vector<double>& a, std::int64_t a_row, std::int64_t a_col,
                            const std::vector<double>& b, std::int64_t b_row, std::int64_t b_col,
                            std::int64_t m, std::int64_t n, std::int64_t depth) {
  std::vector<double> c(m * n, 0.0);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (std::int64_t p = 0; p < depth; ++p)
        sum += a[i * a_row + p * a_col] * b[p * b_row + j * b_col];
      c[i * n + j] = sum;
    }
  }
  return c;
}

// Y = X W^T, dX = dY W, dW = dY^T X in fp64.
std::vector<double> reference_forward(const std::vector<double>& x, const std::vector<double>& w,
                                      const MatmulShape& s) {
  return product(x, s.in_features, 1, w, 1, s.in_features, s.rows, s.out_features, s.in_features);
}
std::vector<double> reference_dx(const std::vector<double>& dy, const std::vector<double>& w,
                                 const MatmulShape& s) {
  return product(dy, s.out_features, 1, w, s.in_features, 1, s.rows, s.in_features, s.out_features);
}
std::vector<double> reference_dw(const std::vector<double>& dy, const std::vector<double>& x,
                                 const MatmulShape& s) {
  return product(dy, 1, s.out_features, x, s.in_features, 1, s.out_features, s.in_features, s.rows);
}

std::vector<double> plus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

class MatmulShapes : public ::testing::TestWithParam<MatmulShape> {};

template <typename T>
void check_against_reference(const MatmulShape& s, Write write) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(s.rows * 1000003 + s.in_features * 1009 + s.out_features);
  // Inputs rounded to T first, so the reference sees exactly what the op sees.
  const auto x = test::rounded<T>(test::normal_vector<double>(s.rows * s.in_features, rng));
  const auto w = test::rounded<T>(test::normal_vector<double>(s.out_features * s.in_features, rng));
  const auto dy = test::rounded<T>(test::normal_vector<double>(s.rows * s.out_features, rng));
  const auto x64 = test::widened(x), w64 = test::widened(w), dy64 = test::widened(dy);
  const double tolerance = test::kTolerance<T>;

  // Outputs start as NaN (overwrite: every element must be written) or random (add).
  const auto initial = [&](std::int64_t n) {
    return write == Write::add ? test::rounded<T>(test::normal_vector<double>(n, rng))
                               : test::nan_vector<T>(n);
  };
  const auto expected = [&](const std::vector<T>& before, const std::vector<double>& product) {
    return write == Write::add ? plus(test::widened(before), product) : product;
  };

  std::vector<T> y = initial(s.rows * s.out_features);
  const std::vector<double> y_ref = expected(y, reference_forward(x64, w64, s));
  cpu::matmul_forward<T>(y, x, w, s, write);
  EXPECT_TRUE(test::Close("y", test::widened(y), y_ref, tolerance));

  std::vector<T> dx = initial(s.rows * s.in_features);
  const std::vector<double> dx_ref = expected(dx, reference_dx(dy64, w64, s));
  cpu::matmul_backward_input<T>(dx, dy, w, s, write);
  EXPECT_TRUE(test::Close("dx", test::widened(dx), dx_ref, tolerance));

  std::vector<T> dw = initial(s.out_features * s.in_features);
  const std::vector<double> dw_ref = expected(dw, reference_dw(dy64, x64, s));
  cpu::matmul_backward_weight<T>(dw, dy, x, s, write);
  EXPECT_TRUE(test::Close("dw", test::widened(dw), dw_ref, tolerance));
}

TEST_P(MatmulShapes, F32MatchesFp64Reference) {
  check_against_reference<float>(GetParam(), Write::overwrite);
  check_against_reference<float>(GetParam(), Write::add);
}

TEST_P(MatmulShapes, F64MatchesFp64Reference) {
  check_against_reference<double>(GetParam(), Write::overwrite);
  check_against_reference<double>(GetParam(), Write::add);
}

// rows, in_features, out_features: single elements, fewer than one micro-tile, exact tiles, sizes
// one past the 96-row, 256-column and 256-deep blocks, and past the 2048-row and 2048-column slabs
// (2048 is not a multiple of the 6-row micro-tile). Across the three products each size serves as
// the depth once.
INSTANTIATE_TEST_SUITE_P(Shapes, MatmulShapes,
                         ::testing::Values(MatmulShape{1, 1, 1}, MatmulShape{1, 5, 3},
                                           MatmulShape{7, 13, 5}, MatmulShape{6, 256, 16},
                                           MatmulShape{17, 33, 65}, MatmulShape{97, 300, 130},
                                           MatmulShape{193, 515, 257}, MatmulShape{100, 1, 1000},
                                           MatmulShape{1000, 3, 2}, MatmulShape{2053, 7, 2051}));

TEST(Matmul, GradientsMatchFiniteDifferences) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const MatmulShape s{.rows = 5, .in_features = 7, .out_features = 3};
  const auto x = test::normal_vector<double>(s.rows * s.in_features, rng);
  const auto w = test::normal_vector<double>(s.out_features * s.in_features, rng);
  const auto r = test::normal_vector<double>(s.rows * s.out_features, rng);  // L = <r, X W^T>
  const auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    std::vector<double> y(s.rows * s.out_features);
    cpu::matmul_forward<double>(y, xv, wv, s);
    return test::dot(r, y);
  };
  std::vector<double> dx(x.size()), dw(w.size());
  cpu::matmul_backward_input<double>(dx, r, w, s);
  cpu::matmul_backward_weight<double>(dw, r, x, s);
  EXPECT_TRUE(test::GradientMatches(
      "x", [&](const std::vector<double>& v) { return loss(v, w); }, x, dx, rng));
  EXPECT_TRUE(test::GradientMatches(
      "w", [&](const std::vector<double>& v) { return loss(x, v); }, w, dw, rng));
}

TEST(Matmul, BitwiseEqualAcrossThreadCounts) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(2);
  const MatmulShape s{.rows = 200, .in_features = 600, .out_features = 300};
  const auto x = test::normal_vector<float>(s.rows * s.in_features, rng);
  const auto w = test::normal_vector<float>(s.out_features * s.in_features, rng);
  const auto dy = test::normal_vector<float>(s.rows * s.out_features, rng);
  const auto run = [&](int threads) {
    test::ThreadCountGuard guard;
    ringattn::cpu::set_num_threads(threads);
    std::vector<float> y(dy.size()), dx(x.size()), dw(w.size());
    cpu::matmul_forward<float>(y, x, w, s);
    cpu::matmul_backward_input<float>(dx, dy, w, s);
    cpu::matmul_backward_weight<float>(dw, dy, x, s);
    return std::vector<std::vector<float>>{y, dx, dw};
  };
  const auto one = run(1), again = run(1), three = run(3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(one[i] == again[i]) << "output " << i << " differs between two runs";
    EXPECT_TRUE(one[i] == three[i]) << "output " << i << " differs between 1 and 3 threads";
  }
}

TEST(Matmul, RejectsBadArguments) {
  const MatmulShape s{.rows = 2, .in_features = 3, .out_features = 4};
  std::vector<float> y(8), x(6), w(12), short_x(5);
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::matmul_forward<float>(y, short_x, w, s); },
      {"train::cpu::matmul_forward", "x has 5 elements", "rows * in_features = 6"}));
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::matmul_backward_weight<float>({}, y, x, s); },
                                 {"train::cpu::matmul_backward_weight", "dw is null"}));
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::matmul_backward_input<float>(x, y, w, {.rows = 2, .in_features = 3}); },
      {"shape.out_features is 0", "expected > 0"}));
}

}  // namespace
}  // namespace ringattn::train
