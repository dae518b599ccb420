// Helpers for the tests that run the training loop (train/trainer.hpp): the tiny model of the CPU
// trainer tests and a run's losses.
#pragma once

#include <memory>
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

}  // namespace ringattn::test
