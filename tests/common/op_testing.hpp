// Helpers of the model-op tests (tests/train/cpu_op_*.cpp): conversions between the op's element
// type and the fp64 reference, central finite differences along random directions, and a guard
// that restores the CPU thread count.
//
//   std::vector<float> x = test::rounded<float>(x64);      // the inputs the op sees, as floats
//   x64 = test::widened(x);                                 // and exactly, as doubles
//   EXPECT_TRUE(test::GradientMatches("x", loss_of_x, x64, grad_x, rng));
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "tests/common/random.hpp"

namespace ringattn::test {

template <typename T>
std::vector<T> rounded(const std::vector<double>& values) {
  return std::vector<T>(values.begin(), values.end());
}

template <typename T>
std::vector<double> widened(const std::vector<T>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// <a, b> in double.
template <typename A, typename B>
double dot(const std::vector<A>& a, const std::vector<B>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += double(a[i]) * double(b[i]);
  return sum;
}

// The gradient check of TESTING.md: for `directions` random directions u (every element of x
// perturbed), the central difference (L(x + h u) - L(x - h u)) / 2h against <gradient, u>; passes
// when ||fd - analytic|| / ||fd|| over the directions is under `tolerance`. `loss` is evaluated
// at perturbed copies of x; x itself is left as it was.
inline ::testing::AssertionResult GradientMatches(
    const char* name, const std::function<double(const std::vector<double>&)>& loss,
    const std::vector<double>& x, const std::vector<double>& gradient, std::mt19937_64& rng,
    int directions = 3, double h = 1e-5, double tolerance = 1e-6) {
  if (gradient.size() != x.size()) {
    return ::testing::AssertionFailure()
           << name << ": gradient has " << gradient.size() << " elements, x " << x.size();
  }
  double num = 0.0, den = 0.0;
  std::vector<double> shifted(x.size());
  for (int d = 0; d < directions; ++d) {
    const std::vector<double> u = normal_vector<double>(x.size(), rng);
    for (std::size_t i = 0; i < x.size(); ++i) shifted[i] = x[i] + h * u[i];
    const double plus = loss(shifted);
    for (std::size_t i = 0; i < x.size(); ++i) shifted[i] = x[i] - h * u[i];
    const double minus = loss(shifted);
    const double fd = (plus - minus) / (2.0 * h);
    const double analytic = dot(gradient, u);
    num += (fd - analytic) * (fd - analytic);
    den += fd * fd;
  }
  const double rel = den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
  if (std::isfinite(rel) && rel < tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << name << ": finite differences differ from the gradient by " << rel
         << " (relative), tolerance " << tolerance << " [" << seed_trace() << "]";
}

// Restores the CPU backend's thread count at the end of a scope.
class ThreadCountGuard {
 public:
  ThreadCountGuard() : saved_(cpu::num_threads()) {}
  ~ThreadCountGuard() { cpu::set_num_threads(saved_); }
  ThreadCountGuard(const ThreadCountGuard&) = delete;
  ThreadCountGuard& operator=(const ThreadCountGuard&) = delete;

 private:
  int saved_;
};

// The relative-error bound of TESTING.md for an op computed in T against its fp64 reference.
template <typename T>
constexpr double kTolerance = sizeof(T) == sizeof(double) ? 1e-12 : 1e-5;

// The inputs of the clip-and-step tests (the CPU backend's and the CUDA ops'): a random AdamW
// state of n elements and its gradients, with the gradients' norm; and the clips against that
// norm: one that bites, one that does not, none (max_norm 0), and a NaN gradient.
struct AdamWState {
  std::vector<float> params, m, v, grads;
  double norm = 0.0;
};

inline AdamWState random_adamw_state(std::size_t n, std::mt19937_64& rng) {
  AdamWState s;
  s.params = normal_vector<float>(n, rng);
  s.m = normal_vector<float>(n, rng, 0.01);
  s.v = normal_vector<float>(n, rng, 0.001);
  for (float& x : s.v) x *= x;
  s.grads = normal_vector<float>(n, rng, 0.1);
  for (const float x : s.grads) s.norm += static_cast<double>(x) * x;
  s.norm = std::sqrt(s.norm);
  return s;
}

struct ClipCase {
  const char* name;
  double max_norm;
  bool nan_gradient;
};

inline std::vector<ClipCase> clip_cases(double norm) {
  return {{"clipped", 0.3 * norm, false},
          {"not clipped", 2.0 * norm, false},
          {"no clip", 0.0, false},
          {"NaN gradient", 1.0, true}};
}

}  // namespace ringattn::test
