// ringattn-mpi-ranks: 1 2
// The blocks' inputs offloaded to host memory (train.offload on), and without recompute their
// attention outputs and other activations too: on the CPU backend the same code path as on a GPU
// (the copies out during the forward, back one block ahead of the backward, into two alternating
// buffers), with host-to-host copies. 12 steps of a 4-layer and a 5-layer tiny model (2 and 3
// blocks offloaded, the others resident) give bitwise the losses without the offload, with
// recompute and without (the feed-forward whole or in chunks); the gradient of one step is
// bitwise the same too; the first non-finite activation is found in the host copies; and a run
// stopped after 6 steps and resumed with the offload on continues bitwise like the uninterrupted
// one.
#include <mpi.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/train/temp_dir.hpp"
#include "tests/train/trainer_runs.hpp"
#include "train/config.hpp"
#include "train/model_cpu.hpp"
#include "train/trainer.hpp"

namespace ringattn::train {
namespace {

TrainConfig tiny_config(int cp, int layers) {
  TrainConfig c = test::tiny_retrieval_config();
  c.model.n_layers = layers;
  c.train.steps = 12;
  c.train.warmup_steps = 3;
  c.parallel.cp = cp;
  return c;
}

TEST(Offload, BitwiseTheLossesWithout) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world);
  // (recompute, mlp_chunk_tokens): every block's activations kept, the feed-forward's whole or
  // in chunks (their hidden activations then made again in the backward); recompute in chunks.
  const std::pair<bool, int> modes[] = {{false, 0}, {false, 40}, {true, 50}};
  for (const int layers : {4, 5}) {
    for (const auto& [recompute, chunk] : modes) {
      TrainConfig config = tiny_config(size, layers);
      config.train.recompute = recompute;
      config.train.mlp_chunk_tokens = chunk;
      config.train.offload = Offload::off;
      const std::vector<double> kept = test::losses_of(config, world);
      config.train.offload = Offload::on;
      const std::vector<double> offloaded = test::losses_of(config, world);
      ASSERT_EQ(kept.size(), 12u);
      EXPECT_EQ(offloaded, kept) << layers << " layers, recompute " << recompute << ", chunk "
                                 << chunk << ", cp " << size;
      EXPECT_LT(kept.back(), kept.front()) << "the loss did not fall";
    }
  }
}

// One step's gradients, bitwise, and the model's memory: the offloaded inputs, attention outputs
// and other activations (no recompute) in host memory; three inputs, two attention outputs and
// two blocks' other activations on the backend's side.
TEST(Offload, BitwiseTheGradients) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  const TrainConfig config = tiny_config(size, 5);
  const std::int64_t batch = 2, seq = 64, local = batch * seq / size;
  std::vector<std::int32_t> inputs(local), targets(local);
  std::vector<float> mask(local, 1.0f);
  for (std::int64_t t = 0; t < local; ++t) {
    inputs[t] = static_cast<std::int32_t>((t * 7 + rank * 13) % 64);
    targets[t] = static_cast<std::int32_t>((t * 11 + 5 + rank) % 64);
  }
  const ShardBatch shard{inputs, targets, mask};
  std::vector<std::vector<float>> grads;
  for (const bool offload : {false, true}) {
    ModelOptions options;
    options.offload = offload;
    CpuModel<float> model(config.model, batch, seq, world, SequenceLayoutKind::zigzag, options);
    model.init(3);
    model.zero_grad();
    model.loss_and_gradients(shard);
    grads.emplace_back();
    model.export_gradients(grads.back());
    // Three blocks' (5 - 2) of these floats a token: the input (d_model 32), the attention
    // output (4 heads x 8) and LSE (4), h1 (32), qkv ((4 + 2 x 2) x 8), x_mid (32), the two
    // norms' inverses (2), h2 (32), gate|up (2 x 64) and swiglu (64): 422.
    ASSERT_EQ(config.model.d_model, 32);
    ASSERT_EQ(config.model.ffn_hidden, 64);
    ASSERT_EQ(config.model.resolved_head_dim(), 8);
    const double n = static_cast<double>(local);
    EXPECT_EQ(model.allocated_memory()[ModelPart::offloaded],
              offload ? 3.0 * n * 422.0 * sizeof(float) : 0.0);
  }
  EXPECT_EQ(grads[0], grads[1]);
}

// The search for the first non-finite activation after a bad forward reads the offloaded inputs
// in their host copies: the same answer as without the offload. A block whose feed-forward norm
// has gains of 3e38 makes its normed input (an RMS of 1 a row), and so its output, infinite.
TEST(Offload, NonFiniteTensorsAreFoundInTheHostCopies) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  const TrainConfig config = tiny_config(size, 5);
  const std::int64_t batch = 2, seq = 64, local = batch * seq / size;
  std::vector<std::int32_t> tokens(local);
  for (std::int64_t t = 0; t < local; ++t) tokens[t] = static_cast<std::int32_t>((t + rank) % 64);
  const std::vector<float> mask(local, 1.0f);
  const ShardBatch shard{tokens, tokens, mask};
  for (const bool recompute : {false, true}) {
    for (const bool offload : {false, true}) {
      ModelOptions options;
      options.recompute = recompute;
      options.offload = offload;
      CpuModel<float> model(config.model, batch, seq, world, SequenceLayoutKind::zigzag, options);
      model.init(3);
      EXPECT_EQ(model.first_non_finite_tensor(), "") << "before the bad weight";
      for (std::size_t i = 0; i < model.parameter_infos().size(); ++i) {
        if (model.parameter_infos()[i].name == "layers.1.mlp_norm") {
          for (float& g : model.parameter(i)) g = 3e38f;
        }
      }
      model.forward(shard);
      EXPECT_EQ(model.first_non_finite_tensor(),
                recompute ? "layers.1.output" : "layers.1.mlp_norm output")
          << "recompute " << recompute << ", offload " << offload;
    }
  }
}

TEST(Offload, ResumeContinuesBitwise) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  std::unique_ptr<test::TempDir> dir;
  if (rank == 0) dir = std::make_unique<test::TempDir>();
  const std::string root = all_gather_text(*world, rank == 0 ? dir->path().string() : "")[0];
  TrainConfig config = tiny_config(size, 4);
  config.train.offload = Offload::on;
  config.train.recompute = true;
  config.run.dir = root + "/run";
  test::expect_resume_bitwise(config, world, "offload on");
  world->barrier();  // every rank is done with the files before rank 0 removes them
}

}  // namespace
}  // namespace ringattn::train
