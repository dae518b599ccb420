#include "train/model_memory.hpp"

#include <sys/resource.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <vector>

#include "ringattn/error.hpp"
#include "train/model.hpp"

namespace ringattn::train {
namespace {

// parameter_list's elements summed from the dimensions alone: the count of a shape whose list is
// too long to build (2^31 layers) or whose count passes int64 (d_model 2^30). Exact below 2^53.
double parameter_count_of(const ModelShape& s) {
  const double d = static_cast<double>(s.d_model);
  const double qkv_rows = static_cast<double>(s.q_heads + 2 * s.kv_heads) * s.head_dim;
  const double per_layer = 2.0 * d + qkv_rows * d +
                           d * static_cast<double>(s.q_heads) * s.head_dim +
                           3.0 * static_cast<double>(s.ffn_hidden) * d;
  return static_cast<double>(s.vocab) * d * (s.tied_embeddings ? 1.0 : 2.0) + d +
         static_cast<double>(s.layers) * per_layer;
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
  }
  return "?";
}

const char* model_part_keys(ModelPart part) {
  switch (part) {
    case ModelPart::parameters:
      return "model.vocab_size, model.d_model, model.n_layers, model.n_heads, model.n_kv_heads, "
             "model.head_dim, model.ffn_hidden, model.tied_embeddings";
    case ModelPart::activations:
      return "train.batch_size, train.seq_len / parallel.cp, model.n_layers, model.d_model, "
             "model.n_heads, model.n_kv_heads, model.head_dim, model.ffn_hidden, train.recompute";
    case ModelPart::logits:
      return "train.loss_chunk_tokens, model.vocab_size";
  }
  return "?";
}

ModelMemory model_memory(const ModelShape& s, double local_tokens, const ModelOptions& options,
                         ModelElementBytes element_bytes, double moment_parameters) {
  const double n = local_tokens, d = static_cast<double>(s.d_model);
  const double layers = static_cast<double>(s.layers), f = static_cast<double>(s.ffn_hidden);
  const double heads_width = static_cast<double>(s.q_heads) * s.head_dim;  // attention output
  const double qkv_width = static_cast<double>(s.q_heads + 2 * s.kv_heads) * s.head_dim;
  const double act = element_bytes.act, acc = element_bytes.acc, master = element_bytes.master;
  const double parameters = parameter_count_of(s);
  ModelMemory m;
  // Weights and gradients, the two moments, and the GEMMs' copy where Act is not Master.
  m[ModelPart::parameters] = 2.0 * parameters * master + 2.0 * moment_parameters * master +
                             (act != master ? parameters * act : 0.0);
  // As Model's constructor allocates them: every block's input (and the final norm's), each
  // block's attention output and LSE (one pair when recomputation runs the attention again), each
  // block's other activations (one block's when recomputing: h1, qkv, x_mid, h2, gate|up, swiglu,
  // two norms' inverses), the final norm's, and the backward's temporaries.
  const double one_or_none = std::min(1.0, layers);
  const double attention_blocks =
      !options.recompute || !options.recompute_attention ? layers : one_or_none;
  const double kept_blocks = options.recompute ? one_or_none : layers;
  const double act_elements = n * ((layers + 1.0) * d + attention_blocks * heads_width +
                                   kept_blocks * (3.0 * d + qkv_width + 3.0 * f) + 3.0 * d +
                                   3.0 * f + qkv_width + heads_width);
  const double acc_elements = n * (attention_blocks * static_cast<double>(s.q_heads) +
                                   2.0 * kept_blocks + 1.0 + (act != acc ? qkv_width : 0.0));
  m[ModelPart::activations] = act_elements * act + acc_elements * acc;
  m[ModelPart::logits] = std::min(n, static_cast<double>(options.loss_chunk_tokens)) *
                         static_cast<double>(s.vocab) * act;
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
  const int ranks = config.parallel.dp * config.parallel.cp;
  // share_of's widest share: an equal part, its ends on 64-element boundaries.
  const double moments =
      config.train.shard_optimizer && ranks > 1 ? parameters / ranks + 64.0 : parameters;
  const std::string model_values =
      "model.vocab_size " + std::to_string(mc.vocab_size) + ", model.d_model " +
      std::to_string(mc.d_model) + ", model.n_layers " + std::to_string(mc.n_layers) +
      ", model.n_heads " + std::to_string(mc.n_heads) + ", model.n_kv_heads " +
      std::to_string(mc.n_kv_heads) + (mc.head_dim ? ", model.head_dim " : ", head_dim ") +
      std::to_string(mc.resolved_head_dim()) + ", model.ffn_hidden " +
      std::to_string(mc.ffn_hidden);
  const MemoryLimit host = host_memory_limit();
  const std::vector<StageConfig> stages = run_stages(config.train);
  for (int i = 0; i < static_cast<int>(stages.size()); ++i) {
    const TrainConfig c = stage_config(config, i);
    const TrainingConfig& t = c.train;
    ModelOptions options;
    options.recompute = t.recompute;
    options.recompute_attention = t.recompute_attention;
    options.loss_chunk_tokens = t.loss_chunk_tokens;
    const double tokens = static_cast<double>(t.batch_size) * t.seq_len / config.parallel.cp;
    const std::string tokens_text = count_text(tokens) + " tokens a rank: train.batch_size " +
                                    std::to_string(t.batch_size) + " x train.seq_len " +
                                    std::to_string(t.seq_len) + " / parallel.cp " +
                                    std::to_string(config.parallel.cp);
    const ModelMemory m = model_memory(shape, tokens, options,
                                       cuda ? kCudaModelElements : kCpuModelElements, moments);
    const std::vector<Need> model = {
        {m[ModelPart::parameters], std::string(model_part_name(ModelPart::parameters)) + " (" +
                                       count_text(parameters) + " parameters of " + model_values +
                                       ")"},
        {m[ModelPart::activations],
         std::string(model_part_name(ModelPart::activations)) + " (" + tokens_text +
             ", through model.n_layers " + std::to_string(mc.n_layers) + " of model.d_model " +
             std::to_string(mc.d_model) + " and model.ffn_hidden " + std::to_string(mc.ffn_hidden) +
             (t.recompute ? ", train.recompute true" : "") + ")"},
        {m[ModelPart::logits], std::string(model_part_name(ModelPart::logits)) +
                                   " (the fewer of train.loss_chunk_tokens " +
                                   std::to_string(t.loss_chunk_tokens) + " and " +
                                   count_text(tokens) + " tokens a rank, x model.vocab_size " +
                                   std::to_string(mc.vocab_size) + ")"}};
    // The step's micro-batches: an int32 token id, an int32 target and a float mask a token.
    std::vector<Need> host_needs = {
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

}  // namespace ringattn::train
