// The run's memory plan (train/model_memory.hpp): the parameter part counts what parameter_list
// lists, the parts grow with the keys that size them, and check_run_memory refuses a config that
// no machine holds, naming the keys and values that make it so, before anything is allocated (the
// tiny configs of the tests pass). What Model actually allocates is held equal to model_memory()
// by tests/train/mpi_model_allocation.cpp (a Model needs a communicator).
//
// The memory account (memory_account) regroups the same bytes by component: its lines sum to
// model_memory() plus the ring's own workspace (plus the cuda backend's buffers), split exactly
// into bytes a token and fixed bytes; the ring's workspace is checked against a placement worked
// out by hand, and the longest seq_len that fits against the account and against every buffer of
// a small model written out here.
#include "train/model_memory.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

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

// ---------------------------------------------------------------------------------------------
// The memory account.

// A small run of `cp` ranks on a sequence of `seq_len` tokens (batch 2, contiguous so that any
// multiple of cp splits).
TrainConfig account_run(int cp, int seq_len) {
  TrainConfig config;
  config.model.n_layers = 3;
  config.train.batch_size = 2;
  config.train.seq_len = seq_len;
  config.train.loss_chunk_tokens = 96;
  config.parallel.cp = cp;
  config.parallel.layout = ShardLayout::contiguous;
  return config;
}

struct AccountCase {
  const char* name;
  TrainConfig config;
};

// Untiled and tiled feed-forward blocks, each recomputation mode, 1, 2 and 4 ranks, sharded
// moments, the zigzag layout, a window that shortens the ring, and V heads wider and narrower than
// the head dimension (model.v_head_dim).
std::vector<AccountCase> account_cases() {
  std::vector<AccountCase> cases;
  for (const int cp : {1, 2, 4}) {
    for (const int mode : {0, 1, 2}) {
      for (const int chunk : {0, 40}) {
        TrainConfig c = account_run(cp, 320);
        c.train.recompute = mode >= 1;
        c.train.recompute_attention = mode == 2;
        c.train.mlp_chunk_tokens = chunk;
        cases.push_back({"cp/mode/chunk", c});
      }
    }
  }
  TrainConfig sharded = account_run(4, 512);
  sharded.train.shard_optimizer = true;
  sharded.parallel.layout = ShardLayout::zigzag;
  sharded.train.mlp_chunk_tokens = 16;
  cases.push_back({"sharded zigzag", sharded});
  TrainConfig window = account_run(4, 512);
  window.model.attention_window = 8;  // one hop: steps 2, no step buffer
  window.train.mlp_chunk_tokens = 8;
  cases.push_back({"window", window});
  for (const int layers : {2, 3, 6}) {  // the offload: no input, one, four in host memory
    TrainConfig offload = account_run(2, 320);
    offload.model.n_layers = layers;
    offload.train.offload = Offload::on;
    offload.train.recompute = layers != 3;
    cases.push_back({"offload", offload});
  }
  TrainConfig offload_chunks = account_run(2, 320);  // no recompute, the feed-forward in chunks
  offload_chunks.model.n_layers = 5;
  offload_chunks.train.offload = Offload::on;
  offload_chunks.train.mlp_chunk_tokens = 40;
  cases.push_back({"offload in chunks", offload_chunks});
  TrainConfig wide_v = account_run(2, 320);  // d_qk 16, d_v 24
  wide_v.model.v_head_dim = 24;
  cases.push_back({"v_head_dim 24", wide_v});
  TrainConfig narrow_v = account_run(4, 512);  // d_v 8, the ring's workspace in the arena
  narrow_v.model.v_head_dim = 8;
  narrow_v.train.recompute = true;
  narrow_v.train.mlp_chunk_tokens = 16;
  cases.push_back({"v_head_dim 8 in chunks", narrow_v});
  TrainConfig offload_v = account_run(2, 320);
  offload_v.model.n_layers = 4;
  offload_v.model.v_head_dim = 12;
  offload_v.train.offload = Offload::on;
  cases.push_back({"offload, v_head_dim 12", offload_v});
  return cases;
}

// model_memory() and ring_workspace() for a config, from its keys as the test reads them.
double model_and_ring_bytes(const TrainConfig& c, ModelElementBytes e) {
  const ModelShape shape = model_shape(c.model);
  const double n = static_cast<double>(c.train.batch_size) * c.train.seq_len / c.parallel.cp;
  ModelOptions options;
  options.recompute = c.train.recompute;
  options.recompute_attention = c.train.recompute_attention;
  options.loss_chunk_tokens = c.train.loss_chunk_tokens;
  options.mlp_chunk_tokens = c.train.mlp_chunk_tokens;
  options.offload = c.train.offload == Offload::on;
  const double p = static_cast<double>(parameter_count(shape));
  double moments = p;
  const int ranks = c.parallel.dp * c.parallel.cp;
  if (c.train.shard_optimizer && ranks > 1) {  // Model::share_of's widest share
    const auto count = static_cast<std::int64_t>(p);
    std::int64_t widest = 0;
    for (int r = 0; r < ranks; ++r) {
      const std::int64_t first = count * r / ranks / 64 * 64;
      const std::int64_t end = r + 1 == ranks ? count : count * (r + 1) / ranks / 64 * 64;
      widest = std::max(widest, end - first);
    }
    moments = static_cast<double>(widest);
  }
  const std::int64_t chunk =
      mlp_chunk_tokens(c.train.mlp_chunk_tokens, c.train.recompute, static_cast<std::int64_t>(n));
  // Causal over contiguous or zigzag shards: every rank's K/V goes all the way round, unless the
  // window keeps each query within the shard before its own.
  const int steps = c.model.attention_window > 0 ? std::min(2, c.parallel.cp) : c.parallel.cp;
  const int ring_ranks = c.parallel.local_attention ? 1 : c.parallel.cp;
  return model_memory(shape, n, options, e, moments, ring_ranks).total() +
         ring_workspace(shape, n, static_cast<double>(chunk), c.parallel.cp, steps, e).bytes;
}

// What the offload keeps in host memory: max(0, n_layers - 2) blocks' inputs ([tokens a rank,
// d_model] activations); where every block keeps its attention output, their attention outputs
// ([tokens, heads x v_head_dim] activations) and LSEs ([heads, tokens] statistics); and without
// recompute their other activations: h1 and x_mid ([tokens, d_model]), qkv ([tokens, (heads +
// kv_heads) x head_dim + kv_heads x v_head_dim]), the two norms' inverses (statistics) and, where
// the feed-forward is not in chunks, h2 ([tokens, d_model]), gate|up ([tokens, 2 ffn_hidden]) and
// swiglu ([tokens, ffn_hidden]).
double offloaded_bytes(const TrainConfig& c, ModelElementBytes e) {
  if (c.train.offload != Offload::on) return 0.0;
  const double n = static_cast<double>(c.train.batch_size) * c.train.seq_len / c.parallel.cp;
  const double heads = c.model.n_heads, kv_heads = c.model.n_kv_heads;
  const double head_dim = c.model.resolved_head_dim();
  const double v_head_dim = c.model.v_head_dim.value_or(c.model.resolved_head_dim());
  const double d = c.model.d_model, f = c.model.ffn_hidden;
  const bool keeps_attention = !c.train.recompute || !c.train.recompute_attention;
  double other = 0.0;
  if (!c.train.recompute) {
    const double qkv = (heads + kv_heads) * head_dim + kv_heads * v_head_dim;
    other = (2.0 * d + qkv) * e.act + 2.0 * e.acc;
    if (c.train.mlp_chunk_tokens == 0) other += (d + 3.0 * f) * e.act;
  }
  return std::max(0, c.model.n_layers - 2) * n *
         (d * e.act + (keeps_attention ? heads * (v_head_dim * e.act + e.acc) : 0.0) + other);
}

// The lines sum to model_memory() plus the ring's own workspace (on the cuda backend plus its
// 32 MiB cuBLASLt workspace, 20 bytes a token of batch buffers and the RoPE tables: cos and sin,
// a row's position, the frequencies), and each line
// is its bytes a token times the tokens plus its fixed bytes.
TEST(MemoryAccount, LinesSumToTheModelAndTheRing) {
  for (const AccountCase& k : account_cases()) {
    const TrainConfig& c = k.config;
    SCOPED_TRACE(std::string(k.name) + ": cp " + std::to_string(c.parallel.cp) + ", recompute " +
                 std::to_string(c.train.recompute) + "/" +
                 std::to_string(c.train.recompute_attention) + ", mlp_chunk_tokens " +
                 std::to_string(c.train.mlp_chunk_tokens));
    // Beside the backend's memory, on the host: a step's batches (12 bytes a token) and the
    // checkpoint's copy of the parameters and both moments (12 bytes a parameter).
    const double beside =
        12.0 * c.train.grad_accum * c.train.batch_size * c.train.seq_len / c.parallel.cp +
        12.0 * static_cast<double>(parameter_count(model_shape(c.model)));
    const MemoryAccount cpu = memory_account(c, Backend::cpu);
    double sum = 0.0;
    for (const MemoryLine& line : cpu.lines) {
      EXPECT_EQ(line.bytes, line.bytes_per_token * cpu.local_tokens + line.fixed_bytes)
          << line.component;
      sum += line.host ? 0.0 : line.bytes;
    }
    // On the CPU the offloaded inputs are host memory like the rest of the model.
    EXPECT_EQ(sum, model_and_ring_bytes(c, kCpuModelElements) +
                       offloaded_bytes(c, kCpuModelElements));
    EXPECT_EQ(cpu.peak_bytes(), sum);
    EXPECT_EQ(cpu.host_bytes(), beside);

    const MemoryAccount cuda = memory_account(c, Backend::cuda);
    const double n = cuda.local_tokens;
    const double rope_rows = n / c.train.batch_size;  // retrieval: no documents, a row a position
    EXPECT_EQ(cuda.peak_bytes(), model_and_ring_bytes(c, kCudaModelElements) + 32.0 * (1 << 20) +
                                     20.0 * n + rope_rows * (16 * 4 + 8) + 8 * 8);
    EXPECT_EQ(cuda.host_bytes(), offloaded_bytes(c, kCudaModelElements) + beside);
  }
}

// train.offload auto turns the offload on exactly where the GPU cannot hold the run without it;
// with it on (no recompute), the GPU holds three blocks' inputs instead of n_layers + 1 and two
// blocks' attention outputs and other activations instead of n_layers, and a host that cannot
// hold the rest refuses the run naming them.
TEST(MemoryAccount, OffloadMovesTheBlocksInputsToTheHost) {
  TrainConfig c = account_run(1, 4096);
  c.model.n_layers = 6;
  c.train.offload = Offload::off;
  const double kept = memory_account(c, Backend::cuda).peak_bytes();
  c.train.offload = Offload::on;
  const MemoryAccount on = memory_account(c, Backend::cuda);
  // A block's input (batch 2, bf16), its attention output (bf16) and LSE (fp32), and its other
  // activations: h1, x_mid and h2 (bf16, d_model wide), qkv (bf16), the two norms' inverses
  // (fp32), gate|up and swiglu (bf16, 3 x ffn_hidden wide). Four blocks' go to the host.
  const double tokens = 2.0 * 4096, heads = c.model.n_heads, d = c.model.d_model;
  const double head_dim = c.model.resolved_head_dim();
  const double qkv = (heads + 2.0 * c.model.n_kv_heads) * head_dim;
  const double block = tokens * (d * 2.0 + heads * (head_dim * 2.0 + 4.0) + 3.0 * d * 2.0 +
                                 qkv * 2.0 + 2.0 * 4.0 + 3.0 * c.model.ffn_hidden * 2.0);
  EXPECT_EQ(kept - on.peak_bytes(), 4.0 * block);
  c.train.offload = Offload::off;
  EXPECT_EQ(on.host_bytes() - memory_account(c, Backend::cuda).host_bytes(), 4.0 * block);
  c.train.offload = Offload::on;
  c.train.offload = Offload::automatic;
  EXPECT_FALSE(resolve_offload(c, Backend::cuda, kept));
  EXPECT_TRUE(resolve_offload(c, Backend::cuda, kept - 1.0));
  EXPECT_FALSE(resolve_offload(c, Backend::cuda, 0.0)) << "unknown GPU memory: off";
  EXPECT_FALSE(resolve_offload(c, Backend::cpu, kept - 1.0)) << "the CPU backend: off";
  c.train.offload = Offload::off;
  EXPECT_FALSE(resolve_offload(c, Backend::cuda, 1.0));
  // More tokens than any host holds (2^40 a rank), with a GPU that holds them.
  c.train.offload = Offload::on;
  c.train.batch_size = 1 << 20;
  c.train.seq_len = 1 << 20;
  EXPECT_TRUE(throws_error_with(
      [&] { check_run_memory(c, Backend::cuda, 1e30); },
      {" of host memory, more than the ", "for the blocks' inputs (and kept activations) "
                                          "offloaded to host memory (train.offload on: "
                                          "model.n_layers 6 - 2 blocks' inputs of model.d_model ",
       ", attention outputs and other activations x "}));
}

// The components the issue names are all there, under names a person reads.
TEST(MemoryAccount, NamesEveryComponent) {
  TrainConfig c = account_run(2, 320);
  c.train.recompute = true;
  c.train.mlp_chunk_tokens = 40;
  const std::string text = memory_account_text(c, Backend::cuda);
  for (const char* component :
       {"parameters (master weights)", "gradients", "AdamW moments",
        "weights in the activation dtype", "kept block inputs", "kept attention outputs and LSE",
        "attention working set (one layer)", "feed-forward arena (40-token chunks)",
        "residual gradients, final norm", "logits chunk", "ring workspace (its own)",
        "cuBLASLt workspace", "KiB/token", "fixed MiB", "predicted peak ",
        " GiB for 320 tokens a rank (train.batch_size 2 x train.seq_len 320 / "
        "parallel.cp 2)"}) {
    EXPECT_NE(text.find(component), std::string::npos) << component << " in\n" << text;
  }
}

// Past the feed-forward chunk and the loss chunk, doubling the tokens adds exactly the tokens
// times the bytes a token, and the fixed bytes stay.
TEST(MemoryAccount, SplitsBytesATokenFromFixedBytes) {
  for (const AccountCase& k : account_cases()) {
    TrainConfig c = k.config;
    c.train.seq_len *= 2;  // 640 or 1024 tokens: at least 96 (the loss chunk) a rank
    const MemoryAccount one = memory_account(c, Backend::cpu);
    ASSERT_GE(one.local_tokens, 96.0);
    c.train.seq_len *= 2;
    const MemoryAccount two = memory_account(c, Backend::cpu);
    SCOPED_TRACE(std::string(k.name) + ": cp " + std::to_string(c.parallel.cp) +
                 ", mlp_chunk_tokens " + std::to_string(c.train.mlp_chunk_tokens));
    EXPECT_EQ(two.bytes_per_token(), one.bytes_per_token());
    EXPECT_EQ(two.fixed_bytes(), one.fixed_bytes());
    EXPECT_EQ(two.peak_bytes() - one.peak_bytes(), one.local_tokens * one.bytes_per_token());
    // The logits chunk is fixed from the loss chunk on.
    for (const MemoryLine& line : one.lines) {
      if (line.component == "logits chunk") {
        EXPECT_EQ(line.bytes_per_token, 0.0);
        EXPECT_EQ(line.fixed_bytes, 96.0 * 256 * 4);
      }
    }
  }
  // Below the loss chunk the logits are a token's vocabulary each.
  const MemoryAccount small = memory_account(account_run(2, 64), Backend::cpu);
  for (const MemoryLine& line : small.lines) {
    if (line.component == "logits chunk") {
      EXPECT_EQ(line.bytes_per_token, 256.0 * 4);
    }
  }
}

// Placement by hand: d_model 64, ffn_hidden 8, 4 query heads and 2 K/V heads of 16, bf16
// activations, 64 tokens a rank, the feed-forward block whole. The lent regions: dgu 64 x 16 x 2 =
// 2048, gate|up 2048, dact 64 x 8 x 2 = 1024, swiglu 1024, dh 64 x 64 x 2 = 8192 and h2 8192 bytes.
// Forward: the running output (64 x 64 x 4 = 16384) fits none: its own; K|V 0 (64 x 64 x 2 =
// 8192) fills dh, K|V 1 fills h2. Backward over 3 steps: dK|dV 0, 1 and the step buffer (16384
// each) fit none; K|V 0 and 1 fill dh and h2 again; delta (64 x 4 x 4 = 1024) takes the start of
// dgu. Own: 4 x 16384 = 65536 bytes, 1024 a token. Over 2 steps the step buffer goes; on one rank
// delta alone, which dgu holds; in chunks the arena holds the ring's whole workspace.
TEST(MemoryAccount, RingWorkspaceMirrorsThePlacement) {
  ModelShape shape;
  shape.vocab = 256;
  shape.d_model = 64;
  shape.layers = 2;
  shape.q_heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 16;
  shape.v_head_dim = 16;
  shape.ffn_hidden = 8;
  const RingWorkspace three = ring_workspace(shape, 64, 64, 3, 3, kCudaModelElements);
  EXPECT_EQ(three.bytes, 65536.0);
  EXPECT_EQ(three.bytes_per_token, 1024.0);
  EXPECT_EQ(ring_workspace(shape, 64, 64, 3, 2, kCudaModelElements).bytes, 65536.0 - 16384.0);
  EXPECT_EQ(ring_workspace(shape, 64, 64, 1, 1, kCudaModelElements).bytes, 0.0);
  EXPECT_EQ(ring_workspace(shape, 64, 8, 3, 3, kCudaModelElements).bytes, 0.0);
  // d_model 32: dh and h2 (4096 bytes) hold no K|V either, so both K|V buffers are the ring's
  // own too: 65536 + 2 x 8192.
  shape.d_model = 32;
  EXPECT_EQ(ring_workspace(shape, 64, 64, 3, 3, kCudaModelElements).bytes, 81920.0);
  // No layer, no attention.
  shape.layers = 0;
  EXPECT_EQ(ring_workspace(shape, 64, 64, 3, 3, kCudaModelElements).bytes, 0.0);
}

// The same by hand with V heads of 8 (d_model 64 again): K|V is 2 x (16 + 8) x 2 = 96 bytes a
// token (6144), dK|dV 192 (12288), the running output 4 x 8 x 4 = 128 (8192). Forward: the
// running output fills dh, K|V 0 takes h2, K|V 1 fits nowhere: its own. Backward over 3 steps:
// dK|dV 0, 1 and the step buffer fit none; K|V 0 and 1 take dh and h2; delta takes dgu. Own:
// 96 + 3 x 192 = 672 bytes a token; over 2 steps 192 fewer.
TEST(MemoryAccount, RingWorkspaceMirrorsThePlacementWithNarrowV) {
  ModelShape shape;
  shape.vocab = 256;
  shape.d_model = 64;
  shape.layers = 2;
  shape.q_heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 16;
  shape.v_head_dim = 8;
  shape.ffn_hidden = 8;
  const RingWorkspace three = ring_workspace(shape, 64, 64, 3, 3, kCudaModelElements);
  EXPECT_EQ(three.bytes_per_token, 672.0);
  EXPECT_EQ(three.bytes, 672.0 * 64);
  EXPECT_EQ(ring_workspace(shape, 64, 64, 3, 2, kCudaModelElements).bytes, 480.0 * 64);
}

// Every buffer of the small CPU model below on one rank (V heads of model.v_head_dim where given),
// its bytes written out from train/model_impl.hpp's constructor: 4 bytes an element (fp32
// everywhere). In chunks, the
// feed-forward arena holds a chunk's h2, gate|up, swiglu, dact and dgu, each from a 256-byte
// boundary, or the ring's workspace (delta: tokens x 4 heads x 4 bytes, rounded up to 256 bytes,
// and 256 more for its start) where that is more. Untiled, the lent dh (tokens x 64 x 4 bytes)
// always holds delta: no workspace of the ring's own.
double brute_force_bytes(const TrainConfig& c) {
  const std::int64_t n = std::int64_t{c.train.batch_size} * c.train.seq_len;  // one rank
  const std::int64_t d = 64, layers = 3, hq = 4, hkv = 2, hd = 16, f = 176, vocab = 256;
  const std::int64_t vhd = c.model.v_head_dim.value_or(hd);
  const std::int64_t row = (hq + hkv) * hd + hkv * vhd;
  const std::int64_t key = c.train.mlp_chunk_tokens;
  const std::int64_t chunk = std::min(n, key > 0 ? key : c.train.recompute ? 16384 : n);
  const bool tiled = chunk < n;
  const std::int64_t kept = c.train.recompute ? 1 : layers;
  const std::int64_t p = parameter_count(model_shape(c.model));
  std::vector<std::int64_t> elements = {p, p, p, p};  // weights, gradients, two moments
  for (std::int64_t l = 0; l <= layers; ++l) elements.push_back(n * d);  // x_in
  for (std::int64_t l = 0; l < layers; ++l) {                            // attn_o, attn_lse
    elements.push_back(n * hq * vhd);
    elements.push_back(n * hq);
  }
  for (std::int64_t l = 0; l < kept; ++l) {  // inv1, inv2, h1, qkv, x_mid (h2, gu, act)
    for (const std::int64_t e : {n, n, n * d, n * row, n * d}) elements.push_back(e);
    if (!tiled) {
      for (const std::int64_t e : {n * d, n * 2 * f, n * f}) elements.push_back(e);
    }
  }
  if (tiled) {
    const auto stretch = [](std::int64_t e) { return (e + 63) / 64 * 64; };  // 256 bytes
    const std::int64_t hidden =
        stretch(chunk * d) + 2 * stretch(chunk * 2 * f) + 2 * stretch(chunk * f);
    const std::int64_t delta_bytes = (n * hq * 4 + 255) / 256 * 256 + 256;
    elements.push_back(std::max(hidden, delta_bytes / 4));
  } else {
    elements.push_back(n * f);      // dact
    elements.push_back(n * 2 * f);  // dgu
  }
  const std::int64_t logits = std::min<std::int64_t>(n, c.train.loss_chunk_tokens) * vocab;
  for (const std::int64_t e : {n, n * d, logits, n * d, n * d, n * row, n * hq * vhd}) {
    elements.push_back(e);  // inv_f, hf, logits, dh, dx, dqkv, dout
  }
  double bytes = 0.0;
  for (const std::int64_t e : elements) bytes += 4.0 * static_cast<double>(e);
  return bytes;
}

// The longest seq_len that fits is a multiple of the layout's chunks, fits, and one more chunk
// does not: by the account, and for one small model by the buffers written out above.
TEST(MemoryAccount, LongestFittingSeqLenIsTheLast) {
  TrainConfig brute = account_run(1, 64);
  brute.parallel.layout = ShardLayout::zigzag;
  brute.train.recompute = true;
  brute.train.mlp_chunk_tokens = 64;
  EXPECT_EQ(memory_account(brute, Backend::cpu).peak_bytes(), brute_force_bytes(brute));
  for (const double mib : {8.0, 16.0, 40.0}) {  // tiled at the answer (2 x seq_len > 64)
    const std::int64_t longest = longest_fitting_seq_len(brute, Backend::cpu, 1, mib * 0x1p20);
    ASSERT_GT(longest, 32) << mib;
    ASSERT_EQ(longest % 2, 0) << mib;  // zigzag on one GPU: 2 chunks
    TrainConfig c = brute;
    c.train.seq_len = static_cast<int>(longest);
    EXPECT_LE(brute_force_bytes(c), mib * 0x1p20) << longest;
    EXPECT_EQ(memory_account(c, Backend::cpu).peak_bytes(), brute_force_bytes(c)) << longest;
    c.train.seq_len += 2;
    EXPECT_GT(brute_force_bytes(c), mib * 0x1p20) << longest;
  }
  TrainConfig untiled = brute;
  untiled.train.recompute = false;
  untiled.train.mlp_chunk_tokens = 0;
  const std::int64_t longest = longest_fitting_seq_len(untiled, Backend::cpu, 1, 8 * 0x1p20);
  untiled.train.seq_len = static_cast<int>(longest);
  EXPECT_EQ(memory_account(untiled, Backend::cpu).peak_bytes(), brute_force_bytes(untiled));
  EXPECT_LE(brute_force_bytes(untiled), 8 * 0x1p20);
  untiled.train.seq_len += 2;
  EXPECT_GT(brute_force_bytes(untiled), 8 * 0x1p20);
  for (const int v_head_dim : {8, 24, 33}) {  // V of its own width, tiled and not
    TrainConfig v = brute;
    v.model.v_head_dim = v_head_dim;
    v.train.seq_len = 256;
    EXPECT_EQ(memory_account(v, Backend::cpu).peak_bytes(), brute_force_bytes(v)) << v_head_dim;
    v.train.recompute = false;
    v.train.mlp_chunk_tokens = 0;
    EXPECT_EQ(memory_account(v, Backend::cpu).peak_bytes(), brute_force_bytes(v)) << v_head_dim;
  }

  for (const AccountCase& k : account_cases()) {
    for (const int gpus : {1, 2, 4, 8}) {
      for (const Backend backend : {Backend::cpu, Backend::cuda}) {
        const double bytes = 64 * 0x1p20;
        const std::int64_t seq = longest_fitting_seq_len(k.config, backend, gpus, bytes);
        TrainConfig c = k.config;
        c.parallel.cp = gpus;
        c.parallel.dp = 1;
        const std::int64_t step = c.parallel.layout == ShardLayout::zigzag ? 2 * gpus : gpus;
        SCOPED_TRACE(std::string(k.name) + ", " + std::to_string(gpus) + " GPUs: seq_len " +
                     std::to_string(seq));
        ASSERT_GT(seq, 0);
        EXPECT_EQ(seq % step, 0);
        // train.offload auto as the trainer resolves it on such a GPU.
        const auto peak = [&](int seq_len) {
          c.train.seq_len = seq_len;
          return memory_account(offload_resolved(c, resolve_offload(c, backend, bytes)), backend)
              .peak_bytes();
        };
        EXPECT_LE(peak(static_cast<int>(seq)), bytes);
        EXPECT_GT(peak(static_cast<int>(seq + step)), bytes);
      }
    }
  }
  // Nothing fits less than the parameters.
  EXPECT_EQ(longest_fitting_seq_len(brute, Backend::cpu, 1, 1024.0), 0);
}

// A host limit a GPU bounds the longest fit too: the offload's pinned inputs, the batches and
// the checkpoint copy fit it, and the next length does not fit the GPU and the host together.
TEST(MemoryAccount, LongestFitHoldsTheHostLimit) {
  TrainConfig c = account_run(1, 320);
  c.model.n_layers = 6;
  c.train.recompute = true;
  const double gpu = 64 * 0x1p20, unlimited = 0.0;
  const std::int64_t free_host = longest_fitting_seq_len(c, Backend::cuda, 1, gpu, unlimited);
  TrainConfig fitted = c;
  fitted.train.seq_len = static_cast<int>(free_host);
  ASSERT_TRUE(resolve_offload(fitted, Backend::cuda, gpu)) << "the case needs the offload";
  // Halfway between the host memory of the shortest run (its fixed part: the checkpoint copy)
  // and that of the longest without a host limit.
  TrainConfig shortest = c;
  shortest.train.seq_len = 2;
  const double host =
      0.5 * (memory_account(offload_resolved(fitted, true), Backend::cuda).host_bytes() +
             memory_account(offload_resolved(shortest, true), Backend::cuda).host_bytes());
  const std::int64_t limited = longest_fitting_seq_len(c, Backend::cuda, 1, gpu, host);
  ASSERT_GT(limited, 0);
  EXPECT_LT(limited, free_host);
  const auto account = [&](std::int64_t seq) {
    TrainConfig t = c;
    t.train.seq_len = static_cast<int>(seq);
    return memory_account(offload_resolved(t, resolve_offload(t, Backend::cuda, gpu)),
                          Backend::cuda);
  };
  EXPECT_LE(account(limited).peak_bytes(), gpu);
  EXPECT_LE(account(limited).host_bytes(), host);
  const MemoryAccount next = account(limited + 2);
  EXPECT_TRUE(next.peak_bytes() > gpu || next.host_bytes() > host);
}

// check_run_memory holds a GPU to the account's peak, the ring's own workspace included, and
// names it where it counts.
TEST(MemoryAccount, RunCheckCountsTheRing) {
  TrainConfig c = account_run(4, 1 << 16);
  c.model.ffn_hidden = 8;  // the feed-forward buffers lent to the ring hold little of it
  const double peak = memory_account(c, Backend::cuda).peak_bytes();
  EXPECT_NO_THROW(check_run_memory(c, Backend::cuda, peak));
  EXPECT_TRUE(throws_error_with(
      [&] { check_run_memory(c, Backend::cuda, peak - 1.0); },
      {" GiB of device memory, more than the ", "for the ring attention's own workspace ("}));
}

}  // namespace
}  // namespace ringattn::train
