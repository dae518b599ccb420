// Every config in configs/ loads and validates on the world size it asks for (dp * cp), and
// tiny-cpu.yaml is exactly the built-in default (TrainConfig{}), the main job's embedded config.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>

#include "train/config.hpp"
#include "train/model_memory.hpp"

namespace ringattn::train {
namespace {

// configs/ of the source tree this test was compiled from (tests/train/<this file>).
std::filesystem::path configs_dir() {
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "configs";
}

TEST(ConfigFiles, EveryFileLoadsAndValidates) {
  std::set<std::string> seen;
  for (const auto& entry : std::filesystem::directory_iterator(configs_dir())) {
    if (entry.path().extension() != ".yaml") continue;
    SCOPED_TRACE(entry.path().string());
    seen.insert(entry.path().filename().string());
    TrainConfig config;
    ASSERT_NO_THROW(config = load_config_file(entry.path()));
    EXPECT_NO_THROW(validate(config, config.parallel.dp * config.parallel.cp));
  }
  for (const char* name :
       {"tiny-cpu.yaml", "small-32k.yaml", "long-2gpu.yaml", "long-1gpu.yaml",
        "long-1gpu-1.3b.yaml", "retrieval-16k.yaml"}) {
    EXPECT_TRUE(seen.contains(name)) << "configs/" << name << " is missing";
  }
}

TEST(ConfigFiles, TinyCpuIsTheBuiltInDefault) {
  const TrainConfig tiny = load_config_file(configs_dir() / "tiny-cpu.yaml");
  EXPECT_TRUE(tiny == TrainConfig{}) << "configs/tiny-cpu.yaml:\n"
                                     << dump_config(tiny) << "\nTrainConfig{}:\n"
                                     << dump_config(TrainConfig{});
  EXPECT_EQ(tiny.parallel.dp * tiny.parallel.cp, 2);
}

// The shapes the configs promise: the 188M reference model, cp = 2 for the long and the
// retrieval runs, one GPU at 2M tokens, a context of at least 16k for retrieval.
TEST(ConfigFiles, NamedShapes) {
  const TrainConfig small = load_config_file(configs_dir() / "small-32k.yaml");
  EXPECT_EQ(small.model.d_model, 1024);
  EXPECT_EQ(small.model.n_layers, 12);
  EXPECT_EQ(small.model.n_heads, 8);
  EXPECT_EQ(small.model.resolved_head_dim(), 128);
  EXPECT_EQ(small.model.ffn_hidden, 2816);
  EXPECT_EQ(small.model.vocab_size, 32768);
  EXPECT_EQ(small.train.seq_len, 32768);
  EXPECT_EQ(small.parallel.dp * small.parallel.cp, 1);
  const ModelConfig& m = small.model;
  const std::int64_t d = m.d_model, kv = std::int64_t{m.n_kv_heads} * m.resolved_head_dim();
  const std::int64_t per_layer = d * d * 2 + d * kv * 2 + 3 * d * m.ffn_hidden + 2 * d;
  const std::int64_t parameters = std::int64_t{m.vocab_size} * d + m.n_layers * per_layer + d;
  EXPECT_NEAR(parameters / 1e6, 188.0, 0.5);

  const TrainConfig long_run = load_config_file(configs_dir() / "long-2gpu.yaml");
  EXPECT_EQ(long_run.parallel.cp, 2);
  EXPECT_TRUE(long_run.train.recompute);
  EXPECT_GE(long_run.train.seq_len, 2 * small.train.seq_len);

  // One GPU at two million tokens: the same model, and the account says an H200 (140 GiB, less
  // 2 for the CUDA context) holds it.
  const TrainConfig one_gpu = load_config_file(configs_dir() / "long-1gpu.yaml");
  EXPECT_EQ(one_gpu.parallel.dp * one_gpu.parallel.cp, 1);
  EXPECT_TRUE(one_gpu.model == small.model);
  EXPECT_GE(one_gpu.train.seq_len, 2097152);
  EXPECT_LE(memory_account(offload_resolved(one_gpu, false), Backend::cuda).peak_bytes(),
            138.0 * 0x1p30);

  // The 1.3B shape the issue names, at a million tokens: only with the offload on an H200.
  const TrainConfig big = load_config_file(configs_dir() / "long-1gpu-1.3b.yaml");
  EXPECT_EQ(big.model.d_model, 2048);
  EXPECT_EQ(big.model.n_layers, 24);
  EXPECT_EQ(big.model.n_heads, 16);
  EXPECT_EQ(big.model.resolved_head_dim(), 128);
  EXPECT_GE(big.train.seq_len, 1048576);
  EXPECT_EQ(big.parallel.dp * big.parallel.cp, 1);
  EXPECT_TRUE(resolve_offload(big, Backend::cuda, 138.0 * 0x1p30));
  EXPECT_LE(memory_account(offload_resolved(big, true), Backend::cuda).peak_bytes(),
            138.0 * 0x1p30);

  const TrainConfig retrieval = load_config_file(configs_dir() / "retrieval-16k.yaml");
  EXPECT_EQ(retrieval.parallel.cp, 2);
  EXPECT_EQ(retrieval.data.source, DataSource::retrieval);
  EXPECT_GE(retrieval.train.seq_len, 16384);
}

}  // namespace
}  // namespace ringattn::train
