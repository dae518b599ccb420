// ringattn-mpi-ranks: 1 2
// What a Model allocates is what model_memory() predicts, part by part, for the shapes and options
// that change its buffers (GQA, untied embeddings, V heads of their own width, loss chunks,
// recomputation with and without the attention, the feed-forward block in chunks, the blocks'
// inputs offloaded, cp ranks, fp32 and fp64): the trainer's check before step 1 is then the
// model's own account. And an allocation that cannot be made is an Error naming the part, its
// bytes and the config keys that size it, not a bare std::bad_alloc or max_size() message.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/train/expect_error.hpp"
#include "train/model_cpu.hpp"
#include "train/model_memory.hpp"

namespace ringattn::train {
namespace {

using test::throws_error_with;

// Heads of 16 / 4 = 4; V's of v_head_dim where given.
ModelConfig small_model(int layers, bool tied, int kv_heads,
                        std::optional<int> v_head_dim = std::nullopt) {
  ModelConfig m;
  m.v_head_dim = v_head_dim;
  m.vocab_size = 40;
  m.d_model = 16;
  m.n_layers = layers;
  m.n_heads = 4;
  m.n_kv_heads = kv_heads;
  m.ffn_hidden = 24;
  m.tied_embeddings = tied;
  return m;
}

template <typename T>
void expect_allocated_as_predicted(const ModelConfig& config, const ModelOptions& options,
                                   ModelElementBytes element_bytes) {
  CpuModel<T> model(config, 3, 16, mpi_world_communicator(), SequenceLayoutKind::zigzag, options);
  const ModelMemory predicted =
      model_memory(model_shape(config), static_cast<double>(model.local_tokens()), options,
                   element_bytes, static_cast<double>(model.parameter_count()),
                   communicator_size(*mpi_world_communicator()));
  const ModelMemory& allocated = model.allocated_memory();
  for (const ModelPart part : {ModelPart::parameters, ModelPart::activations, ModelPart::logits,
                              ModelPart::offloaded}) {
    EXPECT_EQ(allocated[part], predicted[part]) << model_part_name(part);
  }
}

TEST(ModelAllocation, WhatTheModelAllocatesIsPredicted) {
  struct Case {
    const char* name;
    ModelConfig config;
    bool recompute, recompute_attention;
    std::int64_t loss_chunk_tokens;
    std::int64_t mlp_chunk_tokens = 0;
    bool offload = false;
  };
  const Case cases[] = {
      {"tied, GQA", small_model(2, true, 2), false, false, 8192},
      {"untied, multi-head, chunks of 5", small_model(3, false, 4), false, false, 5},
      {"recompute", small_model(3, true, 1), true, false, 8192},
      {"recompute attention", small_model(3, true, 2), true, true, 7},
      {"one layer, recompute attention", small_model(1, true, 2), true, true, 8192},
      {"feed-forward in chunks of 5", small_model(2, true, 2), false, false, 8192, 5},
      {"recompute, feed-forward in chunks of 7", small_model(3, false, 4), true, false, 5, 7},
      {"recompute attention, feed-forward in chunks of 1", small_model(2, true, 2), true, true,
       8192, 1},
      {"recompute, automatic chunk (all the tokens)", small_model(2, true, 2), true, false, 8192,
       0},
      {"offload, 4 layers", small_model(4, true, 2), false, false, 8192, 0, true},
      {"offload, 5 layers, feed-forward in chunks of 4", small_model(5, false, 2), false, false,
       8192, 4, true},
      {"offload, 2 layers (every input resident)", small_model(2, false, 4), true, false, 5, 0,
       true},
      {"offload, recompute attention, chunks of 3", small_model(5, true, 2), true, true, 8192, 3,
       true},
      {"v_head_dim 6, GQA", small_model(2, true, 2, 6), false, false, 8192},
      {"v_head_dim 3, untied, recompute, chunks of 5", small_model(3, false, 4, 3), true, false, 5,
       0},
      {"v_head_dim 10, recompute attention, feed-forward in chunks of 2",
       small_model(2, true, 1, 10), true, true, 8192, 2},
      {"v_head_dim 6, offload, 4 layers", small_model(4, false, 2, 6), false, false, 8192, 0, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ModelOptions options;
    options.recompute = c.recompute;
    options.recompute_attention = c.recompute_attention;
    options.loss_chunk_tokens = c.loss_chunk_tokens;
    options.mlp_chunk_tokens = c.mlp_chunk_tokens;
    options.offload = c.offload;
    expect_allocated_as_predicted<float>(c.config, options, kCpuModelElements);
    expect_allocated_as_predicted<double>(c.config, options, ModelElementBytes{8, 8, 8});
  }
}

// Parameters whose byte count passes int64 (d_model 2^30 x vocab 2^31 - 1), and activations no
// address space holds (2^57 floats of a batch of 2^49 sequences): each refused by name before
// any memory is touched.
TEST(ModelAllocation, AllocationsThatFailNameTheirPartAndKeys) {
  ModelConfig huge = small_model(1, true, 2);
  huge.vocab_size = 2147483647;
  huge.d_model = 1 << 30;
  EXPECT_TRUE(throws_error_with(
      [&] {
        CpuModel<float> model(huge, 1, 16, mpi_world_communicator(), SequenceLayoutKind::zigzag);
      },
      {"Model: cannot allocate ", " GiB of host memory (", " x 4 bytes) for the parameters, "
       "gradients and AdamW moments, whose size is set by model.vocab_size, model.d_model",
       ": its size in bytes passes int64"},
      ErrorKind::library));
  const std::int64_t batch = std::int64_t{1} << 49;
  EXPECT_TRUE(throws_error_with(
      [&] {
        CpuModel<float> model(small_model(1, true, 2), batch, 16, mpi_world_communicator(),
                              SequenceLayoutKind::zigzag);
      },
      {"Model: cannot allocate ", " of host memory (", " for the activations of a micro-batch, "
       "whose size is set by train.batch_size, train.seq_len / parallel.cp"},
      ErrorKind::library));
}

}  // namespace
}  // namespace ringattn::train
