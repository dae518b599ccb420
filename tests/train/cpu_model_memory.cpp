// The run's memory plan (train/model_memory.hpp): the parameter part counts what parameter_list
// lists, the parts grow with the keys that size them, and check_run_memory refuses a config that
// no machine holds, naming the keys and values that make it so, before anything is allocated (the
// tiny configs of the tests pass). What Model actually allocates is held equal to model_memory()
// by tests/train/mpi_model_allocation.cpp (a Model needs a communicator).
#include "train/model_memory.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "tests/train/expect_error.hpp"
#include "train/config.hpp"
#include "train/model.hpp"

namespace ringattn::train {
namespace {

using test::throws_error_with;

constexpr int kIntMax = std::numeric_limits<int>::max();

ModelShape shape_of(int vocab, int d_model, int layers, int heads, int kv_heads, int ffn,
                    bool tied) {
  ModelConfig m;
  m.vocab_size = vocab;
  m.d_model = d_model;
  m.n_layers = layers;
  m.n_heads = heads;
  m.n_kv_heads = kv_heads;
  m.ffn_hidden = ffn;
  m.tied_embeddings = tied;
  return model_shape(m);
}

// Weights, gradients and both moments in fp32: 16 bytes a parameter of the list; the cuda
// backend's bf16 copy of the weights adds 2.
TEST(ModelMemory, ParametersAreTheListsCount) {
  for (const ModelShape& shape :
       {shape_of(256, 64, 2, 4, 2, 176, true), shape_of(1000, 48, 3, 6, 1, 100, false),
        shape_of(50304, 768, 12, 12, 12, 3072, true)}) {
    const double count = static_cast<double>(parameter_count(shape));
    const ModelMemory cpu = model_memory(shape, 64, ModelOptions{}, kCpuModelElements, count);
    EXPECT_EQ(cpu[ModelPart::parameters], 16.0 * count) << shape.vocab;
    const ModelMemory cuda = model_memory(shape, 64, ModelOptions{}, kCudaModelElements, count);
    EXPECT_EQ(cuda[ModelPart::parameters], 18.0 * count) << shape.vocab;
    // Sharded moments: this rank's share of them alone.
    const ModelMemory half = model_memory(shape, 64, ModelOptions{}, kCpuModelElements, count / 2);
    EXPECT_EQ(half[ModelPart::parameters], 12.0 * count) << shape.vocab;
  }
}

// Activations scale with the tokens; recomputation keeps fewer blocks; logits are the smaller of
// the loss chunk and the tokens, times the vocabulary.
TEST(ModelMemory, PartsFollowTheirKeys) {
  const ModelShape shape = shape_of(256, 64, 4, 4, 2, 176, true);
  const double p = static_cast<double>(parameter_count(shape));
  ModelOptions options;
  options.loss_chunk_tokens = 100;
  const ModelMemory small = model_memory(shape, 64, options, kCpuModelElements, p);
  const ModelMemory large = model_memory(shape, 128, options, kCpuModelElements, p);
  EXPECT_EQ(large[ModelPart::activations], 2.0 * small[ModelPart::activations]);
  EXPECT_EQ(small[ModelPart::logits], 64.0 * 256 * 4);
  EXPECT_EQ(large[ModelPart::logits], 100.0 * 256 * 4);
  options.recompute = true;
  const ModelMemory recompute = model_memory(shape, 64, options, kCpuModelElements, p);
  options.recompute_attention = true;
  const ModelMemory least = model_memory(shape, 64, options, kCpuModelElements, p);
  EXPECT_LT(recompute[ModelPart::activations], small[ModelPart::activations]);
  EXPECT_LT(least[ModelPart::activations], recompute[ModelPart::activations]);
}

TrainConfig tiny_run() {
  TrainConfig config;
  config.parallel.cp = 1;
  return config;
}

// Each key alone sized past any machine: refused naming that key and its value, and the part it
// sizes; the tiny run itself passes, on either backend (its GPU's memory unknown: 0).
TEST(ModelMemory, RunsThatCannotFitAreRefusedNamingTheirKeys) {
  EXPECT_NO_THROW(check_run_memory(tiny_run(), Backend::cpu, 0.0));
  EXPECT_NO_THROW(check_run_memory(tiny_run(), Backend::cuda, 0.0));

  TrainConfig config = tiny_run();
  config.model.n_layers = kIntMax;
  EXPECT_TRUE(throws_error_with([&] { check_run_memory(config, Backend::cpu, 0.0); },
                                {"Trainer: a rank needs ", " GiB of host memory, more than the ",
                                 "model.n_layers 2147483647",
                                 "for the parameters, gradients and AdamW moments ("},
                                ErrorKind::invalid_argument));
  config = tiny_run();
  config.model.vocab_size = kIntMax;
  EXPECT_TRUE(throws_error_with([&] { check_run_memory(config, Backend::cpu, 0.0); },
                                {"model.vocab_size 2147483647", "for the logits of a loss chunk"}));
  config = tiny_run();
  config.model.d_model = 1 << 30;
  EXPECT_TRUE(
      throws_error_with([&] { check_run_memory(config, Backend::cpu, 0.0); },
                        {"model.d_model 1073741824", "for the parameters, gradients and AdamW"}));
  config = tiny_run();
  config.train.grad_accum = kIntMax;
  EXPECT_TRUE(throws_error_with(
      [&] { check_run_memory(config, Backend::cpu, 0.0); },
      {"for the micro-batches of a step (train.grad_accum 2147483647 x 2048 tokens a rank: "
       "train.batch_size 8 x train.seq_len 256 / parallel.cp 1, x 12 bytes)"}));
}

// On the cuda backend the model's parts are held against the GPU's memory, the step's batches
// and the checkpoint's copy against the host's; a later stage that does not fit is named.
TEST(ModelMemory, DeviceMemoryAndStagesAreChecked) {
  TrainConfig config = tiny_run();
  EXPECT_TRUE(throws_error_with([&] { check_run_memory(config, Backend::cuda, 1024.0); },
                                {"a rank needs ", " GiB of device memory, more than the ",
                                 " GiB its GPU has: "}));
  EXPECT_NO_THROW(check_run_memory(config, Backend::cpu, 1024.0));  // no GPU memory used
  config.train.stages = {StageConfig{2, 256, std::nullopt},
                         StageConfig{2, 1 << 28, std::optional<int>(1 << 20)}};
  config.train.steps = 4;
  EXPECT_TRUE(throws_error_with([&] { check_run_memory(config, Backend::cpu, 0.0); },
                                {" of host memory in train.stages[1] (seq_len 268435456, "
                                 "batch_size 1048576), more than the "}));
}

}  // namespace
}  // namespace ringattn::train
