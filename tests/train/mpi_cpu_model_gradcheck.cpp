// ringattn-mpi-ranks: 1 2 4
// Whole-model gradient check of the CPU transformer (train/model_cpu.hpp) in fp64 against central
// finite differences of the loss, on a tiny shape (vocab 16, d_model 16, 2 layers, 2 query heads
// on 1 K/V head of 8, seq 8, batch 2) with a loss mask that leaves tokens out. With N ranks the
// sequence is sharded over a ring of N (zigzag), each rank's gradients are summed over the ring
// and the loss is the global weighted mean: the check covers the cp path too, with the ring's
// workspace in the model's buffers that are dead during attention (it holds none of its own),
// and, with recomputation, each block's forward run again before its backward; with the
// feed-forward block in chunks, the chunks' hidden activations made again in the backward and
// the ring's workspace in their arena (4 ranks: with the ring's step buffer); with V heads of
// their own width (model.v_head_dim 12 or 5 beside Q's and K's 8, as in multi-head latent
// attention), which widen or narrow v, the attention output and wo.
// For a random direction u (over all parameters, and restricted to each parameter tensor in turn):
//   | g . u - D(eps) | <= 1e-6 * max(|g . u|, 1e-3), eps = 1e-5, with the central difference
//   D(eps) = (8 (L(p + eps u) - L(p - eps u)) - (L(p + 2 eps u) - L(p - 2 eps u))) / (12 eps)
// of fourth order: the second-order one, (L(p + eps u) - L(p - eps u)) / (2 eps), is off by
// eps^2 / 6 times the third derivative, which came to 6e-6 of g . u along a random direction at
// d_v 12, where its Richardson extrapolation (this one) met g . u within 1e-9 of it.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "train/model_cpu.hpp"
#include "train/shard_ranges.hpp"

namespace ringattn::train {
namespace {

struct Problem {
  std::vector<std::int32_t> inputs, targets;
  std::vector<float> mask;
};

ModelConfig tiny_model(bool tied, std::optional<int> v_head_dim) {
  ModelConfig m;
  m.v_head_dim = v_head_dim;
  m.vocab_size = 16;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.head_dim = 8;
  m.ffn_hidden = 24;
  m.tied_embeddings = tied;
  m.init_std = 0.3;  // large enough that every path carries signal
  return m;
}

// loss_chunk_tokens: the output head and the loss in chunks of that many tokens (3 splits a
// rank's 8 / N local tokens unevenly), or all at once. recompute (and with it attention): each
// block's activations computed again before its backward, into one block's shared buffers.
// mlp_chunk_tokens: the feed-forward block likewise in chunks (0: all at once without recompute).
// v_head_dim: V's heads of that width (absent: the head dim, 8). lent_workspace: the buffers lent
// to the ring hold all of its workspace (checked); false where they may not.
void run_check(bool tied, std::int64_t loss_chunk_tokens = 8192, bool recompute = false,
               bool recompute_attention = false, std::int64_t mlp_chunk_tokens = 0,
               std::optional<int> v_head_dim = std::nullopt, bool lent_workspace = true) {
  constexpr std::int64_t kBatch = 2, kSeq = 8;
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  const ModelConfig mc = tiny_model(tied, v_head_dim);
  ModelOptions options;
  options.loss_chunk_tokens = loss_chunk_tokens;
  options.recompute = recompute;
  options.recompute_attention = recompute_attention;
  options.mlp_chunk_tokens = mlp_chunk_tokens;
  CpuModel<double> model(mc, kBatch, kSeq, world, SequenceLayoutKind::zigzag, options);
  model.init(7);
  // Perturb the norm gains away from 1 so that their gradients are generic.
  std::mt19937_64 rng(99);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::size_t i = 0; i < model.parameter_infos().size(); ++i) {
    if (model.parameter_infos()[i].shape.size() == 1) {
      for (double& g : model.parameter(i)) g = 1.0 + 0.2 * normal(rng);
    }
  }
  // The same samples on every rank, sharded.
  Problem local;
  const auto ranges = shard_ranges(kSeq, size, rank, ShardLayout::zigzag);
  for (std::int64_t b = 0; b < kBatch; ++b) {
    std::vector<std::int32_t> tokens(kSeq + 1);
    std::vector<float> mask(kSeq);
    for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 16);
    for (auto& w : mask) w = (rng() % 4 == 0) ? 0.0f : ((rng() % 2) ? 1.0f : 0.5f);
    const TokenShard s = take_shard(tokens, mask, ranges);
    local.inputs.insert(local.inputs.end(), s.inputs.begin(), s.inputs.end());
    local.targets.insert(local.targets.end(), s.targets.begin(), s.targets.end());
    local.mask.insert(local.mask.end(), s.loss_mask.begin(), s.loss_mask.end());
  }
  const ShardBatch batch{local.inputs, local.targets, local.mask};

  model.zero_grad();
  const double loss0 = model.loss_and_gradients(batch);
  ASSERT_TRUE(std::isfinite(loss0));
  std::vector<double> grad(model.gradients().begin(), model.gradients().end());
  world->all_reduce_sum(grad.data(), grad.size(), DType::f64, nullptr);
  const std::vector<double> p0(model.parameters().begin(), model.parameters().end());

  const auto loss_at = [&](const std::vector<double>& u, double eps) {
    auto p = model.parameters();
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = p0[i] + eps * u[i];
    double w = 0.0;
    for (float m : local.mask) w += m;
    const cpu::CrossEntropySums sums = model.forward(batch);
    double both[2] = {sums.loss_sum, w};
    world->all_reduce_sum(both, 2, DType::f64, nullptr);
    return both[0] / both[1];
  };

  const auto check_direction = [&](const std::vector<double>& u, const std::string& what) {
    double analytic = 0.0;
    for (std::size_t i = 0; i < u.size(); ++i) analytic += grad[i] * u[i];
    const double eps = 1e-5;
    const double numeric = (8.0 * (loss_at(u, eps) - loss_at(u, -eps)) -
                            (loss_at(u, 2 * eps) - loss_at(u, -2 * eps))) /
                           (12 * eps);
    EXPECT_NEAR(analytic, numeric, 1e-6 * std::max(std::abs(analytic), 1e-3))
        << what << " (tied " << tied << ", ranks " << size << ", v_head_dim "
        << mc.resolved_v_head_dim() << ")";
  };

  const std::size_t total = p0.size();
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<double> u(total);
    for (double& x : u) x = normal(rng);
    check_direction(u, "all parameters, trial " + std::to_string(trial));
  }
  std::size_t offset = 0;
  for (const ParameterInfo& info : model.parameter_infos()) {
    std::vector<double> u(total, 0.0);
    for (std::int64_t j = 0; j < info.elements; ++j) u[offset + j] = normal(rng);
    check_direction(u, info.name);
    offset += info.elements;
  }
  if (lent_workspace) {
    EXPECT_EQ(model.ring_workspace_bytes(), 0u)
        << "the lent buffers did not hold the ring's workspace";
  }
  // Also a nonzero gradient everywhere it should be.
  double norm = 0.0;
  for (double g : grad) norm += g * g;
  EXPECT_GT(norm, 1e-6);
}

TEST(CpuModelGradcheck, TiedEmbeddings) {
  run_check(true);
}
TEST(CpuModelGradcheck, UntiedHead) {
  run_check(false);
}
TEST(CpuModelGradcheck, LossInChunks) {
  run_check(true, 3);
  run_check(false, 3);
}
TEST(CpuModelGradcheck, RecomputedBlocks) {
  run_check(false, 3, true, false);
  run_check(false, 3, true, true);
}
TEST(CpuModelGradcheck, FeedForwardInChunks) {
  run_check(false, 3, false, false, 3);
  run_check(true, 8192, true, false, 5);
  run_check(false, 3, true, true, 1);
}

// d_v 12 and 5 beside d_qk 8: every parameter's gradient, kept, recomputed and in chunks. Whole,
// the feed-forward buffers lent to the ring are tight for K|V of 8 + 12 values a token: at 4 ranks
// the ring may keep a K|V buffer of its own (the CPU vectors' starts are not 256-byte aligned as
// the account assumes), a path this case covers too.
TEST(CpuModelGradcheck, OwnVHeadDim) {
  run_check(false, 8192, false, false, 0, 12, false);
  run_check(true, 3, true, false, 3, 12);
  run_check(false, 3, true, true, 0, 5);
}

}  // namespace
}  // namespace ringattn::train
