// The CPU optimizer (train/op_adamw): AdamW steps against the fp64 textbook update (bias
// correction, decoupled decay only where applied), the first step's size, the clipping helpers
// (sum of squares against fp64 and bitwise across thread counts, the factor, the scaling), and
// the argument checks; the CPU backend's clip without a wait (CpuBackend::queue_clip,
// adamw_clipped, clip_total) against the same steps with the factor formed by hand.
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
#include "train/backend_cpu.hpp"
#include "train/op_adamw.hpp"

namespace ringattn::train {
namespace {

using cpu::AdamWHyper;
using cpu::WeightDecay;

// torch.optim.AdamW's algorithm in fp64.
void reference_step(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m,
                    std::vector<double>& v, const AdamWHyper& h, std::int64_t step, bool decay) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (decay) p[i] -= h.lr * h.weight_decay * p[i];
    m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
    v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g[i] * g[i];
    const double m_hat = m[i] / (1.0 - std::pow(h.beta1, double(step)));
    const double v_hat = v[i] / (1.0 - std::pow(h.beta2, double(step)));
    p[i] -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
  }
}

void check_steps(WeightDecay decay) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(decay == WeightDecay::apply ? 1 : 2);
  const std::int64_t n = 100003;  // more than one chunk of the pool, not a multiple of one
  const AdamWHyper h{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  std::vector<float> p = test::normal_vector<float>(n, rng), m(n, 0.0f), v(n, 0.0f);
  for (std::int64_t step = 1; step <= 5; ++step) {
    const auto g = test::normal_vector<float>(n, rng, 0.1);
    const std::vector<double> before = test::widened(p);
    // The reference continues from the op's state, so each step is checked on its own inputs.
    std::vector<double> p64 = before, m64 = test::widened(m), v64 = test::widened(v);
    reference_step(p64, test::widened(g), m64, v64, h, step, decay == WeightDecay::apply);
    cpu::adamw_step(p, g, m, v, h, step, decay);
    // Compare the update p_new - p_old: its relative error, not the parameters' (dominated by p).
    std::vector<double> update(n), update_ref(n);
    for (std::int64_t i = 0; i < n; ++i) {
      update[i] = double(p[i]) - before[i];
      update_ref[i] = p64[i] - before[i];
    }
    // p_new is rounded to float: |p| ~ 1 carries ~6e-8 absolute error against updates ~3e-3.
    EXPECT_TRUE(test::Close("update", update, update_ref, 1e-4)) << "step " << step;
    EXPECT_TRUE(test::Close("m", test::widened(m), m64, 1e-5)) << "step " << step;
    EXPECT_TRUE(test::Close("v", test::widened(v), v64, 1e-5)) << "step " << step;
  }
}

TEST(AdamW, StepsMatchFp64ReferenceWithDecay) {
  check_steps(WeightDecay::apply);
}
TEST(AdamW, StepsMatchFp64ReferenceWithoutDecay) {
  check_steps(WeightDecay::skip);
}

// With bias correction the first step moves every parameter by lr * g / (|g| + eps), ~lr in
// size; without decay a zero gradient leaves a parameter where it was, with decay it shrinks by
// the factor 1 - lr * weight_decay.
TEST(AdamW, FirstStepAndDecayOnlyWhereApplied) {
  const AdamWHyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-12, .weight_decay = 0.5};
  std::vector<float> p{1.0f, -2.0f, 3.0f}, g{0.5f, -1e-3f, 0.0f}, m(3, 0.0f), v(3, 0.0f);
  std::vector<float> q = p, mq = m, vq = v;
  cpu::adamw_step(p, g, m, v, h, 1, WeightDecay::skip);
  EXPECT_NEAR(p[0], 1.0 - 1e-2, 1e-6);
  EXPECT_NEAR(p[1], -2.0 + 1e-2, 1e-6);
  EXPECT_EQ(p[2], 3.0f);
  cpu::adamw_step(q, g, mq, vq, h, 1, WeightDecay::apply);
  EXPECT_NEAR(q[0], 1.0 * (1.0 - 5e-3) - 1e-2, 1e-6);
  EXPECT_NEAR(q[2], 3.0 * (1.0 - 5e-3), 1e-6);
}

TEST(AdamW, SumOfSquaresMatchesFp64AndIsDeterministic) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(3);
  const std::vector<std::vector<float>> grads{test::normal_vector<float>(200001, rng),
                                              {},
                                              test::normal_vector<float>(7, rng),
                                              test::normal_vector<float>(65536, rng, 1e-3)};
  std::vector<std::span<const float>> views(grads.begin(), grads.end());
  double ref = 0.0;
  for (const auto& g : grads) ref += test::dot(g, g);
  const auto run = [&](int threads) {
    test::ThreadCountGuard guard;
    ringattn::cpu::set_num_threads(threads);
    return cpu::sum_of_squares(views);
  };
  const double one = run(1);
  EXPECT_NEAR(one, ref, 1e-12 * ref);
  EXPECT_EQ(one, run(1));
  EXPECT_EQ(one, run(3));
  EXPECT_EQ(cpu::sum_of_squares({}), 0.0);
}

TEST(AdamW, ClipFactorAndScale) {
  EXPECT_NEAR(cpu::clip_factor(100.0, 1.0), 0.1, 1e-7);  // norm 10 down to 1
  EXPECT_EQ(cpu::clip_factor(0.25, 1.0), 1.0);           // norm 0.5: unchanged
  EXPECT_EQ(cpu::clip_factor(0.0, 1.0), 1.0);
  EXPECT_TRUE(std::isnan(cpu::clip_factor(std::numeric_limits<double>::quiet_NaN(), 1.0)));
  EXPECT_TRUE(std::isnan(cpu::clip_factor(std::numeric_limits<double>::infinity(), 1.0)));
  // A step's multiplier: the factor in float, 1 without clipping, NaN for a sum not finite.
  EXPECT_EQ(cpu::step_clip_factor(100.0, 1.0), static_cast<float>(cpu::clip_factor(100.0, 1.0)));
  EXPECT_EQ(cpu::step_clip_factor(0.25, 1.0), 1.0f);
  EXPECT_EQ(cpu::step_clip_factor(100.0, 0.0), 1.0f);
  EXPECT_TRUE(std::isnan(cpu::step_clip_factor(std::numeric_limits<double>::infinity(), 0.0)));
  EXPECT_TRUE(std::isnan(cpu::step_clip_factor(std::numeric_limits<double>::quiet_NaN(), 1.0)));

  std::vector<float> a{1.0f, -2.0f, 4.0f}, b(70000, 3.0f);
  const std::vector<std::span<float>> buffers{a, b};
  cpu::scale_buffers(buffers, 0.5f);
  EXPECT_EQ(a, (std::vector<float>{0.5f, -1.0f, 2.0f}));
  EXPECT_EQ(b, std::vector<float>(70000, 1.5f));
}

TEST(AdamW, RejectsBadArguments) {
  std::vector<float> p(4), g(4), m(3), v(4);
  EXPECT_TRUE(
      test::ThrowsNaming([&] { cpu::adamw_step(p, g, m, v, {.lr = 1e-3}, 1, WeightDecay::skip); },
                         {"train::cpu::adamw_step", "m has 3 elements", "params.size() = 4"}));
  m.resize(4);
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::adamw_step(p, g, m, v, {.lr = 1e-3, .beta1 = 1.0}, 1, WeightDecay::skip); },
      {"hyper.beta1 is 1", "[0, 1)"}));
  EXPECT_TRUE(
      test::ThrowsNaming([&] { cpu::adamw_step(p, g, m, v, {.lr = 1e-3}, 0, WeightDecay::skip); },
                         {"step is 0", "expected > 0"}));
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::clip_factor(1.0, 0.0); },
                                 {"train::cpu::clip_factor", "max_norm is 0"}));
}

// The backend's clip: its total is cpu::sum_of_squares's, and adamw_clipped steps exactly as
// adamw does with cpu::step_clip_factor (bitwise: the same code), 1 for max_norm 0; a NaN
// gradient gives a NaN total and leaves params and moments bitwise as they were.
TEST(AdamW, BackendClipStepsWithTheTrainersFactor) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(31);
  const std::vector<cpu::AdamWSegment> segments = {{700, WeightDecay::apply},
                                                   {3, WeightDecay::skip},
                                                   {300, WeightDecay::apply}};
  const std::size_t n = 1003;
  const AdamWHyper h{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  test::AdamWState state = test::random_adamw_state(n, rng);
  const std::vector<float>& p0 = state.params;
  const std::vector<float>& m0 = state.m;
  const std::vector<float>& v0 = state.v;
  std::vector<float>& g = state.grads;
  const double norm = state.norm;
  for (const test::ClipCase& c : test::clip_cases(norm)) {
    SCOPED_TRACE(c.name);
    if (c.nan_gradient) g[555] = std::numeric_limits<float>::quiet_NaN();
    CpuBackend<float> by_hand, queued;
    std::vector<float> p[2] = {p0, p0}, m[2] = {m0, m0}, v[2] = {v0, v0};
    const std::span<const float> grads[] = {g};
    const double total = cpu::sum_of_squares(grads);
    if (!c.nan_gradient) {
      const float factor = cpu::step_clip_factor(total, c.max_norm);
      if (c.max_norm > 0.0 && c.max_norm < norm) {
        EXPECT_LT(factor, 0.31f);
      }
      by_hand.adamw(p[0].data(), nullptr, g.data(), m[0].data(), v[0].data(), segments, h, 4,
                    factor);
    }
    queued.queue_clip(g.data(), static_cast<std::int64_t>(n), c.max_norm);
    queued.adamw_clipped(p[1].data(), nullptr, g.data(), m[1].data(), v[1].data(), segments, h, 4);
    const double queued_total = queued.clip_total();
    if (c.nan_gradient) {
      EXPECT_TRUE(std::isnan(queued_total)) << queued_total;
    } else {
      EXPECT_EQ(queued_total, total);
      EXPECT_NE(p[1], p0) << "params not stepped";
    }
    EXPECT_EQ(p[1], p[0]) << "params";
    EXPECT_EQ(m[1], m[0]) << "m";
    EXPECT_EQ(v[1], v[0]) << "v";
  }
}

}  // namespace
}  // namespace ringattn::train
