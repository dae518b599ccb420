#include "train/model_memory.hpp"

#include <sys/resource.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <utility>
#include <vector>

#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/error.hpp"
#include "train/model.hpp"

namespace ringattn::train {
namespace {

// parameter_list's elements summed from the dimensions alone: the count of a shape whose list is
// too long to build (2^31 layers) or whose count passes int64 (d_model 2^30). Exact below 2^53.
double parameter_count_of(const ModelShape& s) {
  const double d = static_cast<double>(s.d_model);
  const double qkv_rows = static_cast<double>(s.q_heads + s.kv_heads) * s.head_dim +
                          static_cast<double>(s.kv_heads) * s.v_head_dim;
  const double per_layer = 2.0 * d + qkv_rows * d +
                           d * static_cast<double>(s.q_heads) * s.v_head_dim +
                           3.0 * static_cast<double>(s.ffn_hidden) * d;
  return static_cast<double>(s.vocab) * d * (s.tied_embeddings ? 1.0 : 2.0) + d +
         static_cast<double>(s.layers) * per_layer;
}

// The feed-forward chunk of `local_tokens` (a whole count held in a double), as Model resolves
// options.mlp_chunk_tokens (mlp_chunk_tokens() in train/config.hpp).
double resolved_mlp_chunk(const ModelOptions& options, double local_tokens) {
  const auto tokens = static_cast<std::int64_t>(std::clamp(local_tokens, 0.0, 0x1p62));
  return static_cast<double>(mlp_chunk_tokens(options.mlp_chunk_tokens, options.recompute, tokens));
}

// The AdamW moments a rank holds: every parameter's, or under train.shard_optimizer the widest
// share of Model::share_of (equal parts, their starts on 64-element boundaries) over dp x cp ranks.
double moment_parameters_of(const TrainConfig& config, double parameters) {
  const std::int64_t ranks = std::int64_t{config.parallel.dp} * config.parallel.cp;
  if (!config.train.shard_optimizer || ranks <= 1) return parameters;
  if (parameters * static_cast<double>(ranks) >= 0x1p62) return parameters / ranks + 64.0;
  const auto count = static_cast<std::int64_t>(parameters);
  const auto start = [&](std::int64_t r) {
    return r == ranks ? count : count * r / ranks / 64 * 64;
  };
  std::int64_t widest = 0;
  for (std::int64_t r = 0; r < ranks; ++r) widest = std::max(widest, start(r + 1) - start(r));
  return static_cast<double>(widest);
}

// The ring of a config's attention: its ranks (one under parallel.local_attention) and the steps
// its calls run at most, from the layout and the causal mask with model.attention_window (packed
// documents only ever shorten a call's ring).
std::pair<int, int> ring_of(const TrainConfig& config) {
  const int ranks = config.parallel.local_attention ? 1 : config.parallel.cp;
  const TrainingConfig& t = config.train;
  if (ranks < 2) return {1, 1};
  if (t.seq_len < 1 || t.seq_len % chunk_count(ranks, config.parallel.layout) != 0) {
    return {ranks, ranks};  // no layout to plan on: every step
  }
  Mask mask;
  mask.causal = true;
  mask.window_left = config.model.attention_window;
  // The balanced layout follows each batch's documents: any step count.
  if (config.parallel.layout == ShardLayout::balanced) return {ranks, ranks};
  const SequenceLayout layout(config.parallel.layout == ShardLayout::zigzag
                                  ? SequenceLayoutKind::zigzag
                                  : SequenceLayoutKind::contiguous,
                              ranks, 0, t.seq_len);
  return {ranks, ring_steps(layout, RingMask{mask, std::max(1, t.batch_size)})};
}

// The cuBLASLt workspace of the cuda backend's one Gemm: RINGATTN_GEMM_WORKSPACE_MIB as
// train/cuda/gemm.cpp reads it (which refuses a value outside [0, 1024]), else 32 MiB.
double gemm_workspace_bytes_of_environment() {
  constexpr double kDefaultBytes = 32.0 * 0x1p20;
  const char* mib = std::getenv("RINGATTN_GEMM_WORKSPACE_MIB");
  if (mib == nullptr || *mib == '\0') return kDefaultBytes;
  char* end = nullptr;
  const long value = std::strtol(mib, &end, 10);
  return *end == '\0' && value >= 0 && value <= 1024 ? static_cast<double>(value) * 0x1p20
                                                     : kDefaultBytes;
}

// The cuda backend's buffers beside the model's: the batch's token ids, targets, loss mask,
// losses and predictions (4 bytes a token each), and the RoPE tables (cos and sin, fp32, head_dim
// / 2 each a row, and the row's position, int64: a row a token where RoPE restarts at packed
// documents, else a row a position) with their frequencies (head_dim / 2 doubles).
struct BackendBuffers {
  double bytes_per_token = 0.0, fixed_bytes = 0.0, bytes = 0.0;
};
BackendBuffers cuda_backend_buffers(const TrainConfig& config, double local_tokens) {
  const double head_dim = config.model.resolved_head_dim();
  const bool documents =
      config.data.documents.value_or(config.data.source != DataSource::retrieval) &&
      config.model.rope_document_positions.value_or(true);
  const double rows_per_token = documents ? 1.0 : 1.0 / std::max(1, config.train.batch_size);
  BackendBuffers b;
  const double row_bytes = head_dim * 4.0 + 8.0;
  b.bytes_per_token = 20.0 + rows_per_token * row_bytes;
  b.fixed_bytes = gemm_workspace_bytes_of_environment() + head_dim / 2.0 * 8.0;
  const double rows =
      documents ? local_tokens : local_tokens / std::max(1, config.train.batch_size);
  b.bytes = 20.0 * local_tokens + rows * row_bytes + b.fixed_bytes;
  return b;
}

// What the backend's side holds of `layers` blocks, as Model's constructor allocates it: whether
// every block keeps its attention output and LSE (no recomputation of the attention), the blocks'
// inputs held there (with the offload three: two blocks' and the final norm's; the others but the
// last two blocks' in host memory), the attention pairs (one when the attention is recomputed;
// with the offload two) and the blocks' other activations (one block's when recomputing; with
// the offload two, the others but the last two blocks' in host memory).
struct KeptBlocks {
  bool keeps_attention;
  double inputs, attention, other;
};
KeptBlocks kept_blocks_of(const ModelOptions& options, double layers) {
  const double one_or_none = std::min(1.0, layers);
  const bool keeps_attention = !options.recompute || !options.recompute_attention;
  return {keeps_attention, options.offload ? std::min(3.0, layers + 1.0) : layers + 1.0,
          !keeps_attention ? one_or_none : options.offload ? std::min(2.0, layers) : layers,
          options.recompute ? one_or_none : options.offload ? std::min(2.0, layers) : layers};
}

ModelOptions model_options_of(const TrainingConfig& t) {
  ModelOptions options;
  options.recompute = t.recompute;
  options.recompute_attention = t.recompute_attention;
  options.loss_chunk_tokens = t.loss_chunk_tokens;
  options.mlp_chunk_tokens = t.mlp_chunk_tokens;
  options.offload = t.offload == Offload::on;  // automatic: resolve_offload first
  return options;
}

double local_tokens_of(const TrainConfig& config) {
  return static_cast<double>(config.train.batch_size) * config.train.seq_len /
         std::max(1, config.parallel.cp);
}

// Model's feed-forward arena of chunks of `chunk` tokens over `local_tokens` on a ring of
// `ring_ranks` (mlp_arena_elements in train/model.hpp), in elements of the activation dtype.
double arena_elements(const ModelShape& s, double local_tokens, double chunk, int ring_ranks,
                      ModelElementBytes element_bytes) {
  const DType act_dtype = element_bytes.act == 2   ? DType::bf16
                          : element_bytes.act == 8 ? DType::f64
                                                   : DType::f32;
  return mlp_arena_elements(s, 1.0, local_tokens, chunk, std::max(1, ring_ranks), act_dtype);
}

// A count as an integer where it is one a person reads, else in scientific notation.
std::string count_text(double count) {
  char text[32];
  std::snprintf(text, sizeof text, count < 1e15 ? "%.0f" : "%.4g", count);
  return text;
}

// One part of a rank's memory, for check_run_memory's message.
struct Need {
  double bytes = 0.0;
  std::string what;  // "the logits of a loss chunk (...)"
};

// "a rank needs N GiB of MEMORY, more than the M GiB LIMIT: A GiB for PART (...); ..." when the
// parts pass `limit`: the parts from the largest, down to those under 1% of the whole.
void check_needs(std::vector<Need> needs, double limit, const std::string& limit_what,
                 const char* memory, const std::string& stage) {
  double total = 0.0;
  for (const Need& n : needs) total += n.bytes;
  if (limit <= 0.0 || total <= limit) return;
  std::stable_sort(needs.begin(), needs.end(),
                   [](const Need& a, const Need& b) { return a.bytes > b.bytes; });
  std::string parts;
  for (const Need& n : needs) {
    if (!parts.empty() && n.bytes < 0.01 * total) break;
    parts += (parts.empty() ? "" : "; ") + gib_text(n.bytes) + " for " + n.what;
  }
  ringattn::detail::fail("Trainer", "a rank needs ", gib_text(total), " of ", memory, stage,
                         ", more than the ", gib_text(limit), " ", limit_what, ": ", parts);
}

}  // namespace

const char* model_part_name(ModelPart part) {
  switch (part) {
    case ModelPart::parameters:
      return "the parameters, gradients and AdamW moments";
    case ModelPart::activations:
      return "the activations of a micro-batch";
    case ModelPart::logits:
      return "the logits of a loss chunk";
    case ModelPart::offloaded:
      return "the blocks' inputs (and kept activations) offloaded to host memory";
  }
  return "?";
}

const char* model_part_keys(ModelPart part) {
  switch (part) {
    case ModelPart::parameters:
      return "model.vocab_size, model.d_model, model.n_layers, model.n_heads, model.n_kv_heads, "
             "model.head_dim, model.v_head_dim, model.ffn_hidden, model.tied_embeddings";
    case ModelPart::activations:
      return "train.batch_size, train.seq_len / parallel.cp, model.n_layers, model.d_model, "
             "model.n_heads, model.n_kv_heads, model.head_dim, model.v_head_dim, "
             "model.ffn_hidden, train.recompute";
    case ModelPart::logits:
      return "train.loss_chunk_tokens, model.vocab_size";
    case ModelPart::offloaded:
      return "train.offload, train.batch_size, train.seq_len / parallel.cp, model.n_layers, "
             "model.d_model, model.n_heads, model.head_dim, model.v_head_dim, model.ffn_hidden, "
             "train.recompute, "
             "train.recompute_attention";
  }
  return "?";
}

ModelMemory model_memory(const ModelShape& s, double local_tokens, const ModelOptions& options,
                         ModelElementBytes element_bytes, double moment_parameters,
                         int ring_ranks) {
  const double n = local_tokens, d = static_cast<double>(s.d_model);
  const double layers = static_cast<double>(s.layers), f = static_cast<double>(s.ffn_hidden);
  const double heads_width = static_cast<double>(s.q_heads) * s.v_head_dim;  // attention output
  const double qkv_width = static_cast<double>(s.q_heads + s.kv_heads) * s.head_dim +
                           static_cast<double>(s.kv_heads) * s.v_head_dim;
  const double act = element_bytes.act, acc = element_bytes.acc, master = element_bytes.master;
  const double parameters = parameter_count_of(s);
  ModelMemory m;
  // Weights and gradients, the two moments, and the GEMMs' copy where Act is not Master.
  m[ModelPart::parameters] = 2.0 * parameters * master + 2.0 * moment_parameters * master +
                             (act != master ? parameters * act : 0.0);
  // As Model's constructor allocates them: every block's input (and the final norm's), each
  // block's attention output and LSE (one pair when recomputation runs the attention again), each
  // block's other activations (one block's when recomputing: h1, qkv, x_mid, two norms'
  // inverses), the final norm's, the backward's temporaries, and the feed-forward block's hidden
  // activations and their gradients: each kept block's h2, gate|up and swiglu with one dact and
  // dgu, or where the block runs in chunks the one arena of a chunk's (mlp_arena_elements).
  const auto [keeps_attention, device_inputs, attention_blocks, kept_blocks] =
      kept_blocks_of(options, layers);
  const double chunk = resolved_mlp_chunk(options, n);
  const double act_elements =
      n * (device_inputs * d + attention_blocks * heads_width +
           kept_blocks * (2.0 * d + qkv_width) + 3.0 * d + qkv_width + heads_width) +
      (chunk < n ? (layers >= 1.0 ? arena_elements(s, n, chunk, ring_ranks, element_bytes) : 0.0)
                 : n * (kept_blocks * (d + 3.0 * f) + 3.0 * f));
  const double acc_elements = n * (attention_blocks * static_cast<double>(s.q_heads) +
                                   2.0 * kept_blocks + 1.0 + (act != acc ? qkv_width : 0.0));
  m[ModelPart::activations] = act_elements * act + acc_elements * acc;
  m[ModelPart::logits] = std::min(n, static_cast<double>(options.loss_chunk_tokens)) *
                         static_cast<double>(s.vocab) * act;
  const double attention_pair = heads_width * act + static_cast<double>(s.q_heads) * acc;
  // Without recompute, each offloaded block's other activations as the device holds them.
  const double other = options.recompute ? 0.0
                                         : (2.0 * d + qkv_width) * act + 2.0 * acc +
                                               (chunk < n ? 0.0 : (d + 3.0 * f) * act);
  m[ModelPart::offloaded] =
      options.offload ? std::max(0.0, layers - 2.0) * n *
                            (d * act + (keeps_attention ? attention_pair : 0.0) + other)
                      : 0.0;
  return m;
}

void ModelAllocator::fail(std::int64_t count, std::size_t element_bytes, Memory memory,
                          ModelPart part, const std::string& cause) {
  const double bytes = static_cast<double>(count) * static_cast<double>(element_bytes);
  ringattn::detail::fail_as(ErrorKind::library, "Model", "cannot allocate ", gib_text(bytes),
                            " of ", memory == Memory::host ? "host" : "device", " memory (", count,
                            " x ", element_bytes, " bytes) for ", model_part_name(part),
                            ", whose size is set by ", model_part_keys(part), ": ", cause);
}

std::string gib_text(double bytes) {
  char text[48];
  std::snprintf(text, sizeof text, "%.4g GiB", bytes / 0x1p30);
  return text;
}

MemoryLimit host_memory_limit() {
  MemoryLimit limit;
  const auto consider = [&](double bytes, const char* what) {
    if (bytes > 0.0 && (limit.bytes == 0.0 || bytes < limit.bytes)) limit = {bytes, what};
  };
  struct sysinfo info {};
  if (sysinfo(&info) == 0) {
    consider(
        (static_cast<double>(info.totalram) + static_cast<double>(info.totalswap)) * info.mem_unit,
        "this machine has (RAM and swap)");
  }
  const std::pair<int, const char*> limits[] = {
      {RLIMIT_AS, "this process may map (its address-space limit, ulimit -v)"},
      {RLIMIT_DATA, "this process may allocate (its data limit, ulimit -d)"}};
  for (const auto& [resource, what] : limits) {
    rlimit value{};
    if (getrlimit(resource, &value) == 0 && value.rlim_cur != RLIM_INFINITY) {
      consider(static_cast<double>(value.rlim_cur), what);
    }
  }
  // cgroup v2, as a container sees its own: "max" or a number of bytes.
  std::ifstream cgroup("/sys/fs/cgroup/memory.max");
  double cgroup_bytes = 0.0;
  if (cgroup >> cgroup_bytes) consider(cgroup_bytes, "its cgroup may use (memory.max)");
  return limit;
}

void check_run_memory(const TrainConfig& config, Backend backend, double device_bytes) {
  const bool cuda = backend == Backend::cuda;
  const ModelShape shape = model_shape(config.model);
  const ModelConfig& mc = config.model;
  const double parameters = parameter_count_of(shape);
  const double moments = moment_parameters_of(config, parameters);
  const std::string model_values =
      "model.vocab_size " + std::to_string(mc.vocab_size) + ", model.d_model " +
      std::to_string(mc.d_model) + ", model.n_layers " + std::to_string(mc.n_layers) +
      ", model.n_heads " + std::to_string(mc.n_heads) + ", model.n_kv_heads " +
      std::to_string(mc.n_kv_heads) + (mc.head_dim ? ", model.head_dim " : ", head_dim ") +
      std::to_string(mc.resolved_head_dim()) +
      (mc.v_head_dim ? ", model.v_head_dim " + std::to_string(*mc.v_head_dim) : std::string()) +
      ", model.ffn_hidden " + std::to_string(mc.ffn_hidden);
  const MemoryLimit host = host_memory_limit();
  const std::vector<StageConfig> stages = run_stages(config.train);
  for (int i = 0; i < static_cast<int>(stages.size()); ++i) {
    const TrainConfig c = stage_config(config, i);
    const TrainingConfig& t = c.train;
    const ModelOptions options = model_options_of(t);
    const double tokens = local_tokens_of(c);
    const std::string tokens_text = count_text(tokens) + " tokens a rank: train.batch_size " +
                                    std::to_string(t.batch_size) + " x train.seq_len " +
                                    std::to_string(t.seq_len) + " / parallel.cp " +
                                    std::to_string(config.parallel.cp);
    const auto [ring_ranks, ring_steps] = ring_of(c);
    const ModelMemory m = model_memory(
        shape, tokens, options, cuda ? kCudaModelElements : kCpuModelElements, moments, ring_ranks);
    std::vector<Need> model = {
        {m[ModelPart::parameters], std::string(model_part_name(ModelPart::parameters)) + " (" +
                                       count_text(parameters) + " parameters of " + model_values +
                                       ")"},
        {m[ModelPart::activations],
         std::string(model_part_name(ModelPart::activations)) + " (" + tokens_text +
             ", through model.n_layers " + std::to_string(mc.n_layers) + " of model.d_model " +
             std::to_string(mc.d_model) + " and model.ffn_hidden " + std::to_string(mc.ffn_hidden) +
             (t.recompute ? ", train.recompute true" : "") +
             (t.mlp_chunk_tokens > 0
                  ? ", train.mlp_chunk_tokens " + std::to_string(t.mlp_chunk_tokens)
                  : std::string()) +
             ")"},
        {m[ModelPart::logits], std::string(model_part_name(ModelPart::logits)) +
                                   " (the fewer of train.loss_chunk_tokens " +
                                   std::to_string(t.loss_chunk_tokens) + " and " +
                                   count_text(tokens) + " tokens a rank, x model.vocab_size " +
                                   std::to_string(mc.vocab_size) + ")"}};
    const RingWorkspace ring =
        ring_workspace(shape, tokens, resolved_mlp_chunk(options, tokens), ring_ranks, ring_steps,
                       cuda ? kCudaModelElements : kCpuModelElements);
    if (ring.bytes > 0.0) {
      model.push_back({ring.bytes, "the ring attention's own workspace (" +
                                       count_text(ring.bytes_per_token) + " bytes a token x " +
                                       tokens_text + ", over parallel.cp " +
                                       std::to_string(config.parallel.cp) + ")"});
    }
    if (cuda) {
      model.push_back({cuda_backend_buffers(c, tokens).bytes,
                       "the cuda backend's cuBLASLt workspace (RINGATTN_GEMM_WORKSPACE_MIB), "
                       "batch and RoPE tables"});
    }
    // The step's micro-batches: an int32 token id, an int32 target and a float mask a token.
    std::vector<Need> host_needs = {
        {m[ModelPart::offloaded],
         std::string(model_part_name(ModelPart::offloaded)) +
             " (train.offload on: model.n_layers " + std::to_string(mc.n_layers) +
             " - 2 blocks' inputs of model.d_model " + std::to_string(mc.d_model) +
             (!options.recompute                ? ", attention outputs and other activations"
              : !options.recompute_attention ? " and attention outputs"
                                             : "") +
             " x " + tokens_text + ")"},
        {static_cast<double>(t.grad_accum) * tokens * 12.0,
         "the micro-batches of a step (train.grad_accum " + std::to_string(t.grad_accum) + " x " +
             tokens_text + ", x 12 bytes)"},
        {3.0 * parameters * 4.0,
         "the host copy of the parameters and moments a checkpoint writes (" +
             count_text(parameters) + " parameters x 3 x 4 bytes)"}};
    const std::string stage = stages.size() > 1
                                  ? " in train.stages[" + std::to_string(i) + "] (seq_len " +
                                        std::to_string(t.seq_len) + ", batch_size " +
                                        std::to_string(t.batch_size) + ")"
                                  : std::string();
    if (cuda) {
      check_needs(model, device_bytes, "its GPU has", "device memory", stage);
    } else {
      host_needs.insert(host_needs.end(), model.begin(), model.end());
    }
    check_needs(host_needs, host.bytes, host.what, "host memory", stage);
  }
}

RingWorkspace ring_workspace(const ModelShape& s, double local_tokens, double mlp_chunk_tokens,
                             int ring_ranks, int ring_steps, ModelElementBytes element_bytes) {
  if (s.layers < 1 || local_tokens <= 0.0) return {};
  const double n = local_tokens, c = mlp_chunk_tokens;
  const double act = element_bytes.act, acc = element_bytes.acc;
  const double d = static_cast<double>(s.d_model), f = static_cast<double>(s.ffn_hidden);
  const double q_heads = static_cast<double>(s.q_heads);
  const double kv_width =
      static_cast<double>(s.kv_heads) * (static_cast<double>(s.head_dim) + s.v_head_dim);  // K|V
  // Model::ring_forward_args' scratch: in chunks the feed-forward arena alone; else, in its
  // order, dgu_, gate|up, dact_, swiglu, dh_ and h2.
  const std::vector<double> lent =
      c < n ? std::vector<double>{arena_elements(s, n, c, ring_ranks, element_bytes) * act}
            : std::vector<double>{n * 2.0 * f * act, n * 2.0 * f * act, n * f * act,
                                  n * f * act,       n * d * act,       n * d * act};
  enum Name { kv0, kv1, running_o, dkv0, dkv1, dkv_step, delta, kNames };
  std::array<double, kNames> own{};
  // One call: Placement's first fit, the buffers in the order the call takes them, each region's
  // start 256-byte aligned (cudaMalloc's; a CPU vector may start short of that by up to 240
  // bytes, so the CPU ring may keep a buffer that fits here with less than that to spare).
  const auto call = [&](std::initializer_list<std::pair<Name, double>> buffers) {
    constexpr double kAlignment = 256.0;
    std::vector<double> used(lent.size(), 0.0);
    for (const auto& [name, per_token] : buffers) {
      const double bytes = per_token * n;
      bool placed = false;
      for (std::size_t i = 0; i < lent.size() && !placed; ++i) {
        const double skip = std::fmod(kAlignment - std::fmod(used[i], kAlignment), kAlignment);
        const double left = lent[i] - used[i];
        if (left < skip || left - skip < bytes) continue;
        used[i] += skip + bytes;
        placed = true;
      }
      if (!placed) own[name] = std::max(own[name], per_token);
    }
  };
  if (ring_ranks > 1) {
    call({{running_o, q_heads * s.v_head_dim * acc}, {kv0, kv_width * act}, {kv1, kv_width * act}});
    if (ring_steps > 2) {
      call({{dkv0, kv_width * acc},
            {dkv1, kv_width * acc},
            {dkv_step, kv_width * acc},
            {kv0, kv_width * act},
            {kv1, kv_width * act},
            {delta, q_heads * acc}});
    } else if (ring_steps == 2) {
      call({{dkv0, kv_width * acc},
            {dkv1, kv_width * acc},
            {kv0, kv_width * act},
            {kv1, kv_width * act},
            {delta, q_heads * acc}});
    } else {
      call({{delta, q_heads * acc}});
    }
  } else {
    call({{delta, q_heads * acc}});
  }
  RingWorkspace w;
  for (const double per_token : own) w.bytes_per_token += per_token;
  w.bytes = w.bytes_per_token * n;
  return w;
}

double MemoryAccount::sum(double MemoryLine::*field, bool host) const {
  double total = 0.0;
  for (const MemoryLine& line : lines) total += line.host == host ? line.*field : 0.0;
  return total;
}

double MemoryAccount::peak_bytes() const { return sum(&MemoryLine::bytes, false); }
double MemoryAccount::host_bytes() const { return sum(&MemoryLine::bytes, true); }
double MemoryAccount::bytes_per_token() const { return sum(&MemoryLine::bytes_per_token, false); }
double MemoryAccount::fixed_bytes() const { return sum(&MemoryLine::fixed_bytes, false); }

MemoryAccount memory_account(const TrainConfig& config, Backend backend) {
  const bool cuda = backend != Backend::cpu;
  const ModelElementBytes e = cuda ? kCudaModelElements : kCpuModelElements;
  const double act = e.act, acc = e.acc, master = e.master;
  const ModelShape s = model_shape(config.model);
  const TrainingConfig& t = config.train;
  const ModelOptions options = model_options_of(t);
  const double n = local_tokens_of(config);
  const double d = static_cast<double>(s.d_model), f = static_cast<double>(s.ffn_hidden);
  const double layers = static_cast<double>(s.layers), q_heads = static_cast<double>(s.q_heads);
  const double heads_width = q_heads * s.v_head_dim;
  const double qkv_width = static_cast<double>(s.q_heads + s.kv_heads) * s.head_dim +
                           static_cast<double>(s.kv_heads) * s.v_head_dim;
  const double parameters = parameter_count_of(s);
  const auto [keeps_attention, device_inputs, attention_blocks, kept_blocks] =
      kept_blocks_of(options, layers);
  const double chunk = resolved_mlp_chunk(options, n);
  const bool tiled = chunk < n;
  const auto blocks_text = [](double blocks) {
    return blocks == 1.0 ? std::string("one layer") : count_text(blocks) + " layers";
  };

  MemoryAccount a;
  a.backend = cuda ? Backend::cuda : Backend::cpu;
  a.local_tokens = n;
  const auto add = [&](std::string component, double per_token, double fixed, std::string keys) {
    a.lines.push_back(
        {std::move(component), per_token, fixed, per_token * n + fixed, std::move(keys)});
  };
  const std::string shape_keys = "model.* (the parameter count)";
  add("parameters (master weights)", 0.0, parameters * master, shape_keys);
  add("gradients", 0.0, parameters * master, shape_keys);
  const double moments = moment_parameters_of(config, parameters);
  add(moments < parameters ? "AdamW moments (this rank's share)" : "AdamW moments", 0.0,
      2.0 * moments * master, shape_keys + ", train.shard_optimizer, parallel.dp x parallel.cp");
  if (act != master) add("weights in the activation dtype", 0.0, parameters * act, shape_keys);
  if (options.offload) {
    // Two blocks' inputs and the final norm's on the device; the rest in the host's copies.
    add("kept block inputs (3 on the GPU: offload)", device_inputs * d * act, 0.0,
        "model.d_model, train.offload");
    add("kept block inputs offloaded (pinned host)", std::max(0.0, layers - 2.0) * d * act, 0.0,
        "model.n_layers, model.d_model, train.offload");
    a.lines.back().host = backend != Backend::cpu;
  } else {
    add("kept block inputs", device_inputs * d * act, 0.0, "model.n_layers, model.d_model");
  }
  add("kept attention outputs and LSE (" + blocks_text(attention_blocks) + ")",
      attention_blocks * (heads_width * act + q_heads * acc), 0.0,
      "model.n_layers, model.n_heads, model.head_dim, model.v_head_dim, "
      "train.recompute_attention");
  if (options.offload && keeps_attention) {
    add("kept attention outputs offloaded (host)",
        std::max(0.0, layers - 2.0) * (heads_width * act + q_heads * acc), 0.0,
        "model.n_layers, model.n_heads, model.head_dim, model.v_head_dim, "
        "train.offload");
    a.lines.back().host = backend != Backend::cpu;
  }
  add("attention working set (" + blocks_text(kept_blocks) + ")",
      kept_blocks * ((2.0 * d + qkv_width) * act + 2.0 * acc) + (qkv_width + heads_width) * act +
          (act != acc ? qkv_width * acc : 0.0),
      0.0,
      "model.d_model, model.n_heads, model.n_kv_heads, model.head_dim, model.v_head_dim, "
      "train.recompute");
  if (options.offload && !options.recompute) {
    // Every block's other activations but the last two blocks': h1, qkv, x_mid, the norms'
    // inverses, and untiled the feed-forward's hidden activations.
    add("kept block activations offloaded (host)",
        std::max(0.0, layers - 2.0) *
            ((2.0 * d + qkv_width) * act + 2.0 * acc + (tiled ? 0.0 : (d + 3.0 * f) * act)),
        0.0, "model.n_layers, model.d_model, model.ffn_hidden, train.offload, train.recompute");
    a.lines.back().host = backend != Backend::cpu;
  }
  const std::string mlp_keys =
      "model.d_model, model.ffn_hidden, train.mlp_chunk_tokens, "
      "train.recompute";
  const auto [ring_ranks, ring_steps] = ring_of(config);
  if (tiled) {
    // One chunk's buffers, or the ring's workspace where that is more: its bytes a token from
    // 256 more tokens (each of the ring's buffers rounds up to 256 bytes), the rest fixed.
    const double arena = layers >= 1.0 ? arena_elements(s, n, chunk, ring_ranks, e) * act : 0.0;
    const double more =
        layers >= 1.0 ? arena_elements(s, n + 256.0, chunk, ring_ranks, e) * act : 0.0;
    const double per_token = (more - arena) / 256.0;
    a.lines.push_back({"feed-forward arena (" + count_text(chunk) + "-token chunks)", per_token,
                       arena - per_token * n, arena,
                       mlp_keys + ", parallel.cp (the ring's workspace, where more)"});
  } else {
    add("feed-forward working set (" + blocks_text(kept_blocks) + ")",
        (kept_blocks * (d + 3.0 * f) + 3.0 * f) * act, 0.0, mlp_keys);
  }
  add("residual gradients, final norm", 3.0 * d * act + acc, 0.0, "model.d_model");
  const double loss_chunk = static_cast<double>(t.loss_chunk_tokens);
  const std::string logits_keys = "train.loss_chunk_tokens, model.vocab_size";
  if (n < loss_chunk) {
    add("logits chunk", static_cast<double>(s.vocab) * act, 0.0, logits_keys);
  } else {
    add("logits chunk", 0.0, loss_chunk * static_cast<double>(s.vocab) * act, logits_keys);
  }
  const RingWorkspace ring = ring_workspace(s, n, chunk, ring_ranks, ring_steps, e);
  add("ring workspace (its own)", ring.bytes_per_token, 0.0,
      "parallel.cp, parallel.layout, model.attention_window, train.mlp_chunk_tokens");
  // Host memory beside the backend's (check_run_memory's host needs): a step's micro-batches (an
  // int32 token id, an int32 target and a float mask a token) and the host copy of the parameters
  // and moments that a checkpoint writes.
  add("a step's micro-batches (host)", static_cast<double>(t.grad_accum) * 12.0, 0.0,
      "train.grad_accum");
  a.lines.back().host = true;
  add("checkpoint copy of the state (host)", 0.0, 3.0 * parameters * 4.0, shape_keys);
  a.lines.back().host = true;
  if (cuda) {
    const BackendBuffers b = cuda_backend_buffers(config, n);
    a.lines.push_back({"cuBLASLt workspace, batch, RoPE tables", b.bytes_per_token, b.fixed_bytes,
                       b.bytes, "RINGATTN_GEMM_WORKSPACE_MIB, model.head_dim"});
  }
  return a;
}

namespace {

// The index of the stage of `config` with the most tokens a rank (0 without train.stages).
int largest_stage(const TrainConfig& config) {
  const int count = static_cast<int>(run_stages(config.train).size());
  int largest = 0;
  const auto tokens = [&](int i) {
    const TrainConfig c = stage_config(config, i);
    return static_cast<double>(c.train.batch_size) * c.train.seq_len;
  };
  for (int i = 1; i < count; ++i) {
    if (tokens(i) > tokens(largest)) largest = i;
  }
  return largest;
}

}  // namespace

bool resolve_offload(const TrainConfig& config, Backend backend, double device_bytes) {
  if (config.train.offload != Offload::automatic) return config.train.offload == Offload::on;
  if (backend == Backend::cpu || device_bytes <= 0.0) return false;
  TrainConfig without = stage_config(config, largest_stage(config));
  without.train.offload = Offload::off;
  return memory_account(without, backend).peak_bytes() > device_bytes;
}

TrainConfig offload_resolved(TrainConfig config, bool offload) {
  config.train.offload = offload ? Offload::on : Offload::off;
  return config;
}

std::string memory_account_text(const TrainConfig& config, Backend backend, bool keys,
                                double in_use_before_bytes) {
  const std::vector<StageConfig> stages = run_stages(config.train);
  const int largest = largest_stage(config);
  const TrainConfig c = stage_config(config, largest);
  MemoryAccount a = memory_account(c, backend);
  const bool cuda = a.backend == Backend::cuda;
  const bool measured = cuda && in_use_before_bytes > 0.0;
  if (measured) {
    a.lines.push_back({"in use before the model (CUDA context, NCCL)", 0.0, in_use_before_bytes,
                       in_use_before_bytes, "measured (cudaMemGetInfo)"});
  }
  std::string text = !cuda     ? "memory a rank (cpu, host memory of the model and the ring):"
                     : measured ? "memory a rank (cuda):"
                                : "memory a rank (cuda; not counted: the CUDA context, NCCL's "
                                  "buffers):";
  char row[512];
  std::snprintf(row, sizeof row, "\n  %-44s %10s %10s%s", "component", "KiB/token", "fixed MiB",
                keys ? "  sized by" : "");
  text += row;
  const auto add_row = [&](const std::string& name, double per_token, double fixed,
                           const std::string& sized_by) {
    std::snprintf(row, sizeof row, "\n  %-44s %10.3f %10.1f%s%s", name.c_str(), per_token / 1024.0,
                  fixed / 0x1p20, sized_by.empty() ? "" : "  ", sized_by.c_str());
    text += row;
  };
  for (const MemoryLine& line : a.lines) {
    if (!line.host) add_row(line.component, line.bytes_per_token, line.fixed_bytes, keys ? line.keys : "");
  }
  add_row("total", a.bytes_per_token(), a.fixed_bytes(), "");
  for (const MemoryLine& line : a.lines) {  // host memory of a GPU run: beside the total
    if (line.host) add_row(line.component, line.bytes_per_token, line.fixed_bytes, keys ? line.keys : "");
  }
  text += "\npredicted peak " + gib_text(a.peak_bytes()) + " for " + count_text(a.local_tokens) +
          " tokens a rank (" +
          (stages.size() > 1 ? "train.stages[" + std::to_string(largest) + "]: " : std::string()) +
          "train.batch_size " + std::to_string(c.train.batch_size) + " x train.seq_len " +
          std::to_string(c.train.seq_len) + " / parallel.cp " + std::to_string(c.parallel.cp) + ")";
  text += "\nand " + gib_text(a.host_bytes()) + " of host memory beside" +
          (cuda ? " (pinned for train.offload where on)" : "");
  return text;
}

std::int64_t longest_fitting_seq_len(const TrainConfig& config, Backend backend, int gpus,
                                     double bytes_per_gpu, double host_bytes_per_gpu) {
  if (gpus < 1) {
    ringattn::detail::fail("longest_fitting_seq_len", "gpus is ", gpus, "; expected >= 1");
  }
  TrainConfig c = config;
  c.parallel.cp = gpus;
  c.parallel.dp = 1;
  c.train.stages.clear();
  const std::int64_t step = chunk_count(gpus, c.parallel.layout);
  const std::int64_t most = INT_MAX / step;  // seq_len = k x step is an int
  const auto set = [&](std::int64_t k) { c.train.seq_len = static_cast<int>(k * step); };
  // train.offload auto turns the offload on where the run does not fit without it.
  const bool either = c.train.offload == Offload::automatic && backend != Backend::cpu;
  const auto fits = [&](std::int64_t k) {
    set(k);
    const auto within = [&](const MemoryAccount& a) {
      return a.peak_bytes() <= bytes_per_gpu &&
             (host_bytes_per_gpu <= 0.0 || a.host_bytes() <= host_bytes_per_gpu);
    };
    TrainConfig off = c;
    off.train.offload = either ? Offload::off : c.train.offload;
    if (within(memory_account(off, backend))) return true;
    if (!either) return false;
    off.train.offload = Offload::on;
    return within(memory_account(off, backend));
  };
  const auto tiled = [&](std::int64_t k) {
    set(k);
    const double n = local_tokens_of(c);
    return resolved_mlp_chunk(model_options_of(c.train), n) < n;
  };
  // The largest k in [lo, hi] with pred(k), for a pred true up to a point and false after it;
  // lo - 1 when none.
  const auto last_true = [](std::int64_t lo, std::int64_t hi, const auto& pred) {
    std::int64_t good = lo - 1;
    while (lo <= hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (pred(mid)) {
        good = mid;
        lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
    return good;
  };
  // Untiled up to `edge`, tiled after it; within each side the account grows with seq_len.
  const std::int64_t edge = last_true(1, most, [&](std::int64_t k) { return !tiled(k); });
  std::int64_t best = 0;
  for (const auto& [lo, hi] : {std::pair{std::int64_t{1}, edge}, std::pair{edge + 1, most}}) {
    if (lo > hi || !fits(lo)) continue;
    best = std::max(best, last_true(lo, hi, fits));
  }
  return best * step;
}

}  // namespace ringattn::train
