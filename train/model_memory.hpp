// The memory of a training run, part by part, known before anything is allocated: the model's
// buffers (train/model.hpp) and what the trainer holds beside them on the host. Sizes are in
// double bytes: the dimensions of a config that cannot fit multiply past int64, and a count
// formed in int64 would wrap to a size that looks small.
//
//   model parts    parameters: the master weights, their gradients, the AdamW moments (this
//                    rank's share of them under train.shard_optimizer) and the activation-dtype
//                    copy of the weights where that dtype differs
//                  activations: every buffer of the forward and backward of one micro-batch
//                  logits: [min(train.loss_chunk_tokens, tokens a rank), model.vocab_size]
//                  offloaded: with train.offload, the blocks' inputs (and the attention outputs
//                    that they keep; without recompute their other activations too) in
//                    (pinned) host memory
//   host parts     the micro-batches of a step (token ids, targets and loss mask, held until the
//                    step's loss normaliser is known), the host copy of the parameters and
//                    moments that a checkpoint writes or a resume reads
//
// Model<B> allocates its buffers through a ModelAllocator, which counts them per part (a test
// holds the count equal to model_memory()) and turns a failed allocation into an Error naming the
// part, its bytes and the config keys that size it. The trainer calls check_run_memory before
// step 1, so that a config that cannot fit is refused on every rank alike, naming the parts.
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "ringattn/tensor.hpp"
#include "train/config.hpp"
#include "train/model_shapes.hpp"

namespace ringattn::train {

struct ModelOptions;  // train/model.hpp, which includes this file

// offloaded: the blocks' inputs in host memory (ModelOptions::offload), whatever the backend.
enum class ModelPart { parameters, activations, logits, offloaded };
inline constexpr int kModelParts = 4;

// "the parameters, gradients and AdamW moments", ... and the config keys that size the part.
const char* model_part_name(ModelPart part);
const char* model_part_keys(ModelPart part);

// The bytes of Model<B>'s element types: Act (activations), Acc (statistics, attention gradients)
// and Master (weights, gradients, moments). A backend whose Act differs from Master (or from Acc)
// has a size of its own for it (static_assert in train/model_impl.hpp).
struct ModelElementBytes {
  int act = 4, acc = 4, master = 4;
};
// train/backend_cpu.hpp (fp32) and train/cuda/backend_cuda.hpp (bf16 activations; fp32
// statistics and master state).
inline constexpr ModelElementBytes kCpuModelElements{4, 4, 4};
inline constexpr ModelElementBytes kCudaModelElements{2, 4, 4};

// Bytes per part, indexed by ModelPart.
struct ModelMemory {
  std::array<double, kModelParts> bytes{};
  double& operator[](ModelPart part) { return bytes[static_cast<int>(part)]; }
  double operator[](ModelPart part) const { return bytes[static_cast<int>(part)]; }
  // The backend's memory: every part but the offloaded inputs, which are host memory.
  double total() const { return bytes[0] + bytes[1] + bytes[2]; }
};

// What Model<B> of `shape` allocates for micro-batches of `local_tokens` tokens (batch * Sl),
// holding the AdamW moments of `moment_parameters` parameters (all of them unless sharded), with
// its attention on a ring of `ring_ranks` (parallel.cp; 1 under parallel.local_attention), which
// sizes the feed-forward arena where the block runs in chunks (it doubles as the ring's
// workspace).
ModelMemory model_memory(const ModelShape& shape, double local_tokens, const ModelOptions& options,
                         ModelElementBytes element_bytes, double moment_parameters,
                         int ring_ranks = 1);

// Counts a Model's allocations per part; allocate() returns Buffer(count), or throws Error naming
// the part, its bytes, the keys that size it and what failed (std::bad_alloc, a vector's
// max_size(), cudaMalloc's out of memory).
class ModelAllocator {
 public:
  template <typename Buffer>
  Buffer allocate(std::int64_t count, std::size_t element_bytes, Memory memory, ModelPart part) {
    std::int64_t bytes = 0;
    // A byte count past int64 would wrap (a device buffer's size_t product) to a small buffer.
    if (count < 0 ||
        __builtin_mul_overflow(count, static_cast<std::int64_t>(element_bytes), &bytes)) {
      fail(count, element_bytes, memory, part, "its size in bytes passes int64");
    }
    try {
      Buffer buffer(count);
      allocated_[part] += static_cast<double>(bytes);
      return buffer;
    } catch (const std::exception& e) {
      fail(count, element_bytes, memory, part, e.what());
    }
  }
  const ModelMemory& allocated() const { return allocated_; }

 private:
  [[noreturn]] static void fail(std::int64_t count, std::size_t element_bytes, Memory memory,
                                ModelPart part, const std::string& cause);
  ModelMemory allocated_;
};

// The workspace RingAttention keeps of its own in Model<B> (train/model_impl.hpp), where each ring
// call is lent as scratch the feed-forward arena where the block runs in chunks (sized to hold the
// ring's workspace: nothing of its own), else the buffers of ring_forward_args in their order:
// dgu_, the block's gate|up, dact_, its swiglu output, dh_ and its normed input h2. An account,
// not the ring's code: it mirrors Placement in parallel/ring_attention.cpp (which buffers each call
// takes, in which order, first fit at 256-byte alignment) and must change with it. `ring_ranks` 1
// (one rank, or parallel.local_attention): the backward's delta alone; more: the forward's running
// output and two K|V buffers, the backward's two dK|dV accumulators, its step buffer when the call
// runs more than two `ring_steps`, two K|V buffers and delta. Each buffer is proportional to the
// local tokens, so bytes = bytes_per_token x local tokens.
struct RingWorkspace {
  double bytes = 0.0;            // the sum over buffer names of the largest own size a call needs
  double bytes_per_token = 0.0;  // the same a local token
};
RingWorkspace ring_workspace(const ModelShape& shape, double local_tokens, double mlp_chunk_tokens,
                             int ring_ranks, int ring_steps, ModelElementBytes element_bytes);

// A training run's memory a rank, component by component: what each costs a local token (batch *
// seq_len / cp) and what it costs whatever the tokens, at the account's tokens (a component such
// as the logits chunk is per token below train.loss_chunk_tokens and fixed from there on). The
// lines are the model's buffers (model_memory(), regrouped), the ring's own workspace
// (ring_workspace()) and, on the cuda backend, the backend's: the cuBLASLt workspace
// (RINGATTN_GEMM_WORKSPACE_MIB, 32 MiB unset), the batch's ids, targets, mask, losses and
// predictions (20 bytes a token) and the RoPE tables (at most 4 x head_dim bytes a token). Not
// counted: the CUDA context, NCCL's buffers, the host's copies.
struct MemoryLine {
  std::string component;         // "kept block inputs"
  double bytes_per_token = 0.0;  // a local token
  double fixed_bytes = 0.0;
  double bytes = 0.0;  // at the account's tokens
  std::string keys;    // the config keys that size it
  bool host = false;   // host memory beside the backend's (a GPU run's offloaded inputs, a step's
                       // batches, the checkpoint copy): not in the peak
};
struct MemoryAccount {
  Backend backend = Backend::cuda;
  double local_tokens = 0.0;
  std::vector<MemoryLine> lines;
  // Every buffer is allocated for the whole run (the ring's grow to their largest call), so the
  // peak is the sum of the lines of the backend's memory.
  double peak_bytes() const;  // the backend's memory (a GPU's, or the host's on the CPU)
  double host_bytes() const;  // the host memory beside the backend's
  double bytes_per_token() const;
  double fixed_bytes() const;

 private:
  // `field` summed over the lines beside the backend's memory (host) or of it.
  double sum(double MemoryLine::*field, bool host) const;
};
// The account of `config` at its train.seq_len and train.batch_size (not its stages: see
// stage_config) on `backend` (cuda or cpu; automatic counts as cuda).
MemoryAccount memory_account(const TrainConfig& config, Backend backend);

// The account as a person reads it: a header, one line a component ("KiB/token" and "fixed MiB";
// with `keys`, the keys that size it), the totals and "predicted peak X GiB for N tokens a rank".
// Of the stage with the most tokens a rank where the config has train.stages.
// `in_use_before_bytes` (cuda; 0: unknown): the device memory in use before the model was made
// (the CUDA context, NCCL's buffers), measured, counted as one more fixed line.
std::string memory_account_text(const TrainConfig& config, Backend backend, bool keys = false,
                                double in_use_before_bytes = 0.0);

// The longest train.seq_len whose memory_account fits `gpus` GPUs of `bytes_per_gpu` each, with
// the config's other keys and parallel.cp = gpus, parallel.dp = 1, no train.stages: a multiple of
// 2 x gpus (zigzag) or gpus (contiguous) up to the largest int; 0 when none fits. The account is
// piecewise linear in seq_len and drops where the feed-forward block starts to be tiled, so each
// side of that point is searched on its own.
// With `host_bytes_per_gpu` > 0 the host memory beside (host_bytes: the offloaded inputs, the
// batches, the checkpoint copy) must fit it too.
std::int64_t longest_fitting_seq_len(const TrainConfig& config, Backend backend, int gpus,
                                     double bytes_per_gpu, double host_bytes_per_gpu = 0.0);

// Whether a run of `config` offloads its blocks' inputs (ModelOptions::offload): train.offload on
// or off as it says; automatic: on the cuda backend where the account without it passes
// `device_bytes` (0: unknown, off), of the stage with the most tokens a rank.
bool resolve_offload(const TrainConfig& config, Backend backend, double device_bytes);
// `config` with train.offload on or off as `offload` says.
TrainConfig offload_resolved(TrainConfig config, bool offload);

// "12.5 GiB": bytes in GiB, four significant digits.
std::string gib_text(double bytes);

// How much memory this process may take, and what says so: the smallest of the machine's memory
// (RAM and swap), its address-space and data limits (ulimit -v, -d) and its cgroup's memory.max.
struct MemoryLimit {
  double bytes = 0.0;  // 0: unknown
  std::string what;
};
MemoryLimit host_memory_limit();

// Before step 1 of `config` (validated): the memory a rank needs at each stage, host and (for the
// cuda backend) device, against host_memory_limit() and the GPU's memory (`device_bytes`, 0:
// unknown). A need past either throws Error (invalid_argument) naming the parts that count, from
// the largest, each with its bytes and the keys and values that size it, on one line:
//   Trainer: a rank needs 4.915e+04 GiB of host memory, more than the 3.815 GiB this process may
//   map (its address-space limit, ulimit -v): 4.915e+04 GiB for the micro-batches of a step
//   (train.grad_accum 2147483647 x 2048 tokens a rank: train.batch_size 8 x train.seq_len 256 /
//   parallel.cp 1, x 12 bytes)
// The ring's own workspace counts with the model's parts, and on the cuda backend the backend's
// buffers (memory_account). It is a floor: the CUDA context and NCCL's buffers come on top, so a
// run that passes may still find an allocation failing (ModelAllocator names it).
void check_run_memory(const TrainConfig& config, Backend backend, double device_bytes);

}  // namespace ringattn::train
