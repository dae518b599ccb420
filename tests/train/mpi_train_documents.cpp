// ringattn-mpi-ranks: 1 2 4
// Packed documents end to end on the CPU backend (fp32), on a ring of every rank (cp = the world
// size, zigzag):
//   - the model on packed sequences, two rows [A | B | C] and [D | E] (the second list padded),
//     with the documents in every layer's attention, RoPE restarting at each document and the
//     targets that cross a boundary masked, gives the loss sum and the gradients of A, B, C, D and
//     E run separately as sequences of their own on one rank (relative 1e-5); the same packed
//     sequences without their documents do not (the check can fail);
//   - the local-attention control with documents that stay within shards equals them run
//     separately too;
//   - the trainer on an HDF5 dataset with document_starts (and a sliding window) gives the same 20
//     losses at cp = 1 and at cp = N (relative 1e-5), with the zigzag layout and with the
//     balanced one (laid out per micro-batch by its documents), and a run stopped and resumed from its
//     checkpoint continues bitwise, and recomputation changes no bit.
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/random.hpp"
#include "tests/train/temp_dir.hpp"
#include "tests/train/trainer_runs.hpp"
#include "train/config.hpp"
#include "train/model_cpu.hpp"
#include "train/shard_ranges.hpp"
#include "train/token_dataset_writer.hpp"
#include "train/trainer.hpp"

namespace ringattn::train {
namespace {

constexpr std::uint64_t kInitSeed = 77;

ModelConfig packed_model() {
  ModelConfig m = test::tiny_model();
  m.init_std = 0.3;  // attention weights far from uniform: the documents matter to the loss
  return m;
}

struct LossAndGradients {
  double loss_sum = 0.0, weight_sum = 0.0;
  std::vector<float> gradients;
};

// One forward and backward of the gradient of the loss SUM (grad_scale 1) of `tokens` (batch rows
// of seq_len + 1 tokens), sharded over `cp_comm` by `layout`; sums and gradients added over
// `cp_comm` (local_attention: the control of ModelOptions).
LossAndGradients run_model(const std::vector<std::vector<std::int32_t>>& tokens,
                           const std::vector<std::vector<float>>& masks,
                           const std::vector<std::int64_t>& documents, std::int64_t document_count,
                           std::int64_t seq_len, std::shared_ptr<Communicator> cp_comm,
                           SequenceLayoutKind layout, bool local_attention = false) {
  const auto batch = static_cast<std::int64_t>(tokens.size());
  ModelOptions options;
  options.rope_document_positions = true;
  options.local_attention = local_attention;
  CpuModel<float> model(packed_model(), batch, seq_len, cp_comm, layout, options, cp_comm);
  model.init(kInitSeed);
  const int cp = communicator_size(*cp_comm), rank = communicator_rank(*cp_comm);
  const auto ranges = shard_ranges(seq_len, cp, rank,
                                   layout == SequenceLayoutKind::zigzag ? ShardLayout::zigzag
                                                                        : ShardLayout::contiguous);
  std::vector<std::int32_t> inputs, targets;
  std::vector<float> mask;
  for (std::int64_t b = 0; b < batch; ++b) {
    const TokenShard shard = take_shard(tokens[b], masks[b], ranges);
    inputs.insert(inputs.end(), shard.inputs.begin(), shard.inputs.end());
    targets.insert(targets.end(), shard.targets.begin(), shard.targets.end());
    mask.insert(mask.end(), shard.loss_mask.begin(), shard.loss_mask.end());
  }
  const ShardBatch view{inputs, targets, mask, documents, document_count};
  const cpu::CrossEntropySums sums = model.forward_backward(view, 1.0);
  LossAndGradients out;
  double totals[2] = {sums.loss_sum, sums.weight_sum};
  cp_comm->all_reduce_sum(totals, 2, DType::f64, nullptr);
  out.loss_sum = totals[0];
  out.weight_sum = totals[1];
  model.all_reduce_gradients();
  model.export_gradients(out.gradients);
  return out;
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// Rows of kSeq + 1 random tokens cut into documents of the given lengths (each row's add up to
// kSeq), with the loss mask of packing: the target of a document's last token (the next one's
// first) out.
constexpr std::int64_t kSeq = 48;  // a multiple of 2 cp for cp = 1, 2, 4

struct Packed {
  std::vector<std::vector<std::int64_t>> lengths;
  std::vector<std::vector<std::int32_t>> tokens;
  std::vector<std::vector<float>> masks;
  std::vector<std::int64_t> documents;  // [rows, count], padded with kSeq
  std::int64_t count = 0;
};

Packed pack(const std::vector<std::vector<std::int64_t>>& lengths, std::mt19937_64& rng) {
  Packed p;
  p.lengths = lengths;
  std::vector<std::vector<std::int64_t>> starts(lengths.size());
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    p.tokens.emplace_back(kSeq + 1);
    for (auto& t : p.tokens.back()) t = static_cast<std::int32_t>(rng() % 64);
    p.masks.emplace_back(kSeq, 1.0f);
    std::int64_t at = 0;
    for (std::size_t d = 0; d < lengths[b].size(); ++d) {
      if (d > 0) starts[b].push_back(at);
      at += lengths[b][d];
      if (d + 1 < lengths[b].size()) p.masks[b][at - 1] = 0.0f;
    }
    EXPECT_EQ(at, kSeq);
    p.count = std::max(p.count, static_cast<std::int64_t>(starts[b].size()));
  }
  for (auto& row : starts) {
    row.resize(static_cast<std::size_t>(p.count), kSeq);
    p.documents.insert(p.documents.end(), row.begin(), row.end());
  }
  return p;
}

// Each document as a sequence of its own on this rank alone: its tokens, the targets after them
// (the last one out, but for the row's last document, whose last target is the row's last).
LossAndGradients separately(const Packed& p, std::shared_ptr<Communicator> alone) {
  LossAndGradients sum;
  for (std::size_t b = 0; b < p.lengths.size(); ++b) {
    std::int64_t at = 0;
    for (std::size_t d = 0; d < p.lengths[b].size(); ++d) {
      const std::int64_t n = p.lengths[b][d];
      std::vector<std::int32_t> doc(p.tokens[b].begin() + at, p.tokens[b].begin() + at + n + 1);
      std::vector<float> mask(n, 1.0f);
      if (d + 1 < p.lengths[b].size()) mask.back() = 0.0f;
      const LossAndGradients one =
          run_model({doc}, {mask}, {}, 0, n, alone, SequenceLayoutKind::contiguous);
      sum.loss_sum += one.loss_sum;
      sum.weight_sum += one.weight_sum;
      if (sum.gradients.empty()) sum.gradients.assign(one.gradients.size(), 0.0f);
      for (std::size_t i = 0; i < one.gradients.size(); ++i) sum.gradients[i] += one.gradients[i];
      at += n;
    }
  }
  return sum;
}

void expect_equal_sums(const LossAndGradients& packed, const LossAndGradients& separate,
                       const std::string& what) {
  EXPECT_EQ(packed.weight_sum, separate.weight_sum) << what;
  const double loss_error = std::abs(packed.loss_sum - separate.loss_sum) / separate.loss_sum;
  const double grad_error = relative_difference(packed.gradients, separate.gradients);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    std::printf("%s: loss sum %.6f vs %.6f separately (relative %.3g), gradients relative %.3g\n",
                what.c_str(), packed.loss_sum, separate.loss_sum, loss_error, grad_error);
  }
  EXPECT_LT(loss_error, 1e-5) << what << ": " << packed.loss_sum << " vs " << separate.loss_sum;
  EXPECT_LT(grad_error, 1e-5) << what;
}

TEST(TrainDocuments, PackedSequenceEqualsItsDocumentsRunSeparately) {
  SCOPED_TRACE(test::seed_trace());
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int rank = communicator_rank(*world);
  std::mt19937_64 rng = test::make_rng(3);  // the same on every rank (rank 0's seed)
  // [A | B | C] and [D | E]: the second row's one start padded with kSeq (an empty document).
  const Packed p = pack({{13, 21, 14}, {30, 18}}, rng);
  ASSERT_EQ(p.documents, (std::vector<std::int64_t>{13, 34, 30, kSeq}));
  const LossAndGradients packed =
      run_model(p.tokens, p.masks, p.documents, p.count, kSeq, world, SequenceLayoutKind::zigzag);
  const LossAndGradients separate = separately(p, split_communicator(*world, rank, 0));
  EXPECT_EQ(packed.weight_sum, double(2 * kSeq - 3));
  expect_equal_sums(packed, separate,
                    "packed documents at cp = " + std::to_string(communicator_size(*world)));

  // The same packed rows without their documents (one document each; the mask kept): attention
  // then crosses the boundaries, and the result is another one. The gradients tell (the loss sum
  // alone moved by only 7e-4 relative for some seeds): they must move by far more than the 1e-5
  // the comparison above allows.
  const LossAndGradients crossing =
      run_model(p.tokens, p.masks, {}, 0, kSeq, world, SequenceLayoutKind::zigzag);
  const double moved = relative_difference(crossing.gradients, separate.gradients);
  if (rank == 0) std::printf("without the documents: gradients relative %.2e\n", moved);
  EXPECT_GT(moved, 1e-3) << "the documents change nothing: the check could not fail";
}

// The local-attention control (each rank attends within its own shard, indexed locally) with
// documents that never cross a zigzag chunk (every chunk boundary at cp <= 4 is a document start:
// multiples of 6): the shards then hold whole documents, and the control must equal the documents
// run separately, which needs the documents re-expressed in the shard's local indices.
TEST(TrainDocuments, LocalAttentionKeepsTheDocumentsOfItsShard) {
  SCOPED_TRACE(test::seed_trace());
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int rank = communicator_rank(*world);
  std::mt19937_64 rng = test::make_rng(5);
  const Packed p = pack({{6, 2, 4, 6, 6, 3, 3, 6, 6, 6}, {6, 6, 6, 6, 6, 1, 5, 6, 6}}, rng);
  const LossAndGradients local = run_model(p.tokens, p.masks, p.documents, p.count, kSeq, world,
                                           SequenceLayoutKind::zigzag, true);
  expect_equal_sums(local, separately(p, split_communicator(*world, rank, 0)),
                    "local attention with documents at cp = " +
                        std::to_string(communicator_size(*world)));
}

// ---- the trainer ------------------------------------------------------------------------------

// A learnable stream (period 13) cut into documents of 3 to 40 tokens, the same on every rank.
void write_documents_dataset(const std::filesystem::path& path) {
  std::vector<std::int32_t> tokens(64 * 60 + 1);
  const std::int32_t pattern[13] = {5, 17, 3, 60, 22, 9, 41, 33, 8, 51, 12, 27, 45};
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = pattern[(i * 7 + i / 13) % 13];
  std::mt19937_64 rng = test::make_rng(4);
  std::vector<std::int64_t> starts = {0};
  while (true) {
    const std::int64_t next = starts.back() + 3 + static_cast<std::int64_t>(rng() % 38);
    if (next >= static_cast<std::int64_t>(tokens.size())) break;
    starts.push_back(next);
  }
  write_token_dataset(path, tokens, 64, "test", starts);
}

TrainConfig documents_config(const std::filesystem::path& data) {
  TrainConfig c;
  c.model = test::tiny_model();
  c.train.seq_len = 64;
  c.train.batch_size = 4;
  c.train.steps = 20;
  c.train.warmup_steps = 5;
  c.train.lr = 1e-2;
  c.train.min_lr = 1e-3;
  c.train.log_every = 100;
  c.train.eval_every = 0;
  c.data.source = DataSource::hdf5;
  c.data.train_path = data.string();
  return c;
}

void expect_close(const std::vector<double>& expected, const std::vector<double>& actual,
                  const std::string& what) {
  ASSERT_EQ(expected.size(), actual.size()) << what;
  double worst = 0.0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    worst = std::max(worst, std::abs(actual[i] - expected[i]) / std::abs(expected[i]));
    EXPECT_LT(std::abs(actual[i] - expected[i]), 1e-5 * std::abs(expected[i]))
        << what << ": step " << i + 1 << " loss " << actual[i] << " vs " << expected[i]
        << " at cp = 1";
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::printf("%s: largest relative loss difference %.3g\n", what.c_str(), worst);
}

TEST(TrainDocuments, SameLossesAtEveryCp) {
  SCOPED_TRACE(test::seed_trace());
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  test::TempDir dir;  // each rank its own copy of the same data
  write_documents_dataset(dir / "docs.h5");
  std::vector<std::vector<double>> references;
  for (const int window : {0, 24}) {
    TrainConfig config = documents_config(dir / "docs.h5");
    config.model.attention_window = window;
    const std::string what = "documents, window " + std::to_string(window);
    TrainConfig single = config;
    single.parallel.cp = 1;
    const std::vector<double> reference =
        test::losses_of(single, split_communicator(*world, rank, 0));
    ASSERT_EQ(reference.size(), 20u);
    EXPECT_LT(reference.back(), reference.front() - 0.5) << what << ": the loss did not fall";
    // zigzag, and the balanced layout, which lays every micro-batch out by its documents.
    for (const ShardLayout layout : {ShardLayout::zigzag, ShardLayout::balanced}) {
      TrainConfig ring = config;
      ring.parallel.cp = size;
      ring.parallel.layout = layout;
      expect_close(reference, test::losses_of(ring, world),
                   what + ", cp = " + std::to_string(size) + ", " +
                       std::string(layout_name(layout)));
    }
    references.push_back(reference);
  }
  // The window changes what the model sees (documents here are up to 40 tokens long): the loss
  // curves differ. (A step's batch may hold no document longer than the window: the first
  // losses alone were equal for some seeds.)
  EXPECT_NE(references[0], references[1]);
  // Documents off (data.documents false) train on other targets and attention: other losses.
  TrainConfig off = documents_config(dir / "docs.h5");
  off.parallel.cp = 1;
  TrainConfig on = off;
  off.data.documents = false;
  for (TrainConfig* c : {&off, &on}) {
    c->train.steps = 2;
    c->train.warmup_steps = 0;
  }
  const auto self = split_communicator(*world, rank, 0);
  EXPECT_NE(test::losses_of(off, self)[0], test::losses_of(on, self)[0]);
}

TEST(TrainDocuments, ResumeContinuesBitwise) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world), rank = communicator_rank(*world);
  std::unique_ptr<test::TempDir> dir;
  if (rank == 0) dir = std::make_unique<test::TempDir>();
  const std::string root = all_gather_text(*world, rank == 0 ? dir->path().string() : "")[0];
  if (rank == 0) write_documents_dataset(std::filesystem::path(root) / "docs.h5");
  world->barrier();
  TrainConfig config = documents_config(std::filesystem::path(root) / "docs.h5");
  config.parallel.cp = size;
  config.train.steps = 12;
  config.model.attention_window = 24;
  config.run.dir = root + "/run";
  test::expect_resume_bitwise(config, world, "documents and a window");
  world->barrier();  // every rank is done with the files before rank 0 removes them
}

// Recomputation runs each block's forward again, RoPE at the batch's document positions included:
// bitwise the same losses with documents and a window, the ring attention recomputed or not.
TEST(TrainDocuments, RecomputeGivesBitwiseTheSameLosses) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  test::TempDir dir;
  write_documents_dataset(dir / "docs.h5");
  TrainConfig config = documents_config(dir / "docs.h5");
  config.parallel.cp = communicator_size(*world);
  config.train.steps = 6;
  config.model.attention_window = 24;
  const std::vector<double> kept = test::losses_of(config, world);
  config.train.recompute = true;
  EXPECT_EQ(test::losses_of(config, world), kept) << "recomputed";
  config.train.recompute_attention = true;
  EXPECT_EQ(test::losses_of(config, world), kept) << "attention recomputed";
}

// A batch whose document lists do not fit its shape, or are not ordered, is refused naming them.
TEST(TrainDocuments, MalformedDocumentListsAreRefused) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  CpuModel<float> model(test::tiny_model(), 2, kSeq, world, SequenceLayoutKind::zigzag);
  model.init(kInitSeed);
  const auto n = static_cast<std::size_t>(model.local_tokens());
  const std::vector<std::int32_t> tokens(n, 1);
  const std::vector<float> mask(n, 1.0f);
  const std::vector<std::int64_t> three = {5, 9, 20};
  std::string message;
  try {
    model.forward({tokens, tokens, mask, three, 2});
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("documents has 3 starts; expected batch * document_count = 2 * 2"),
            std::string::npos)
      << message;
  const std::vector<std::int64_t> unordered = {9, 5, 20, 30};
  message.clear();
  try {
    model.forward({tokens, tokens, mask, unordered, 2});
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("documents[0, 1] is 5; expected non-decreasing positions >= 0"),
            std::string::npos)
      << message;
}

// data.documents true for a dataset without document_starts, and model.rope_document_positions
// true where the data has none, fail on every rank naming the key and the file.
TEST(TrainDocuments, DocumentsAskedOfADatasetWithoutThem) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world);
  test::TempDir dir;
  write_token_dataset(dir / "plain.h5", std::vector<std::int32_t>(200, 3), 64, "test");
  TrainConfig config = documents_config(dir / "plain.h5");
  config.parallel.cp = size;
  config.data.documents = true;
  std::string message;
  try {
    test::losses_of(config, world);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("data.documents is true but token dataset '"), std::string::npos)
      << message;
  EXPECT_NE(message.find("plain.h5' has no document_starts"), std::string::npos) << message;
  config.data.documents.reset();
  config.model.rope_document_positions = true;
  message.clear();
  try {
    test::losses_of(config, world);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("model.rope_document_positions is true but the sequences carry no "
                         "documents"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace ringattn::train
