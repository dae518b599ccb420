// ringattn-mpi-ranks: 1 2 4
// The CPU training loop end to end (train/trainer.hpp) on a tiny retrieval config: 20 steps with
// cp = the world size give the same losses (relative difference < 1e-5) as the same config at
// cp = 1, run on a communicator of one rank in the same process on every rank; with an even world,
// dp = 2 x cp = N / 2 at half the batch per replica (the same global batch, the same samples) does
// too. And the loss falls. The same with V heads wider than Q's and K's (model.v_head_dim).
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "tests/train/temp_dir.hpp"
#include "tests/train/trainer_runs.hpp"
#include "train/config.hpp"
#include "train/token_dataset_writer.hpp"
#include "train/trainer.hpp"

namespace ringattn::train {
namespace {

TrainConfig tiny_config() { return test::tiny_retrieval_config(); }

using test::losses_of;

void expect_same(const std::vector<double>& expected, const std::vector<double>& actual,
                 const std::string& what) {
  ASSERT_EQ(expected.size(), actual.size()) << what;
  double worst = 0.0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    worst = std::max(worst, std::abs(actual[i] - expected[i]) / std::abs(expected[i]));
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0)
    std::printf("%s: largest relative loss difference to the reference: %.3g\n", what.c_str(),
                worst);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_LT(std::abs(actual[i] - expected[i]), 1e-5 * std::abs(expected[i]))
        << what << ": step " << i + 1 << " loss " << actual[i] << " vs " << expected[i]
        << " at cp = 1";
  }
}

TEST(TrainTiny, SameLossesAtEveryCpAndTheLossFalls) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);

  TrainConfig single = tiny_config();
  single.parallel.dp = 1;
  single.parallel.cp = 1;
  const std::vector<double> reference = losses_of(single, split_communicator(*world, rank, 0));
  ASSERT_EQ(reference.size(), 20u);
  for (double loss : reference) ASSERT_TRUE(std::isfinite(loss));
  double head = 0.0, tail = 0.0;
  for (int i = 0; i < 3; ++i) head += reference[i] / 3;
  for (int i = 17; i < 20; ++i) tail += reference[i] / 3;
  EXPECT_LT(tail, head - 0.5) << "the loss did not fall: " << head << " -> " << tail;

  TrainConfig ring = tiny_config();
  ring.parallel.dp = 1;
  ring.parallel.cp = size;
  expect_same(reference, losses_of(ring, world), "cp = " + std::to_string(size));

  if (size % 2 == 0) {
    TrainConfig mesh = tiny_config();
    mesh.parallel.dp = 2;
    mesh.parallel.cp = size / 2;
    mesh.train.batch_size = 2;
    expect_same(reference, losses_of(mesh, world), "dp = 2 x cp = " + std::to_string(size / 2));
  }
  if (rank == 0) {
    std::printf("losses at cp = 1: %.5f -> %.5f (step 20)\n", reference.front(), reference.back());
  }
}

// model.v_head_dim 12 beside heads of 8 (32 / 4): the loss falls over 20 steps, cp = the world
// gives the losses of cp = 1 within 1e-5, and they are not the model's with V heads of 8.
TEST(TrainTiny, OwnVHeadDimSameLossesAtEveryCp) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  TrainConfig config = tiny_config();
  config.model.v_head_dim = 12;
  ASSERT_EQ(config.model.resolved_head_dim(), 8);
  TrainConfig single = config;
  single.parallel.dp = 1;
  single.parallel.cp = 1;
  ASSERT_NO_THROW(validate(single, 1));
  const std::vector<double> reference = losses_of(single, split_communicator(*world, rank, 0));
  ASSERT_EQ(reference.size(), 20u);
  for (double loss : reference) ASSERT_TRUE(std::isfinite(loss));
  double head = 0.0, tail = 0.0;
  for (int i = 0; i < 3; ++i) head += reference[i] / 3;
  for (int i = 17; i < 20; ++i) tail += reference[i] / 3;
  EXPECT_LT(tail, head - 0.5) << "the loss did not fall: " << head << " -> " << tail;
  TrainConfig ring = config;
  ring.parallel.dp = 1;
  ring.parallel.cp = size;
  expect_same(reference, losses_of(ring, world), "v_head_dim 12, cp = " + std::to_string(size));
  TrainConfig same_width = single;
  same_width.model.v_head_dim.reset();
  same_width.train.steps = 1;
  same_width.train.warmup_steps = 0;
  EXPECT_NE(losses_of(same_width, split_communicator(*world, rank, 0)).front(), reference.front());
}

// The HDF5 token dataset as the data source: a periodic token stream (period 13, so the next token
// is learnable from the context) in a file of each rank's own (the same content), read shard by
// shard; the same equivalence and a falling loss.
TEST(TrainTiny, Hdf5DataSameLossesAtEveryCp) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  test::TempDir dir;
  std::vector<std::int32_t> tokens(64 * 100 + 1);
  const std::int32_t pattern[13] = {5, 17, 3, 60, 22, 9, 41, 33, 8, 51, 12, 27, 45};
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = pattern[(i * 7 + i / 13) % 13];
  write_token_dataset(dir / "train.h5", tokens, 64, "test");
  TrainConfig config = tiny_config();
  config.data.source = DataSource::hdf5;
  config.data.train_path = (dir / "train.h5").string();
  config.data.val_path = (dir / "train.h5").string();
  config.train.steps = 10;
  TrainConfig single = config;
  single.parallel.dp = 1;
  single.parallel.cp = 1;
  const std::vector<double> reference = losses_of(single, split_communicator(*world, rank, 0));
  ASSERT_EQ(reference.size(), 10u);
  EXPECT_LT(reference.back(), reference.front() - 0.5)
      << "the loss did not fall: " << reference.front() << " -> " << reference.back();
  TrainConfig ring = config;
  ring.parallel.dp = 1;
  ring.parallel.cp = size;
  expect_same(reference, losses_of(ring, world), "hdf5, cp = " + std::to_string(size));
}

// Stop and resume: a job of 12 steps stopped after 6 with a checkpoint, then the job resuming from
// it gives steps 7 to 12 bitwise equal to an uninterrupted run of 12 at the same layout; the same
// checkpoint resumed at cp = 1 (every rank alone) gives them within 1e-5.
// The tiny config for 8 steps with cp = the world's size.
TrainConfig eight_steps_at_world_cp(const Communicator& world) {
  TrainConfig config = tiny_config();
  config.parallel.cp = communicator_size(world);
  config.train.steps = 8;
  return config;
}

void expect_bitwise(const std::vector<double>& expected, const std::vector<double>& actual,
                    const std::string& what) {
  ASSERT_EQ(expected.size(), actual.size()) << what;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(expected[i], actual[i]) << what << ": step " << i + 1;
  }
}

// `config` (cp = the world) run straight for 12 steps, and stopped after 6, saved and resumed:
// bitwise the same losses; resumed at cp = 1 (without shard_optimizer) from that checkpoint: the
// same within 1e-5.
void expect_resume(TrainConfig config, const std::string& what) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  std::unique_ptr<test::TempDir> dir;
  if (rank == 0) dir = std::make_unique<test::TempDir>();
  const std::string root = all_gather_text(*world, rank == 0 ? dir->path().string() : "")[0];
  config.parallel.cp = size;
  config.train.steps = 12;
  config.run.dir = root + "/run";
  const std::vector<double> straight = test::expect_resume_bitwise(config, world, what);
  ASSERT_EQ(straight.size(), 12u);

  TrainConfig alone = config;
  alone.parallel.cp = 1;
  alone.train.shard_optimizer = false;
  alone.run.resume = root + "/run/ckpt-6.h5";
  expect_same(std::vector<double>(straight.begin() + 6, straight.end()),
              losses_of(alone, split_communicator(*world, rank, 0)),
              what + ": resumed at cp = 1 from a checkpoint of cp = " + std::to_string(size));
  world->barrier();  // every rank is done with the files before rank 0 removes them
}

TEST(TrainTiny, ResumeContinuesBitwiseAndUnderAnotherLayout) {
  expect_resume(tiny_config(), "moments on every rank");
}

// train.shard_optimizer: each rank updates its share of the weights from its share of the AdamW
// moments, and the ranks sum the shares: bitwise the same losses as without, and checkpoints
// (gathered from the shares) that resume bitwise and under another layout.
TEST(TrainTiny, ShardedOptimizerGivesBitwiseTheSameRun) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  TrainConfig config = eight_steps_at_world_cp(*world);
  const std::vector<double> whole = losses_of(config, world);
  config.train.shard_optimizer = true;
  expect_bitwise(whole, losses_of(config, world), "moments sharded");
  expect_resume(config, "moments sharded");
}

// A loss that overflows stops the run with an error naming the step, on every rank alike.
TEST(TrainTiny, NonFiniteLossNamesTheStep) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  TrainConfig config = tiny_config();
  config.parallel.cp = communicator_size(*world);
  config.train.lr = 1e30;
  config.train.min_lr = 1e30;
  config.train.grad_clip = 0.0;
  std::string message;
  try {
    losses_of(config, world);
  } catch (const ringattn::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find(" at step 2"), std::string::npos) << "got: '" << message << "'";
  EXPECT_NE(message.find("nan"), std::string::npos) << "got: '" << message << "'";
  // and where the first non-finite value is (the first step's update made parameters of 1e30)
  EXPECT_NE(message.find("(first non-finite: "), std::string::npos) << "got: '" << message << "'";
}

// Recomputation runs each block's forward again before its backward, from the block's saved
// input and, unless train.recompute_attention, its kept attention output and LSE: the losses are
// bitwise those of the run that keeps every activation, with or without the ring attention
// recomputed.
TEST(TrainTiny, RecomputeGivesBitwiseTheSameLosses) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  TrainConfig config = eight_steps_at_world_cp(*world);
  const std::vector<double> kept = losses_of(config, world);
  config.train.recompute = true;
  expect_bitwise(kept, losses_of(config, world), "recomputed");
  config.train.recompute_attention = true;
  expect_bitwise(kept, losses_of(config, world), "attention recomputed");
  EXPECT_LT(kept.back(), kept.front());
}

// metrics.jsonl holds a line per step with the wall-clock time the step ended ("time", Unix
// seconds to the millisecond, which benchmarks match against samplers such as nvidia-smi's): each
// line's step, loss, learning rate, gradient norm and time agree with what run() returned, the
// times lie within the run as this process's system clock saw it and do not go back. Each rank
// trains alone in a directory of its own.
TEST(TrainTiny, MetricsLinesCarryEachStepsWallClockTime) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  test::TempDir dir;
  TrainConfig config = tiny_config();
  config.train.steps = 5;
  config.parallel.dp = 1;
  config.parallel.cp = 1;
  config.run.dir = dir.path().string();
  TrainerOptions options;
  options.write_checkpoints = false;
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const double before = now();
  Trainer trainer(config, split_communicator(*world, communicator_rank(*world), 0), options);
  const std::vector<StepMetrics> steps = trainer.run();
  const double after = now();
  ASSERT_EQ(steps.size(), 5u);

  // The number after `"key": ` in a line, or NaN where the key is missing.
  const auto field = [](const std::string& line, const std::string& key) {
    const std::size_t at = line.find("\"" + key + "\": ");
    if (at == std::string::npos) return std::nan("");
    return std::strtod(line.c_str() + at + key.size() + 4, nullptr);
  };
  std::ifstream metrics(dir / "metrics.jsonl");
  ASSERT_TRUE(metrics) << "no metrics.jsonl in " << dir.path();
  std::string line;
  std::size_t lines = 0;
  double previous = before - 0.001;
  while (std::getline(metrics, line)) {
    ASSERT_LT(lines, steps.size()) << "more lines than steps: " << line;
    const StepMetrics& m = steps[lines++];
    EXPECT_EQ(field(line, "step"), m.step) << line;
    // The other numbers keep 9 significant digits.
    for (const auto& [key, value] :
         {std::pair{"loss", m.loss}, std::pair{"lr", m.lr}, std::pair{"grad_norm", m.grad_norm}}) {
      EXPECT_NEAR(field(line, key), value, 1e-8 * std::abs(value)) << key << " in " << line;
    }
    const double time = field(line, "time");
    ASSERT_TRUE(std::isfinite(time)) << "no \"time\" in " << line;
    EXPECT_NEAR(time, m.unix_time, 0.0006) << line;
    // The line keeps milliseconds: 1 ms of slack at each end of the run.
    EXPECT_GE(time, previous) << "step " << m.step << " ends before the step before it: " << line;
    EXPECT_LE(time, after + 0.001) << "step " << m.step << " ends after run() returned";
    previous = time;
  }
  EXPECT_EQ(lines, steps.size());
}

}  // namespace
}  // namespace ringattn::train
