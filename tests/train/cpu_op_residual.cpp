// The CPU residual adds (train/op_residual): exact sums over sizes around the task blocking, and
// the argument checks.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"
#include "train/op_residual.hpp"

namespace ringattn::train {
namespace {

template <typename T>
void check(std::int64_t n) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(n);
  const auto a = test::normal_vector<T>(n, rng), b = test::normal_vector<T>(n, rng);
  // One rounding of an exact sum: the op must give exactly T(a + b).
  std::vector<T> out = test::nan_vector<T>(n);
  cpu::residual_sum<T>(out, a, b);
  std::vector<T> y = a;
  cpu::residual_add<T>(y, b);
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], T(a[i] + b[i])) << "residual_sum, element " << i << " of " << n;
    ASSERT_EQ(y[i], T(a[i] + b[i])) << "residual_add, element " << i << " of " << n;
  }
}

TEST(Residual, AddsExactly) {
  for (std::int64_t n : {1, 17, 1024, 16385, 100003}) {
    check<float>(n);
    check<double>(n);
  }
}

TEST(Residual, RejectsBadArguments) {
  std::vector<float> y(8), x(7);
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::residual_add<float>(y, x); },
                                 {"train::cpu::residual_add", "x has 7 elements", "y.size() = 8"}));
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::residual_sum<float>({}, x, x); },
                                 {"train::cpu::residual_sum", "out.size() is 0"}));
}

}  // namespace
}  // namespace ringattn::train
