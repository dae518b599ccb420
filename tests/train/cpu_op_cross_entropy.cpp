// The CPU softmax cross-entropy (train/op_cross_entropy): losses, sums, argmax predictions and the
// gradient against a long-double reference, for weighted and masked tokens, logits near 1e4, a
// vocabulary of 32768; the gradient in place over the logits; fp64 central differences; argument
// checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"
#include "train/op_cross_entropy.hpp"

namespace ringattn::train {
namespace {

using cpu::CrossEntropyShape;

struct Problem {
  std::vector<double> logits;
  std::vector<std::int32_t> targets;
  std::vector<double> weights;  // 0 (masked), 1 and 0.5
};

Problem random_problem(const CrossEntropyShape& s, double offset, double spread,
                       std::mt19937_64& rng) {
  Problem p;
  p.logits = test::normal_vector<double>(s.tokens * s.vocab, rng, spread);
  for (double& x : p.logits) x += offset;
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(s.vocab - 1));
  std::uniform_int_distribution<int> kind(0, 3);
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    p.targets.push_back(id(rng));
    const int k = kind(rng);
    p.weights.push_back(k == 0 ? 0.0 : (k == 1 ? 0.5 : 1.0));
  }
  if (s.tokens == 1) p.weights[0] = 1.0;
  return p;
}

struct Reference {
  std::vector<double> losses, dlogits;
  std::vector<std::int32_t> predictions;
  double loss_sum = 0.0, weight_sum = 0.0;
};

Reference reference(const std::vector<double>& logits, const Problem& p, const CrossEntropyShape& s,
                    double scale) {
  Reference ref;
  ref.dlogits.resize(logits.size());
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    const double* row = logits.data() + t * s.vocab;
    std::int64_t argmax = 0;
    for (std::int64_t j = 0; j < s.vocab; ++j) {
      if (row[j] > row[argmax]) argmax = j;
    }
    long double sum = 0.0L;
    for (std::int64_t j = 0; j < s.vocab; ++j) sum += std::exp((long double)row[j] - row[argmax]);
    const long double lse = row[argmax] + std::log(sum);
    const long double loss = lse - row[p.targets[t]];
    ref.losses.push_back(static_cast<double>(loss));
    ref.predictions.push_back(static_cast<std::int32_t>(argmax));
    ref.loss_sum += p.weights[t] * static_cast<double>(loss);
    ref.weight_sum += p.weights[t];
    for (std::int64_t j = 0; j < s.vocab; ++j) {
      const long double softmax = std::exp((long double)row[j] - lse);
      const long double onehot = j == p.targets[t] ? 1.0L : 0.0L;
      ref.dlogits[t * s.vocab + j] = static_cast<double>((softmax - onehot) * p.weights[t] * scale);
    }
  }
  return ref;
}

template <typename T>
void check(const CrossEntropyShape& s, double offset, double spread) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(s.tokens * 65537 + s.vocab + std::int64_t(offset));
  const Problem p = random_problem(s, offset, spread, rng);
  const auto logits = test::rounded<T>(p.logits);
  const auto weights = test::rounded<T>(p.weights);
  const double scale = 1.0 / 37.0;  // as if 37 weighted tokens over all ranks
  const Reference ref = reference(test::widened(logits), p, s, scale);
  const double tolerance = test::kTolerance<T>;

  std::vector<T> losses = test::nan_vector<T>(s.tokens);
  std::vector<std::int32_t> predictions(s.tokens, -1);
  const cpu::CrossEntropySums sums =
      cpu::cross_entropy_forward<T>(losses, predictions, logits, p.targets, weights, s);
  EXPECT_TRUE(test::Close("losses", test::widened(losses), ref.losses, tolerance));
  EXPECT_EQ(predictions, ref.predictions);
  EXPECT_NEAR(sums.loss_sum, ref.loss_sum, tolerance * std::fabs(ref.loss_sum) + 1e-12);
  EXPECT_EQ(sums.weight_sum, ref.weight_sum);

  std::vector<T> dlogits = test::nan_vector<T>(logits.size());
  std::fill(losses.begin(), losses.end(), std::numeric_limits<T>::quiet_NaN());
  const cpu::CrossEntropySums sums2 = cpu::cross_entropy_forward_backward<T>(
      dlogits, losses, predictions, logits, p.targets, weights, s, scale);
  EXPECT_TRUE(test::Close("dlogits", test::widened(dlogits), ref.dlogits, tolerance));
  EXPECT_TRUE(
      test::Close("losses (forward_backward)", test::widened(losses), ref.losses, tolerance));
  EXPECT_EQ(sums2.loss_sum, sums.loss_sum);
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    if (p.weights[t] != 0.0) continue;
    for (std::int64_t j = 0; j < s.vocab; ++j) {
      ASSERT_EQ(dlogits[t * s.vocab + j], T(0)) << "masked token " << t << " has a gradient";
    }
  }

  // In place: the gradient written over the logits is bitwise the separate buffer's.
  std::vector<T> in_place = logits;
  const std::span<T> buffer(in_place);
  cpu::cross_entropy_forward_backward<T>(buffer, losses, predictions, buffer, p.targets, weights, s,
                                         scale);
  EXPECT_TRUE(in_place == dlogits) << "the in-place gradient differs";
}

TEST(CrossEntropy, F32MatchesReference) {
  check<float>({.tokens = 1, .vocab = 1}, 0.0, 1.0);
  check<float>({.tokens = 13, .vocab = 3}, 0.0, 1.0);
  check<float>({.tokens = 100, .vocab = 1000}, 0.0, 3.0);
  check<float>({.tokens = 20, .vocab = 500}, 1e4, 1.0);   // exp(logit) overflows
  check<float>({.tokens = 20, .vocab = 500}, 0.0, 1e3);   // nearly one-hot softmax
  check<float>({.tokens = 3, .vocab = 32768}, 0.0, 2.0);  // the 188M model's vocabulary
}

TEST(CrossEntropy, F64MatchesReference) {
  check<double>({.tokens = 1, .vocab = 1}, 0.0, 1.0);
  check<double>({.tokens = 13, .vocab = 3}, 0.0, 1.0);
  check<double>({.tokens = 100, .vocab = 1000}, 0.0, 3.0);
  check<double>({.tokens = 20, .vocab = 500}, 1e4, 1.0);
  check<double>({.tokens = 20, .vocab = 500}, 0.0, 1e3);
  check<double>({.tokens = 3, .vocab = 32768}, 0.0, 2.0);
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const CrossEntropyShape s{.tokens = 6, .vocab = 7};
  const Problem p = random_problem(s, 0.0, 2.0, rng);
  const double scale = 1.0 / 3.0;
  const auto loss = [&](const std::vector<double>& logits) {  // scale * loss_sum
    std::vector<double> losses(s.tokens);
    std::vector<std::int32_t> predictions(s.tokens);
    return scale *
           cpu::cross_entropy_forward<double>(losses, predictions, logits, p.targets, p.weights, s)
               .loss_sum;
  };
  std::vector<double> dlogits(p.logits.size()), losses(s.tokens);
  std::vector<std::int32_t> predictions(s.tokens);
  cpu::cross_entropy_forward_backward<double>(dlogits, losses, predictions, p.logits, p.targets,
                                              p.weights, s, scale);
  EXPECT_TRUE(test::GradientMatches("logits", loss, p.logits, dlogits, rng));
}

TEST(CrossEntropy, RejectsBadArguments) {
  const CrossEntropyShape s{.tokens = 3, .vocab = 7};
  std::vector<float> logits(21), losses(3), weights{1.0f, 1.0f, 1.0f};
  std::vector<std::int32_t> predictions(3);
  const std::vector<std::int32_t> bad_targets{0, 7, 1}, targets{0, 6, 1};
  EXPECT_TRUE(test::ThrowsNaming(
      [&] {
        cpu::cross_entropy_forward<float>(losses, predictions, logits, bad_targets, weights, s);
      },
      {"train::cpu::cross_entropy_forward", "targets[1] is 7", "expected an id in [0, 7)"}));
  weights[2] = -0.5f;
  EXPECT_TRUE(test::ThrowsNaming(
      [&] {
        cpu::cross_entropy_forward_backward<float>(logits, losses, predictions, logits, targets,
                                                   weights, s, 1.0);
      },
      {"train::cpu::cross_entropy_forward_backward", "weights[2] is -0.5", ">= 0"}));
}

}  // namespace
}  // namespace ringattn::train
