// Helpers for the tests that run the training loop (train/trainer.hpp): the tiny model of the CPU
// trainer tests and a run's losses.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.hpp"
#include "train/config.hpp"
#include "train/trainer.hpp"

namespace ringattn::test {

// 2 layers of 32, 4 heads of 8 sharing 2 K/V heads, vocabulary 64: seconds on CPU ranks.
inline train::ModelConfig tiny_model() {
  train::ModelConfig m;
  m.vocab_size = 64;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.ffn_hidden = 64;
  return m;
}

// The tiny model on the synthetic retrieval task: 20 steps of batch 4 x 64 tokens at cp 1 (the
// caller sets parallel.*), no evaluation; seconds on CPU ranks.
inline train::TrainConfig tiny_retrieval_config() {
  train::TrainConfig c;
  c.model = tiny_model();
  c.train.seq_len = 64;
  c.train.batch_size = 4;
  c.train.steps = 20;
  c.train.warmup_steps = 5;
  c.train.lr = 1e-2;
  c.train.min_lr = 1e-3;
  c.train.log_every = 100;  // no log stream is given anyway
  c.train.eval_every = 0;
  c.data.retrieval.pairs = 4;
  c.data.retrieval.queries = 4;
  return c;
}

// The loss of every step of `config` run on `comm`, writing no metrics (checkpoints only if asked).
inline std::vector<double> losses_of(const train::TrainConfig& config, std::shared_ptr<Communicator> comm,
                                     bool write_checkpoints = false) {
  train::TrainerOptions options;
  options.write_metrics = false;
  options.write_checkpoints = write_checkpoints;
  train::Trainer trainer(config, std::move(comm), options);
  std::vector<double> losses;
  for (const train::StepMetrics& m : trainer.run()) losses.push_back(m.loss);
  return losses;
}

// `config` (its run.dir one path for every rank) run straight through its train.steps (even),
// then stopped after half of them, saved and resumed from "latest": the resumed steps' losses
// must be bitwise the straight run's. Returns the straight run's losses.
inline std::vector<double> expect_resume_bitwise(const train::TrainConfig& config,
                                                 std::shared_ptr<Communicator> world,
                                                 const std::string& what) {
  const std::vector<double> straight = losses_of(config, world);
  const std::size_t half = straight.size() / 2;
  EXPECT_EQ(straight.size(), static_cast<std::size_t>(config.train.steps)) << what;
  {
    train::TrainerOptions options;
    options.write_metrics = false;
    train::Trainer stopped(config, world, options);
    for (std::size_t i = 0; i < half; ++i) EXPECT_EQ(stopped.step().loss, straight[i]) << what;
    stopped.save_checkpoint();
  }
  train::TrainConfig second = config;
  second.run.resume = "latest";
  const std::vector<double> resumed = losses_of(second, world);
  EXPECT_EQ(resumed.size(), straight.size() - half) << what;
  for (std::size_t i = 0; i < resumed.size() && half + i < straight.size(); ++i) {
    EXPECT_EQ(resumed[i], straight[half + i])
        << what << ": step " << half + i + 1 << " after resuming at step " << half;
  }
  return straight;
}

}  // namespace ringattn::test
