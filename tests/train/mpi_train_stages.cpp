// ringattn-mpi-ranks: 1 2
// Context-length stages (train.stages) on CPU ranks, through the trainer the main job runs:
// - a staged run stopped and resumed before, at and after its stage boundary gives bitwise the
//   losses of the run that went straight through, and its losses at cp = the world match cp = 1
//   within 1e-5 in both stages (the ring at both context lengths);
// - the embedded GPU default's recipe in small (passkey retrieval learned at a short context, then
//   kept at a 4x longer one) reaches a held-out accuracy of at least 0.9 at the long context, and
//   on 2 or more ranks the local-attention control (no information across shards) stays far below
//   it (at most 0.75: it can answer only where the pair lies in the query's own shard).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/train/temp_dir.hpp"
#include "tests/train/trainer_runs.hpp"
#include "train/config.hpp"
#include "train/trainer.hpp"

namespace ringattn::train {
namespace {

// Two stages of 4 steps: 32 tokens, batch 8, then 64 tokens at train.batch_size 4.
TrainConfig staged_config(int cp) {
  TrainConfig c;
  c.model = test::tiny_model();
  c.train.batch_size = 4;
  c.train.stages = {StageConfig{4, 32, 8}, StageConfig{4, 64, std::nullopt}};
  c.train.steps = 8;
  c.train.warmup_steps = 2;
  c.train.lr = 1e-2;
  c.train.min_lr = 1e-3;
  c.train.eval_every = 0;
  c.data.retrieval.pairs = 2;
  c.data.retrieval.queries = 2;
  c.parallel.cp = cp;
  return c;
}

using test::losses_of;

// A directory on rank 0's file system that every rank names (the ranks share this machine).
std::string shared_dir(const Communicator& world, std::unique_ptr<test::TempDir>& dir) {
  if (world.rank() == 0) dir = std::make_unique<test::TempDir>();
  return all_gather_text(world, world.rank() == 0 ? dir->path().string() : "")[0];
}

TEST(TrainStages, ResumeAcrossTheBoundaryIsBitwiseAndTheRingMatchesOneRank) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  std::unique_ptr<test::TempDir> dir;
  const std::string root = shared_dir(*world, dir);

  TrainConfig config = staged_config(size);
  config.run.dir = root + "/run";
  const std::vector<double> straight = losses_of(config, world);
  ASSERT_EQ(straight.size(), 8u);
  for (double loss : straight) ASSERT_TRUE(std::isfinite(loss));

  // Stopped after 3 (in the first stage), 4 (at the boundary) and 6 (in the second) steps.
  for (const int stop : {3, 4, 6}) {
    SCOPED_TRACE("stopped after step " + std::to_string(stop));
    TrainConfig run = config;
    run.run.dir = root + "/stop" + std::to_string(stop);
    {
      TrainerOptions options;
      options.write_metrics = false;
      Trainer stopped(run, world, options);
      for (int i = 0; i < stop; ++i) EXPECT_EQ(stopped.step().loss, straight[i]) << "step " << i + 1;
      stopped.save_checkpoint();
    }
    run.run.resume = "latest";
    const std::vector<double> resumed = losses_of(run, world);
    ASSERT_EQ(resumed.size(), static_cast<std::size_t>(8 - stop));
    for (int i = 0; i < 8 - stop; ++i) {
      EXPECT_EQ(resumed[i], straight[stop + i]) << "step " << stop + i + 1 << " after resuming";
    }
  }

  // The same stages on one rank (each rank alone): the ring's losses within 1e-5 in both stages.
  const std::vector<double> alone = losses_of(staged_config(1), split_communicator(*world, rank, 0));
  ASSERT_EQ(alone.size(), straight.size());
  for (std::size_t i = 0; i < alone.size(); ++i) {
    EXPECT_LT(std::abs(straight[i] - alone[i]), 1e-5 * std::abs(alone[i]))
        << "step " << i + 1 << " at cp = " << size << ": " << straight[i] << " vs " << alone[i]
        << " at cp = 1";
  }
  world->barrier();  // every rank is done with the files before rank 0 removes them
}

// Passkey retrieval (tiny-cpu's model and task) learned in 200 steps at 64 tokens, batch 16, then
// 20 steps at 256 tokens; held-out accuracy over 8 batches of 8 at 256 tokens.
double staged_passkey_accuracy(int cp, bool local_attention, std::shared_ptr<Communicator> world) {
  TrainConfig c;
  c.train.stages = {StageConfig{200, 64, 16}, StageConfig{20, 256, std::nullopt}};
  c.train.steps = 220;
  c.train.eval_every = 0;
  c.parallel.cp = cp;
  c.parallel.local_attention = local_attention;
  TrainerOptions options;
  options.write_metrics = false;
  options.write_checkpoints = false;
  Trainer trainer(c, std::move(world), options);
  trainer.run();
  return trainer.evaluate().accuracy;
}

TEST(TrainStages, StagedPasskeyIsLearnedAtTheLongContextAndNotWithoutTheRing) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world);
  const double ring = staged_passkey_accuracy(size, false, world);
  if (world->rank() == 0) std::printf("held-out accuracy at 256 tokens, cp = %d: %.3f\n", size, ring);
  EXPECT_GE(ring, 0.9) << "cp = " << size;
  if (size < 2) return;
  const double control = staged_passkey_accuracy(size, true, world);
  if (world->rank() == 0) {
    std::printf("the same with attention within each shard only: %.3f\n", control);
  }
  EXPECT_LE(control, 0.75) << "cp = " << size << ": the control answered without the ring";
}

}  // namespace
}  // namespace ringattn::train
