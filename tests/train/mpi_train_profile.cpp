// ringattn-mpi-ranks: 1 2
// The phase profile of the CPU trainer (train.profile): a tiny run with it gives bitwise the same
// losses as without; rank 0 logs the table and writes profile.json, whose phases are exactly the
// model's, each with as many calls as the model's structure makes over the steps profiled (every
// step but the first; the counts derived from the config here, with and without recomputation),
// and non-negative times. A run without the profile writes no profile.json.
#include <mpi.h>

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/train/temp_dir.hpp"
#include "train/config.hpp"
#include "train/trainer.hpp"

namespace ringattn::train {
namespace {

TrainConfig tiny_config(int ranks) {
  TrainConfig c;
  c.model.vocab_size = 64;
  c.model.d_model = 32;
  c.model.n_layers = 3;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 64;
  c.train.seq_len = 64;
  c.train.batch_size = 2;
  c.train.grad_accum = 2;
  c.train.steps = 3;
  c.train.warmup_steps = 1;
  c.train.log_every = 100;
  c.train.eval_every = 0;
  c.data.retrieval.pairs = 4;
  c.data.retrieval.queries = 4;
  c.parallel.dp = 1;
  c.parallel.cp = ranks;
  return c;
}

// The intervals of every phase over the run, from the model's structure (train/model_impl.hpp):
// per micro-batch the batch, the embedding, L blocks, the final norm, the head and the loss (one
// chunk: batch * Sl tokens are far fewer than ModelOptions::loss_chunk_tokens) and their backward;
// per step zeroing, the norm, AdamW and, on more than one rank, the all-reduce. Recomputation
// runs a block's forward again up to its MLP activation (and the attention with
// recompute_attention) before its backward.
std::map<std::string, std::int64_t> expected_calls(const TrainConfig& c, int ranks) {
  const std::int64_t steps = c.train.steps - 1;  // the first step is not profiled
  const std::int64_t micro = steps * c.train.grad_accum;
  const std::int64_t blocks = c.model.n_layers * micro;
  const std::int64_t forwards = c.train.recompute ? 2 * blocks : blocks;
  const std::int64_t attention = c.train.recompute_attention ? 2 * blocks : blocks;
  std::map<std::string, std::int64_t> calls = {
      {"batch.load", micro},
      {"embedding", micro},
      {"rmsnorm", 2 * forwards + micro},
      {"matmul.qkv", forwards},
      {"rope", forwards},
      {"attention.forward", attention},
      {"matmul.wo", forwards},
      {"matmul.gate_up", forwards},
      {"swiglu", forwards},
      {"matmul.down", blocks},
      {"loss.head_matmul", micro},
      {"loss.cross_entropy", micro},
      {"loss.head_matmul.backward", micro},
      {"rmsnorm.backward", 2 * blocks + micro},
      {"matmul.down.backward", blocks},
      {"swiglu.backward", blocks},
      {"matmul.gate_up.backward", blocks},
      {"matmul.wo.backward", blocks},
      {"attention.backward", blocks},
      {"rope.backward", blocks},
      {"matmul.qkv.backward", blocks},
      {"embedding.backward", micro},
      {"grad.zero", steps},
      {"grad.norm", steps},
      {"adamw", steps},
  };
  if (ranks > 1) calls["grad.allreduce"] = steps;
  return calls;
}

struct Run {
  std::vector<double> losses;
  std::string log;  // rank 0's
};

Run run(const TrainConfig& config, std::shared_ptr<Communicator> world) {
  std::ostringstream log;
  TrainerOptions options;
  options.log = communicator_rank(*world) == 0 ? &log : nullptr;
  options.write_checkpoints = false;
  Trainer trainer(config, std::move(world), options);
  Run out;
  for (const StepMetrics& m : trainer.run()) out.losses.push_back(m.loss);
  out.log = log.str();
  return out;
}

void expect_profile(const TrainConfig& config, int ranks) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int rank = communicator_rank(*world);
  std::unique_ptr<test::TempDir> dir;
  if (rank == 0) dir = std::make_unique<test::TempDir>();
  const std::string root = all_gather_text(*world, rank == 0 ? dir->path().string() : "")[0];

  TrainConfig plain = config;
  plain.run.dir = root + "/plain";
  const Run reference = run(plain, world);
  TrainConfig profiled = config;
  profiled.train.profile = true;
  profiled.run.dir = root + "/profiled";
  const Run timed = run(profiled, world);

  ASSERT_EQ(reference.losses.size(), static_cast<std::size_t>(config.train.steps));
  ASSERT_EQ(timed.losses.size(), reference.losses.size());
  for (std::size_t i = 0; i < reference.losses.size(); ++i) {
    EXPECT_EQ(timed.losses[i], reference.losses[i]) << "step " << i + 1;
  }
  world->barrier();  // every rank is done before rank 0 reads (and then removes) the files
  if (rank != 0) return;

  EXPECT_FALSE(std::filesystem::exists(plain.run.dir + "/profile.json"))
      << "a run without train.profile wrote a profile";
  const std::string path = profiled.run.dir + "/profile.json";
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const YAML::Node json = YAML::LoadFile(path);  // JSON is YAML
  EXPECT_EQ(json["steps"].as<int>(), config.train.steps - 1);
  EXPECT_EQ(json["backend"].as<std::string>(), "cpu fp32");
  EXPECT_GE(json["total_ms"].as<double>(), 0.0);
  EXPECT_GE(json["step_ms"].as<double>(), 0.0);
  // The phases do not nest and lie within the steps: what is left over is not negative.
  EXPECT_GE(json["untracked"]["total_ms"].as<double>(), 0.0);

  const std::map<std::string, std::int64_t> expected = expected_calls(config, ranks);
  std::map<std::string, std::int64_t> calls;
  double previous_ms = json["total_ms"].as<double>();
  for (const YAML::Node& phase : json["phases"]) {
    const std::string name = phase["name"].as<std::string>();
    EXPECT_TRUE(calls.emplace(name, phase["calls"].as<std::int64_t>()).second)
        << name << " is listed twice";
    const double total_ms = phase["total_ms"].as<double>();
    EXPECT_GE(total_ms, 0.0) << name;
    EXPECT_GE(phase["ms_per_step"].as<double>(), 0.0) << name;
    EXPECT_GE(phase["share"].as<double>(), 0.0) << name;
    EXPECT_LE(total_ms, previous_ms) << name << ": the phases are not sorted, slowest first";
    previous_ms = total_ms;
    EXPECT_NE(timed.log.find("  " + name + " "), std::string::npos)
        << name << " is not in the logged table:\n"
        << timed.log;
  }
  EXPECT_EQ(calls, expected);
  for (const char* part :
       {"profile of rank 0 (cpu fp32): ", "untracked (wall - phases)", "profile.json"}) {
    EXPECT_NE(timed.log.find(part), std::string::npos) << part << " is not in:\n" << timed.log;
  }
  EXPECT_EQ(reference.log.find("profile"), std::string::npos)
      << "a run without train.profile logged a profile:\n"
      << reference.log;
}

TEST(TrainProfile, PhasesCountTheModelsOpsAndLeaveTheLossesAlone) {
  const int ranks = communicator_size(*mpi_world_communicator());
  expect_profile(tiny_config(ranks), ranks);
}

TEST(TrainProfile, RecomputedForwardsCountUnderTheForwardsNames) {
  const int ranks = communicator_size(*mpi_world_communicator());
  TrainConfig config = tiny_config(ranks);
  config.train.recompute = true;
  {
    SCOPED_TRACE("recompute");
    expect_profile(config, ranks);
  }
  config.train.recompute_attention = true;
  {
    SCOPED_TRACE("recompute_attention");
    expect_profile(config, ranks);
  }
}

}  // namespace
}  // namespace ringattn::train
