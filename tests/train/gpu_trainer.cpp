// The model and the training loop on the CUDA backend (bf16 activations, fp32 master weights),
// against the CPU backend (fp32) and against themselves:
//   - one forward and backward of the same weights on the same batch (the GPU's output head and
//     loss in uneven chunks of tokens, the CPU's in one): the loss within 1e-2
//     (relative) and every parameter's gradient within 6% (relative L2 error) of the CPU model's,
//     the bf16 rounding of activations and their gradients (2^-9 per rounding, a few dozen
//     roundings deep) being the bound; the forward alone (an evaluation, with predictions) gives
//     each model bitwise its training loss;
//   - deterministic mode: two runs give bitwise the same gradients, and recomputation (with the
//     attention output kept or recomputed) gives bitwise those of the run that keeps every
//     activation;
//   - the feed-forward block in chunks of tokens against the untiled one: gradients within 1%,
//     20 steps' losses within 0.5%, and the recompute modes bitwise alike at one chunk size;
//   - the blocks' inputs offloaded to host memory: bitwise the loss and gradients without;
//   - under mpiexec -n 2 on two GPUs (the ctest train.trainer.cp2): 50 steps at cp = 2 give the
//     loss curve of the same job on one GPU, within bf16 tolerance (5% at any step, 1.5% on
//     average), and the loss falls.
// MPI (tests/common/mpi_environment.hpp, singleton mode when run alone) bootstraps NCCL.
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/block_checks.hpp"
#include "parallel/communicator.hpp"
#include "parallel/device_communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/gpu.hpp"
#include "tests/common/mpi_environment.hpp"
#include "train/config.hpp"
#include "train/model_cpu.hpp"
#include "train/trainer.hpp"

namespace ringattn::train {
namespace {

using test::world_rank;
using test::world_size;

TrainConfig small_config() {
  TrainConfig c;
  c.model.vocab_size = 256;
  c.model.d_model = 256;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 512;
  c.train.seq_len = 2048;
  c.train.batch_size = 2;
  c.train.steps = 50;
  c.train.warmup_steps = 5;
  c.train.lr = 2e-3;
  c.train.min_lr = 2e-4;
  c.train.log_every = 1000;
  c.train.eval_every = 0;
  c.parallel.cp = 1;
  c.data.retrieval.pairs = 8;
  c.data.retrieval.queries = 8;
  c.run.backend = Backend::cuda;
  return c;
}

struct Batch {
  std::vector<std::int32_t> inputs, targets;
  std::vector<float> mask;
  ShardBatch view() const { return {inputs, targets, mask}; }
};

Batch random_batch(std::int64_t tokens, int vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> token(0, vocab - 1);
  Batch b;
  for (std::int64_t t = 0; t < tokens; ++t) {
    b.inputs.push_back(token(rng));
    b.targets.push_back(token(rng));
    b.mask.push_back(t % 7 == 3 ? 0.0f : 1.0f);  // some tokens left out of the loss
  }
  return b;
}

// One-rank communicators of this process: MPI for the CPU model, NCCL for the GPU one.
std::shared_ptr<Communicator> self_mpi() {
  return std::make_shared<MpiCommunicator>(MPI_COMM_SELF);
}

struct Gradients {
  double loss = 0.0;
  double eval_loss = 0.0;  // the forward alone, after the step's backward
  std::vector<float> grads;
  std::vector<std::int32_t> predictions;
};

Gradients run_once(TrainModel& model, const Batch& batch) {
  model.init(7);
  model.zero_grad();
  double weight = 0.0;
  for (float w : batch.mask) weight += w;
  const cpu::CrossEntropySums sums = model.forward_backward(batch.view(), 1.0 / weight);
  Gradients r;
  r.loss = sums.loss_sum / weight;
  model.export_gradients(r.grads);
  r.predictions.assign(batch.inputs.size(), -1);
  const cpu::CrossEntropySums eval = model.forward(batch.view(), r.predictions);
  r.eval_loss = eval.loss_sum / weight;
  return r;
}

// The relative L2 difference of `actual` from `expected` over one parameter's gradients.
double relative_difference(const std::vector<float>& actual, const std::vector<float>& expected,
                           std::size_t offset, std::int64_t count) {
  double err = 0.0, ref = 0.0;
  for (std::int64_t i = 0; i < count; ++i) {
    const double e = expected[offset + i], a = actual[offset + i];
    err += (a - e) * (a - e);
    ref += e * e;
  }
  return std::sqrt(err / ref);
}

// Every parameter's gradients in `actual` within `bound` (relative L2) of `expected`, printed.
void expect_gradients_within(const std::vector<ParameterInfo>& infos,
                             const std::vector<float>& actual, const std::vector<float>& expected,
                             double bound, const char* what) {
  std::size_t offset = 0;
  for (const ParameterInfo& info : infos) {
    const double relative = relative_difference(actual, expected, offset, info.elements);
    std::printf("  %-22s %s %.3e\n", info.name.c_str(), what, relative);
    EXPECT_LT(relative, bound) << info.name;
    offset += static_cast<std::size_t>(info.elements);
  }
}

// How many gradients differ, bitwise.
std::size_t unequal(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t count = 0;
  for (std::size_t i = 0; i < a.size(); ++i) count += a[i] != b[i];
  return count;
}

std::unique_ptr<TrainModel> cuda_model(const TrainConfig& c, ModelOptions options) {
  return make_cuda_model(c.model, c.train.batch_size, c.train.seq_len,
                         nccl_communicator_over(MPI_COMM_SELF), SequenceLayoutKind::zigzag,
                         options, nullptr);
}

// The CUDA model's loss and every parameter's gradients against the CPU model's (fp32) on the
// same random batch: loss within 1%, gradients within 6% (relative L2: bf16 activations).
void expect_cuda_model_matches_cpu(const TrainConfig& c) {
  const Batch batch = random_batch(c.train.batch_size * c.train.seq_len, c.model.vocab_size, 11);
  CpuModel<float> cpu_model(c.model, c.train.batch_size, c.train.seq_len, self_mpi(),
                            SequenceLayoutKind::zigzag);
  const Gradients expected = run_once(cpu_model, batch);
  ModelOptions chunked;
  chunked.loss_chunk_tokens = 300;  // the GPU's head and loss in 4 uneven chunks of 1024 tokens
  std::unique_ptr<TrainModel> gpu_model = cuda_model(c, chunked);
  const Gradients actual = run_once(*gpu_model, batch);
  std::printf("loss cpu %.6f cuda %.6f\n", expected.loss, actual.loss);
  EXPECT_NEAR(actual.loss, expected.loss, 1e-2 * expected.loss);
  EXPECT_EQ(actual.eval_loss, actual.loss);
  EXPECT_EQ(expected.eval_loss, expected.loss);
  for (const std::int32_t p : actual.predictions) {
    ASSERT_TRUE(p >= 0 && p < c.model.vocab_size) << "prediction " << p;
  }
  expect_gradients_within(cpu_model.parameter_infos(), actual.grads, expected.grads, 0.06,
                          "relative gradient error");
}

TEST(CudaModel, MatchesTheCpuModel) {
  RINGATTN_REQUIRE_GPUS(1);
  if (world_rank() != 0) GTEST_SKIP() << "one rank suffices";
  TrainConfig c = small_config();
  c.train.seq_len = 512;
  expect_cuda_model_matches_cpu(c);
}

// Q and K of 192 columns a head, V of 128 (multi-head latent attention's shape): the attention
// block's pair of its own, the packed QKV row of three widths and the output projection from
// heads x 128.
TEST(CudaModel, MatchesTheCpuModelWithAValueHeadDimOfItsOwn) {
  RINGATTN_REQUIRE_GPUS(1);
  if (world_rank() != 0) GTEST_SKIP() << "one rank suffices";
  if (!ringattn::detail::cuda_block_takes_value_dim(192, 128)) GTEST_SKIP() << "192 left out of this build";
  TrainConfig c = small_config();
  c.train.seq_len = 512;
  c.model.head_dim = 192;
  c.model.v_head_dim = 128;
  expect_cuda_model_matches_cpu(c);
}

// Packed documents (per batch row, one row with a boundary at a tile edge, the other padded),
// RoPE restarting at each document and a sliding window: the CUDA model against the CPU model
// with the same documents, within the bounds above; and the documents must matter (the CPU
// model without them differs by more than three times the CUDA model's largest error).
TEST(CudaModel, MatchesTheCpuModelWithDocumentsAndWindow) {
  RINGATTN_REQUIRE_GPUS(1);
  if (world_rank() != 0) GTEST_SKIP() << "one rank suffices";
  TrainConfig c = small_config();
  c.train.seq_len = 512;
  c.model.attention_window = 100;
  const std::int64_t count = 3;
  const std::vector<std::int64_t> documents = {64, 200, 333, 150, 512, 512};
  Batch batch = random_batch(c.train.batch_size * c.train.seq_len, c.model.vocab_size, 12);
  ShardBatch view = batch.view();
  view.documents = documents;
  view.document_count = count;
  ModelOptions options;
  options.rope_document_positions = true;
  const auto run = [&](TrainModel& model, const ShardBatch& b) {
    model.init(7);
    model.zero_grad();
    double weight = 0.0;
    for (float w : batch.mask) weight += w;
    const cpu::CrossEntropySums sums = model.forward_backward(b, 1.0 / weight);
    Gradients r;
    r.loss = sums.loss_sum / weight;
    model.export_gradients(r.grads);
    return r;
  };
  CpuModel<float> cpu_model(c.model, c.train.batch_size, c.train.seq_len, self_mpi(),
                            SequenceLayoutKind::zigzag, options);
  const Gradients expected = run(cpu_model, view);
  const Gradients without = run(cpu_model, batch.view());
  std::unique_ptr<TrainModel> gpu_model = cuda_model(c, options);
  const Gradients actual = run(*gpu_model, view);
  std::printf("loss cpu %.6f cuda %.6f (cpu without documents %.6f)\n", expected.loss,
              actual.loss, without.loss);
  EXPECT_NEAR(actual.loss, expected.loss, 1e-2 * expected.loss);
  std::size_t offset = 0;
  double farthest_without = 0.0, farthest_cuda = 0.0;
  for (const ParameterInfo& info : cpu_model.parameter_infos()) {
    double err = 0.0, ref = 0.0, other = 0.0;
    for (std::int64_t i = 0; i < info.elements; ++i) {
      const double e = expected.grads[offset + i], a = actual.grads[offset + i];
      err += (a - e) * (a - e);
      ref += e * e;
      other += (without.grads[offset + i] - e) * (without.grads[offset + i] - e);
    }
    const double relative = std::sqrt(err / ref);
    farthest_without = std::max(farthest_without, std::sqrt(other / ref));
    farthest_cuda = std::max(farthest_cuda, relative);
    std::printf("  %-22s relative gradient error %.3e\n", info.name.c_str(), relative);
    EXPECT_LT(relative, 0.06) << info.name;
    offset += static_cast<std::size_t>(info.elements);
  }
  // A CUDA model that ignored the documents would be this far off: the check above can tell.
  std::printf("largest gradient change without the documents %.3e, CUDA error %.3e\n",
              farthest_without, farthest_cuda);
  EXPECT_GT(farthest_without, 3.0 * farthest_cuda);
}

TEST(CudaModel, DeterministicModeAndRecomputationAreBitwiseReproducible) {
  RINGATTN_REQUIRE_GPUS(1);
  if (world_rank() != 0) GTEST_SKIP() << "one rank suffices";
  const TrainConfig c = small_config();
  const Batch batch = random_batch(c.train.batch_size * c.train.seq_len, c.model.vocab_size, 12);
  ModelOptions options;
  options.deterministic = true;
  std::unique_ptr<TrainModel> kept = cuda_model(c, options);
  const Gradients first = run_once(*kept, batch);
  const Gradients second = run_once(*kept, batch);
  options.recompute = true;
  std::unique_ptr<TrainModel> recomputing = cuda_model(c, options);
  const Gradients recomputed = run_once(*recomputing, batch);
  options.recompute_attention = true;
  std::unique_ptr<TrainModel> recomputing_attention = cuda_model(c, options);
  const Gradients attention_recomputed = run_once(*recomputing_attention, batch);
  EXPECT_EQ(first.loss, second.loss);
  EXPECT_EQ(first.loss, recomputed.loss);
  EXPECT_EQ(first.loss, attention_recomputed.loss);
  ASSERT_EQ(first.grads.size(), second.grads.size());
  EXPECT_EQ(unequal(first.grads, second.grads), 0u) << "of " << first.grads.size();
  EXPECT_EQ(unequal(first.grads, recomputed.grads), 0u) << "of " << first.grads.size();
  EXPECT_EQ(unequal(first.grads, attention_recomputed.grads), 0u) << "of " << first.grads.size();
}

// The feed-forward block in uneven chunks of 1000 of the 4096 tokens (train.mlp_chunk_tokens),
// deterministic: its gradients within 1% (relative L2 error, each parameter) of the untiled
// block's (cuBLAS may sum a chunk's GEMM in another order, and bf16 rounds the differences), every
// recompute mode bitwise the same at that chunk size, and 20 training steps within 0.5% of the
// untiled run's losses at every step.
TEST(CudaModel, FeedForwardInChunks) {
  RINGATTN_REQUIRE_GPUS(1);
  if (world_rank() != 0) GTEST_SKIP() << "one rank suffices";
  const TrainConfig c = small_config();
  const Batch batch = random_batch(c.train.batch_size * c.train.seq_len, c.model.vocab_size, 13);
  ModelOptions options;
  options.deterministic = true;
  std::unique_ptr<TrainModel> untiled_model = cuda_model(c, options);
  const Gradients untiled = run_once(*untiled_model, batch);
  options.mlp_chunk_tokens = 1000;
  std::vector<Gradients> tiled;
  for (const int mode : {0, 1, 2}) {
    options.recompute = mode >= 1;
    options.recompute_attention = mode == 2;
    std::unique_ptr<TrainModel> model = cuda_model(c, options);
    tiled.push_back(run_once(*model, batch));
  }
  std::printf("loss untiled %.7f tiled %.7f\n", untiled.loss, tiled[0].loss);
  EXPECT_NEAR(tiled[0].loss, untiled.loss, 1e-3 * untiled.loss);
  for (int mode : {1, 2}) {
    EXPECT_EQ(tiled[mode].loss, tiled[0].loss) << "recompute mode " << mode;
    EXPECT_EQ(unequal(tiled[mode].grads, tiled[0].grads), 0u)
        << "recompute mode " << mode << ": of " << tiled[0].grads.size() << " gradients";
  }
  expect_gradients_within(untiled_model->parameter_infos(), tiled[0].grads, untiled.grads, 1e-2,
                          "tiled against untiled: relative gradient difference");
}

// The blocks' inputs offloaded to pinned host memory (4 layers: 2 of them), without recompute
// with their attention outputs and other activations, deterministic: the copies out and back on
// their own stream give bitwise the loss and gradients of the run that keeps them, with and
// without recompute.
TEST(CudaModel, OffloadIsBitwiseTheRunWithout) {
  RINGATTN_REQUIRE_GPUS(1);
  if (world_rank() != 0) GTEST_SKIP() << "one rank suffices";
  TrainConfig c = small_config();
  c.model.n_layers = 4;
  const Batch batch = random_batch(c.train.batch_size * c.train.seq_len, c.model.vocab_size, 14);
  for (const bool recompute : {false, true}) {
    ModelOptions options;
    options.deterministic = true;
    options.recompute = recompute;
    options.mlp_chunk_tokens = recompute ? 1000 : 0;
    std::unique_ptr<TrainModel> kept_model = cuda_model(c, options);
    const Gradients kept = run_once(*kept_model, batch);
    options.offload = true;
    std::unique_ptr<TrainModel> offloading = cuda_model(c, options);
    const Gradients offloaded = run_once(*offloading, batch);
    EXPECT_EQ(offloaded.loss, kept.loss) << "recompute " << recompute;
    EXPECT_EQ(offloaded.eval_loss, kept.eval_loss) << "recompute " << recompute;
    EXPECT_EQ(unequal(offloaded.grads, kept.grads), 0u)
        << "recompute " << recompute << ": of " << kept.grads.size() << " gradients";
  }
}

std::vector<double> losses_of(const TrainConfig& config, std::shared_ptr<Communicator> comm) {
  TrainerOptions options;
  options.write_metrics = false;
  options.write_checkpoints = false;
  Trainer trainer(config, std::move(comm), options);
  std::vector<double> losses;
  for (const StepMetrics& m : trainer.run()) losses.push_back(m.loss);
  return losses;
}

TEST(CudaTrainer, FeedForwardInChunksFollowsTheUntiledLossCurve) {
  RINGATTN_REQUIRE_GPUS(1);
  if (world_rank() != 0) GTEST_SKIP() << "one rank suffices";
  TrainConfig c = small_config();
  c.train.steps = 20;
  c.train.deterministic = true;
  const std::shared_ptr<Communicator> self = self_mpi();
  const std::vector<double> untiled = losses_of(c, self);
  c.train.mlp_chunk_tokens = 1000;
  c.train.recompute = true;
  const std::vector<double> tiled = losses_of(c, self);
  ASSERT_EQ(tiled.size(), untiled.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < tiled.size(); ++i) {
    const double relative = std::abs(tiled[i] - untiled[i]) / std::abs(untiled[i]);
    worst = std::max(worst, relative);
    EXPECT_LT(relative, 5e-3) << "step " << i + 1 << ": tiled " << tiled[i] << ", untiled "
                              << untiled[i];
  }
  std::printf("20 steps, feed-forward in chunks of 1000: largest relative loss difference %.3g "
              "(first %.5f, last %.5f)\n",
              worst, untiled.front(), untiled.back());
  EXPECT_LT(untiled.back(), untiled.front()) << "the loss did not fall";
}

TEST(CudaTrainer, TwoGpusFollowTheLossCurveOfOne) {
  if (world_size() != 2) GTEST_SKIP() << "runs under mpiexec -n 2 (ctest train.trainer.cp2)";
  RINGATTN_REQUIRE_GPUS(2);
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  TrainConfig ring = small_config();
  ring.parallel.cp = 2;
  const std::vector<double> two = losses_of(ring, world);
  const std::vector<double> one = losses_of(small_config(), split_communicator(*world, world_rank(), 0));
  ASSERT_EQ(one.size(), two.size());
  double worst = 0.0, mean = 0.0;
  for (std::size_t i = 0; i < one.size(); ++i) {
    const double relative = std::abs(two[i] - one[i]) / std::abs(one[i]);
    worst = std::max(worst, relative);
    mean += relative / static_cast<double>(one.size());
    EXPECT_LT(relative, 0.05) << "step " << i + 1 << ": cp = 2 " << two[i] << ", one GPU " << one[i];
  }
  EXPECT_LT(mean, 0.015);
  if (world_rank() == 0) {
    std::printf("loss one GPU %.4f -> %.4f, two GPUs %.4f -> %.4f; relative difference max %.3g, "
                "mean %.3g\n", one.front(), one.back(), two.front(), two.back(), worst, mean);
  }
  EXPECT_LT(one.back(), one.front() - 0.5);
}

}  // namespace
}  // namespace ringattn::train
