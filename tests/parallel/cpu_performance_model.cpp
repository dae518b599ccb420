// The performance model against numbers worked out by hand from DESIGN.md, and its input checks.
#include <gtest/gtest.h>

#include <cmath>

#include "parallel/performance_model.hpp"
#include "tests/common/attention_testing.hpp"

namespace ringattn {
namespace {

TEST(PerformanceModel, DesignExampleHidesFromAboutTwoThousandTokens) {
  // DESIGN.md: about 2,000 tokens a rank at 500 TFLOP/s over 300 GB/s (MHA, full blocks):
  // c >= F h_kv / (h B) = 500e12 / 300e9 = 1666.7.
  RingPlanInput in;
  in.causal = false;
  in.attention_tflops = 500;
  in.link_gbytes_per_s = 300;
  const RingPlan p = plan_ring(in);
  EXPECT_NEAR(p.forward_min_tokens_per_rank, 500e12 / 300e9, 1e-6);
  // Backward: 3x the bytes (K/V bf16 + fp32 dK/dV) over 2.5x the FLOPs.
  EXPECT_NEAR(p.backward_min_tokens_per_rank, 3.0 / 2.5 * 500e12 / 300e9, 1e-6);
  // Zigzag causal steps compute half a block: twice the tokens.
  in.causal = true;
  EXPECT_NEAR(plan_ring(in).forward_min_tokens_per_rank, 2 * 500e12 / 300e9, 1e-6);
  // GQA: only the kv heads travel.
  in.kv_heads = 4;
  EXPECT_NEAR(plan_ring(in).forward_min_tokens_per_rank, 2 * 500e12 / 300e9 / 4, 1e-6);
}

TEST(PerformanceModel, StepTimesFollowFromFlopsAndBytes) {
  RingPlanInput in;  // 2 ranks, 128k, 16 x 128, causal zigzag, 400 TFLOP/s, 205 GB/s
  const RingPlan p = plan_ring(in);
  const double c = 65536;
  EXPECT_EQ(p.tokens_per_rank, 65536);
  EXPECT_NEAR(p.forward_compute_ms, 0.5 * 4 * c * c * 128 * 16 / 400e12 * 1e3, 1e-9);
  EXPECT_NEAR(p.forward_transfer_ms, 2 * c * 128 * 16 * 2 / 205e9 * 1e3, 1e-9);
  EXPECT_TRUE(p.forward_hidden);
  EXPECT_TRUE(p.backward_hidden);
  EXPECT_EQ(p.longest_seq % 4, 0);
  // Twice the GPUs hold twice the sequence.
  RingPlanInput four = in;
  four.ranks = 4;
  EXPECT_NEAR(static_cast<double>(plan_ring(four).longest_seq) / p.longest_seq, 2.0, 1e-3);
}

TEST(PerformanceModel, FlopsFollowFlashAttentionsCount) {
  // 4 b h s^2 d: batch 2, 16 heads, 1024 tokens, head_dim 128; half of it under a causal mask.
  EXPECT_DOUBLE_EQ(attention_forward_flops(2, 16, 1024, 128, false), 4.0 * 2 * 16 * 1024.0 * 1024 * 128);
  EXPECT_DOUBLE_EQ(attention_forward_flops(2, 16, 1024, 128, true), 2.0 * 2 * 16 * 1024.0 * 1024 * 128);
  // No overflow at a million tokens.
  EXPECT_DOUBLE_EQ(attention_forward_flops(1, 16, 1 << 20, 128, false), 4.0 * 16 * 0x1p40 * 128);
  EXPECT_DOUBLE_EQ(kBackwardFlopFactor, 2.5);
}

TEST(PerformanceModel, EfficiencyAndHiddenShare) {
  // Two GPUs each taking 60% of the one-GPU time: 1 / (2 x 0.6).
  EXPECT_DOUBLE_EQ(ring_efficiency(100.0, 2, 60.0), 100.0 / 120.0);
  // Compute 10, transfers 4: a ring of 11 hides 3 of the 4, one of 10 all, one of 14 none.
  EXPECT_DOUBLE_EQ(hidden_share(11.0, 10.0, 4.0), 0.75);
  EXPECT_DOUBLE_EQ(hidden_share(10.0, 10.0, 4.0), 1.0);
  EXPECT_DOUBLE_EQ(hidden_share(14.0, 10.0, 4.0), 0.0);
  // Clamped: noise may put the ring under its compute alone, or over their sum.
  EXPECT_DOUBLE_EQ(hidden_share(9.5, 10.0, 4.0), 1.0);
  EXPECT_DOUBLE_EQ(hidden_share(16.0, 10.0, 4.0), 0.0);
  // Nothing to hide on one rank.
  EXPECT_TRUE(std::isnan(hidden_share(10.0, 10.0, 0.0)));
}

TEST(PerformanceModel, BadInputIsNamed) {
  RingPlanInput in;
  in.seq = 1001;
  EXPECT_TRUE(test::ThrowsNaming([&] { plan_ring(in); }, {"seq is 1001", "multiple of 4"}));
  in = RingPlanInput{};
  in.kv_heads = 3;
  EXPECT_TRUE(test::ThrowsNaming([&] { plan_ring(in); }, {"heads 16", "kv_heads 3"}));
  in = RingPlanInput{};
  in.element_bytes = 3;
  EXPECT_TRUE(test::ThrowsNaming([&] { plan_ring(in); }, {"element_bytes is 3"}));
}

}  // namespace
}  // namespace ringattn
