// TrainConfig: everything a training run is told, read from YAML, changed by `--set key=value`,
// checked before any work starts, and written back into every checkpoint.
//
// A config file has five sections; every key has a default (the defaults are the tiny-cpu run,
// configs/tiny-cpu.yaml, so `TrainConfig{}` is the embedded default), a file sets only what it
// changes:
//
//   model:    vocab_size d_model n_layers n_heads n_kv_heads head_dim v_head_dim ffn_hidden
//             tied_embeddings rope_theta norm_eps init_std attention_window
//             rope_document_positions
//   train:    seq_len batch_size grad_accum steps stages lr min_lr warmup_steps weight_decay beta1
//             beta2 adam_eps grad_clip seed recompute recompute_attention loss_chunk_tokens
//             mlp_chunk_tokens offload deterministic profile shard_optimizer log_every
//             eval_every eval_batches checkpoint_every keep_checkpoints
//   parallel: dp cp layout local_attention
//   data:     source train_path val_path documents
//             retrieval: {pairs key_tokens value_tokens queries}
//   run:      dir backend resume
//
// Keys are named by their dotted path (`train.lr`, `data.retrieval.pairs`), in files, in `--set`
// and in every message. All errors are ringattn::Error: a file that cannot be read is
// ErrorKind::io, everything else ErrorKind::invalid_argument; the message names the file (and
// line), the key, the value and what was expected.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "train/shard_ranges.hpp"

namespace ringattn::train {

struct ModelConfig {
  int vocab_size = 256;
  int d_model = 64;
  int n_layers = 2;
  int n_heads = 4;
  int n_kv_heads = 2;           // grouped-query attention: n_heads % n_kv_heads == 0
  std::optional<int> head_dim;  // absent: d_model / n_heads
  // The width of V's heads, and so of the attention output's (d_v; d_qk is head_dim), as in
  // multi-head latent attention (192 / 128). Absent: the head dimension.
  std::optional<int> v_head_dim;
  int ffn_hidden = 176;         // SwiGLU hidden width
  bool tied_embeddings = true;  // the output head reuses the token embedding
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;  // RMSNorm epsilon
  double init_std = 0.02;  // standard deviation of the initial weights
  // A sliding window in every layer: a query sees the attention_window tokens up to and including
  // itself (with the causal mask; ringattn::Mask::window_left). 0: no window.
  int attention_window = 0;
  // RoPE positions restart at every packed document (train/documents.hpp): a token rotates by its
  // position minus its document's start. Absent: on exactly when the sequences carry documents
  // (data.documents); true where they carry none is an error.
  std::optional<bool> rope_document_positions;

  int resolved_head_dim() const { return head_dim ? *head_dim : d_model / n_heads; }
  int resolved_v_head_dim() const { return v_head_dim ? *v_head_dim : resolved_head_dim(); }
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// One stage of a run that grows its context (train.stages): `steps` optimizer steps at sequences
// of `seq_len` tokens, `batch_size` of them per data-parallel rank and micro-step (absent:
// train.batch_size).
struct StageConfig {
  int steps = 0;
  int seq_len = 0;
  std::optional<int> batch_size;

  friend bool operator==(const StageConfig&, const StageConfig&) = default;
};

// The `train` section.
enum class Offload { automatic, on, off };  // YAML: auto, on, off

struct TrainingConfig {
  int seq_len = 256;     // tokens per sequence (the whole context, over all cp ranks)
  int batch_size = 8;    // sequences per data-parallel rank per micro-step
  int grad_accum = 1;    // micro-steps per optimizer step
  int steps = 400;       // optimizer steps
  // Progressive context length: the run takes the stages in order, each its steps at its seq_len
  // (and batch_size), in one run with one learning-rate schedule over all of them. Empty: one stage
  // of train.steps at train.seq_len. Given, the stages' steps add up to train.steps (a file or
  // --set that gives stages without steps sets train.steps to their sum) and train.seq_len is
  // that of the stage being run (the trainer sets it; checkpoints record it). YAML:
  //   stages: [{steps: 400, seq_len: 256, batch_size: 64}, {steps: 200, seq_len: 16384}]
  std::vector<StageConfig> stages;
  double lr = 3e-3;      // peak learning rate, after linear warmup
  double min_lr = 3e-4;  // the end of the cosine decay
  int warmup_steps = 10;
  double weight_decay = 0.1;  // AdamW, decoupled
  double beta1 = 0.9;
  double beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;      // the largest global gradient norm; 0 turns clipping off
  std::uint64_t seed = 1234;   // initial weights and data order
  bool recompute = false;      // recompute each block's activations in backward
  // With recompute: the ring attention's forward runs again too, instead of keeping each block's
  // attention output and LSE (the least memory, at the price of the costliest part).
  bool recompute_attention = false;
  // The output head and the loss over this many tokens of a rank's batch at a time: the logits
  // held at once are [loss_chunk_tokens, vocab_size] in the activation dtype (512 MiB of bf16 at
  // 8192 x 32768). Fewer, larger chunks keep the head's GEMMs larger.
  int loss_chunk_tokens = 8192;
  // The feed-forward block (RMSNorm, w_gate_up, SwiGLU, w_down) over this many of a rank's tokens
  // at a time, in the forward, the recompute and the backward: only one chunk of its hidden
  // activations exists at once. 0: automatic (mlp_chunk_tokens() below).
  int mlp_chunk_tokens = 0;
  // The blocks' kept inputs (and attention outputs, where each block keeps its own) in pinned
  // host memory: each is copied out during the forward, on a stream of its own beside the next
  // block's compute, and back one block ahead of the backward that reads it; the GPU then holds
  // three inputs instead of n_layers + 1 (and two attention outputs instead of n_layers). auto: on
  // where the GPU cannot hold the run without it (the memory account, train/model_memory.hpp),
  // else off.
  Offload offload = Offload::automatic;
  bool deterministic = false;  // bitwise-reproducible kernels (slower where it matters)
  // Time every step's ops by phase (train/model.hpp); at the end of the run rank 0 prints the
  // table and writes <run.dir>/profile.json. The results are the same either way.
  bool profile = false;
  // AdamW's moments sharded over the ranks that hold the same parameters (all dp x cp ranks):
  // each rank updates its share of the weights and the ranks sum them together afterwards. Less
  // memory a GPU (the moments are 8 bytes a parameter), one more all-reduce of the weights a step;
  // the same results bitwise.
  bool shard_optimizer = false;
  int log_every = 10;          // steps between log lines
  int eval_every = 50;         // steps between evaluations; 0: never
  int eval_batches = 8;        // batches per evaluation
  int checkpoint_every = 0;    // steps between checkpoints; 0: only at the end and on a signal
  int keep_checkpoints = 3;    // the newest this many are kept

  friend bool operator==(const TrainingConfig&, const TrainingConfig&) = default;
};

struct ParallelConfig {
  int dp = 1;  // data-parallel groups
  int cp = 2;  // context-parallel ranks per group (the ring)
  ShardLayout layout = ShardLayout::zigzag;
  // A control, not a way to train: each rank attends only to the tokens of its own shard (the
  // causal mask in their sequence order, RoPE still at their global positions), so whatever a
  // model learns with it comes without the ring.
  bool local_attention = false;

  friend bool operator==(const ParallelConfig&, const ParallelConfig&) = default;
};

enum class DataSource { hdf5, retrieval };

// The synthetic key-value retrieval task (train/retrieval_task.hpp); one pair and one query (the
// default) is passkey retrieval.
struct RetrievalConfig {
  int pairs = 1;         // key-value pairs scattered through each sequence
  int key_tokens = 1;    // tokens per key
  int value_tokens = 1;  // tokens per value (the answer of a query)
  int queries = 1;       // queries at the end of each sequence, distinct pairs

  friend bool operator==(const RetrievalConfig&, const RetrievalConfig&) = default;
};

struct DataConfig {
  DataSource source = DataSource::retrieval;
  std::string train_path;  // HDF5 token dataset (train/token_dataset.hpp), source hdf5
  std::string val_path;    // the same for evaluation; needed when train.eval_every > 0
  // Packed documents (train/documents.hpp): a sequence's tokens attend only within their own
  // document, and a document's last token is not trained to predict the next one's first. Absent:
  // on when the training dataset has `document_starts` (written by ringattn-data); true for a
  // dataset without them is an error (the trainer's, when it opens the file, on every rank).
  std::optional<bool> documents;
  RetrievalConfig retrieval;

  friend bool operator==(const DataConfig&, const DataConfig&) = default;
};

enum class Backend { automatic, cuda, cpu };  // YAML: auto, cuda, cpu

struct RunConfig {
  std::string dir = "runs/tiny-cpu";  // checkpoints and metrics.jsonl
  Backend backend = Backend::cpu;  // auto: cuda when a GPU is visible, else cpu
  std::string resume;  // "": start fresh; "latest": newest checkpoint in dir; a path

  friend bool operator==(const RunConfig&, const RunConfig&) = default;
};

struct TrainConfig {
  ModelConfig model;
  TrainingConfig train;
  ParallelConfig parallel;
  DataConfig data;
  RunConfig run;

  friend bool operator==(const TrainConfig&, const TrainConfig&) = default;
};

// Reads a YAML file: keys it does not set keep their defaults. Throws on a missing or unreadable
// file or one that is not a regular file (a FIFO, a device: refused before any read) (io), a YAML
// syntax error, a second YAML document (after "---"), an unknown key (with the nearest known key),
// a key given twice or a value of the wrong type. Ranges and combinations are validate()'s job.
TrainConfig load_config_file(const std::filesystem::path& path);

// The same from YAML text; `source` names it in messages (e.g. "<embedded tiny-cpu>").
TrainConfig load_config_string(std::string_view yaml, std::string_view source);

// Applies one `--set` assignment "key=value" (`train.lr=3e-4`, `run.resume=latest`,
// `run.resume=` for the empty string). Throws for a missing '=', an unknown key or a value of the
// wrong type.
void apply_override(TrainConfig& config, std::string_view assignment);
void apply_overrides(TrainConfig& config, std::span<const std::string> assignments);

// YAML that load_config_string reads back into an equal config (numbers keep every bit).
std::string dump_config(const TrainConfig& config);

// The feed-forward chunk of a rank's `local_tokens` (batch * seq_len / cp) tokens for the value
// `key` of train.mlp_chunk_tokens: the key where set (at most local_tokens), else automatic: with
// train.recompute, kMlpAutoChunkTokens (the hidden activations of one chunk instead of every
// token's, for no extra compute, since the backward recomputes them anyway); without it, every
// token at once (a tiled block recomputes its hidden activations in the backward).
inline constexpr std::int64_t kMlpAutoChunkTokens = 16384;
std::int64_t mlp_chunk_tokens(std::int64_t key, bool recompute, std::int64_t local_tokens);

// The stages of a run: train.stages, or the one stage {train.steps, train.seq_len} without them.
std::vector<StageConfig> run_stages(const TrainingConfig& train);
// The config that stage `index` of run_stages runs: train.seq_len and train.batch_size are the
// stage's; everything else (train.stages included) is config's.
TrainConfig stage_config(const TrainConfig& config, int index);
// The index in run_stages of the stage that runs optimizer step `step` (0-based; past the end: the
// last stage).
int stage_of_step(const TrainingConfig& train, int step);

// Checks ranges and combinations for a job of `world_size` ranks: positive sizes, n_heads %
// n_kv_heads, d_model % n_heads (when head_dim is not given), an even head_dim (RoPE; v_head_dim
// may be odd: RoPE does not touch V), seq_len a multiple of the layout's chunk count (2 cp for
// zigzag, cp for contiguous), dp * cp == world_size, paths the data source needs, the retrieval
// task fitting in a sequence, ... With train.stages, every stage is checked as the run will take
// it (its seq_len and batch_size), and its problems name it ("train.stages[1] (seq_len 1000):
// ..."). Every problem is reported, one per line, each naming its key(s) and value(s).
void validate(const TrainConfig& config, int world_size);

// Every key, dotted, in file order.
const std::vector<std::string>& config_keys();

// Every key and its value, "model.vocab_size 256; model.d_model 64; ...", in file order (an unset
// key reads "unset"): what the ranks of a job compare (check_same_on_all_ranks), so that a
// difference is named key by key.
std::string config_items(const TrainConfig& config);

std::string_view source_name(DataSource source);
std::string_view backend_name(Backend backend);

// The main job's embedded default on a GPU machine: passkey retrieval (one key -> value pair
// anywhere in the sequence, one query at the end) with ring attention over `gpus` GPUs (cp =
// gpus), in two stages: 400 steps at 256 tokens, then 200 at 16,384 (2 * gpus must divide 256).
// A 2-layer model of 256 (4 heads of 64), batch 16, run.backend cuda, run.dir runs/default-gpu.
// TrainConfig{} (tiny-cpu) is the default elsewhere.
TrainConfig default_gpu_config(int gpus);

// The cuda backend's own limits (validate() applies them when run.backend is cuda; the trainer
// when auto resolves to cuda, on every rank before anything is allocated): a head dimension the
// CUDA block has kernels for (64 or 128, kernels/block_checks.hpp) and no v_head_dim of its own
// (the CUDA block takes d_v = d_qk), d_model, ffn_hidden and vocab_size multiples of 8. Throws
// ringattn::Error naming the keys and their values, e.g.
// "model.d_model 768 / model.n_heads 8 gives head_dim 96; the CUDA block takes 64 or 128 ...".
void validate_for_cuda(const TrainConfig& config);

}  // namespace ringattn::train
