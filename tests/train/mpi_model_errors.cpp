// ringattn-mpi-ranks: 1 2
// The model's argument errors name the bad value and what was expected: a loss chunk below one
// token, a batch whose token count is not batch * Sl, a checkpoint state of another size, and a
// communicator that moves the other backend's memory (the trainer builds the right one; a caller
// of Model may not). And the trainer refuses a model the cuda backend cannot run (a head dim
// without CUDA kernels) on every rank alike, before it builds anything.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/head_dims.hpp"
#include "tests/train/expect_error.hpp"
#include "train/config.hpp"
#include "train/model_cpu.hpp"
#include "train/trainer.hpp"

namespace ringattn::train {
namespace {

using test::throws_error_with;

ModelConfig tiny_model() {
  ModelConfig m;
  m.vocab_size = 16;
  m.d_model = 16;
  m.n_layers = 1;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.ffn_hidden = 24;
  return m;
}

constexpr std::int64_t kBatch = 2, kSeq = 16;

TEST(ModelErrors, LossChunkBelowOneToken) {
  ModelOptions options;
  options.loss_chunk_tokens = 0;
  EXPECT_TRUE(throws_error_with(
      [&] {
        CpuModel<float> model(tiny_model(), kBatch, kSeq, mpi_world_communicator(),
                              SequenceLayoutKind::zigzag, options);
      },
      {"loss_chunk_tokens is 0", "expected >= 1"}));
}

TEST(ModelErrors, NegativeFeedForwardChunk) {
  ModelOptions options;
  options.mlp_chunk_tokens = -3;
  EXPECT_TRUE(throws_error_with(
      [&] {
        CpuModel<float> model(tiny_model(), kBatch, kSeq, mpi_world_communicator(),
                              SequenceLayoutKind::zigzag, options);
      },
      {"mlp_chunk_tokens is -3", "expected >= 0 (0: automatic)"}));
}

TEST(ModelErrors, BatchOfTheWrongSize) {
  CpuModel<float> model(tiny_model(), kBatch, kSeq, mpi_world_communicator(),
                        SequenceLayoutKind::zigzag);
  model.init(1);
  const std::int64_t n = model.local_tokens();
  std::vector<std::int32_t> inputs(n + 1, 0), targets(n, 0);
  std::vector<float> mask(n, 1.0f);
  EXPECT_TRUE(throws_error_with([&] { model.forward({inputs, targets, mask}); },
                                {"inputs has " + std::to_string(n + 1) + " tokens",
                                 "expected batch * Sl = " + std::to_string(n)}));
}

TEST(ModelErrors, StateOfAnotherSize) {
  CpuModel<float> model(tiny_model(), kBatch, kSeq, mpi_world_communicator(),
                        SequenceLayoutKind::zigzag);
  const std::int64_t count = model.parameter_count();
  const std::vector<float> right(count, 0.0f), short_one(count - 1, 0.0f);
  EXPECT_TRUE(throws_error_with([&] { model.import_state(right, short_one, right); },
                                {"holds " + std::to_string(count - 1) + " values",
                                 "the model has " + std::to_string(count) + " parameters"}));
}

// A communicator that says it moves device memory; the model must refuse it before any transfer.
class DeviceMemoryCommunicator final : public Communicator {
 public:
  explicit DeviceMemoryCommunicator(std::shared_ptr<Communicator> host) : host_(std::move(host)) {}
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  Memory memory() const override { return Memory::device; }
  std::string transport() const override { return "MPI, reporting device memory"; }
  void exchange_start(const void*, std::size_t, void*, std::size_t, void*) override {}
  void exchange_wait(void*) override {}
  void all_reduce_sum(void*, std::size_t, DType, void*) override {}
  void barrier() override { host_->barrier(); }
  std::unique_ptr<Communicator> split(int, int) const override { return nullptr; }
  void host_all_gather(const void* send, std::size_t bytes, void* recv) const override {
    host_->host_all_gather(send, bytes, recv);
  }

 private:
  std::shared_ptr<Communicator> host_;
};

TEST(ModelErrors, CommunicatorOfTheOtherMemory) {
  auto device = std::make_shared<DeviceMemoryCommunicator>(mpi_world_communicator());
  EXPECT_TRUE(throws_error_with(
      [&] {
        CpuModel<float> model(tiny_model(), kBatch, kSeq, device, SequenceLayoutKind::zigzag);
      },
      {"the cp communicator moves device memory", "the cpu fp32 backend needs host memory"}));
}

// run.backend cuda with d_model 640 over 8 heads (head_dim 80): the trainer's config validation
// throws the same message on every rank, naming the keys and values, before the NCCL communicator
// or the model exist (which is why this runs on machines without a GPU too).
TEST(ModelErrors, TrainerRefusesACudaHeadDimWithoutKernelsOnEveryRank) {
  const std::shared_ptr<Communicator> world = mpi_world_communicator();
  TrainConfig config;
  config.model.d_model = 640;
  config.model.n_heads = 8;
  config.model.n_kv_heads = 4;
  config.parallel.dp = 1;
  config.parallel.cp = world->size();
  config.run.backend = Backend::cuda;
  std::string message = "(nothing thrown)";
  try {
    Trainer trainer(config, world);
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("model.d_model 640 / model.n_heads 8 gives head_dim 80; the CUDA block "
                         "takes " + test::built_cuda_head_dims_text()),
            std::string::npos)
      << message;
  const std::vector<std::string> all = all_gather_text(*world, message);
  for (std::size_t r = 0; r < all.size(); ++r) {
    EXPECT_EQ(all[r], all[0]) << "rank " << r << " threw another message than rank 0";
  }
}

}  // namespace
}  // namespace ringattn::train
