// The local-attention control (parallel.local_attention, ModelOptions::local_attention) on CPU
// ranks: with it, rank 0's loss does not depend on the tokens the other ranks hold (no information
// crosses shards), while with ring attention it does (the control can fail); and at one rank the
// control is ring attention itself, bit for bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/train/trainer_runs.hpp"
#include "train/config.hpp"
#include "train/model_cpu.hpp"

namespace ringattn::train {
namespace {

using test::tiny_model;

constexpr std::int64_t kBatch = 2;
constexpr std::int64_t kSeq = 64;

// This rank's shard of a batch whose tokens come from `seed`; rank `changed` draws from
// `seed + 1` instead (the same on every rank: only the other ranks' view of rank `changed` moves).
struct Shard {
  std::vector<std::int32_t> inputs, targets;
  std::vector<float> mask;
  ShardBatch view() const { return {inputs, targets, mask}; }
};

Shard shard_of(int rank, std::int64_t local, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 1000 + static_cast<std::uint64_t>(rank));
  std::uniform_int_distribution<int> token(0, 63);
  Shard s;
  for (std::int64_t i = 0; i < kBatch * local; ++i) {
    s.inputs.push_back(token(rng));
    s.targets.push_back(token(rng));
    s.mask.push_back(1.0f);
  }
  return s;
}

// Rank 0's loss sum when rank `changed` holds other tokens (changed < 0: nobody does).
double rank0_loss(bool local_attention, int changed) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  ModelOptions options;
  options.local_attention = local_attention;
  CpuModel<double> model(tiny_model(), kBatch, kSeq, world, SequenceLayoutKind::zigzag, options);
  model.init(3);
  const int rank = communicator_rank(*world);
  const Shard shard = shard_of(rank, model.local_len(), rank == changed ? 8 : 7);
  const double loss = model.forward(shard.view()).loss_sum;
  double all[1] = {rank == 0 ? loss : 0.0};
  host_all_reduce_sum(*world, all, 1);
  return all[0];
}

TEST(LocalAttention, NoInformationCrossesShards) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int last = communicator_size(*world) - 1;
  ASSERT_GE(last, 1) << "needs 2 ranks or more";
  // Local attention: rank 0's loss is blind to another rank's tokens.
  EXPECT_EQ(rank0_loss(true, -1), rank0_loss(true, last));
  // Ring attention: rank 0 (chunks 0 and 2N-1 of the zigzag layout) sees them.
  EXPECT_NE(rank0_loss(false, -1), rank0_loss(false, last));
  // And the control differs from the ring even on unchanged data.
  EXPECT_NE(rank0_loss(true, -1), rank0_loss(false, -1));
}

TEST(LocalAttention, AtOneRankIsRingAttention) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  std::shared_ptr<Communicator> self = split_communicator(*world, communicator_rank(*world), 0);
  double losses[2];
  for (const bool local : {false, true}) {
    ModelOptions options;
    options.local_attention = local;
    CpuModel<double> model(tiny_model(), kBatch, kSeq, self, SequenceLayoutKind::zigzag, options);
    model.init(3);
    const Shard shard = shard_of(0, model.local_len(), 7);
    losses[local] = model.forward(shard.view()).loss_sum;
  }
  EXPECT_EQ(losses[0], losses[1]);
}

}  // namespace
}  // namespace ringattn::train
