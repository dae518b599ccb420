// The decoder-only transformer, written once over a backend (CPU fp32/fp64: train/backend_cpu.hpp;
// CUDA bf16: train/cuda/backend_cuda.hpp), run on this rank's shard of each sequence with ring
// attention over the context-parallel group.
//
//   embedding -> L x [rmsnorm -> wqkv -> rope(q, k at GLOBAL positions) -> ring attention ->
//   wo -> residual -> rmsnorm -> w_gate_up -> swiglu -> w_down -> residual] -> final rmsnorm ->
//   lm_head (or the tied embedding) -> fused softmax cross-entropy with the loss mask.
//
// With packed documents (ShardBatch::documents) the attention of every layer masks by GLOBAL
// position (the documents and attention_window as a ringattn::Mask), while RoPE may rotate by the
// position within the document (ModelOptions::rope_document_positions): the two position systems
// meet only in the host code that loads a batch (load_documents).
//
// Parameters live in one flat buffer of the backend's master type (fp32 on the GPU, the element
// type on the CPU) with a view per parameter_list() entry, gradients and the AdamW moments
// likewise; the GPU reads its weights through a bf16 copy refreshed after every change.
// forward_backward ADDS the gradient of grad_scale * (this rank's weighted loss sum) to the
// gradient buffer: the caller zeroes it once per optimizer step, passes grad_scale = 1 / (the
// loss-mask sum over every rank and micro-batch of the step), and all-reduces (sums) the
// gradients over every rank that holds the same parameters (the cp group and the dp replicas).
//
// Recomputation (ModelOptions::recompute) keeps only each block's input, attention output and LSE
// through the forward, and runs the rest of the block's forward again before its backward
// (rmsnorm, wqkv and RoPE, whose q, k, v the attention backward reads, then wo and the MLP): the
// activations of one block instead of L, at the cost of a second forward without its costliest
// part, the ring attention. ModelOptions::recompute_attention runs the ring attention again too
// and keeps nothing but each block's input: the least memory. The result is bitwise the same in
// every mode.
//
// The feed-forward block in chunks (ModelOptions::mlp_chunk_tokens): RMSNorm, w_gate_up, SwiGLU
// and w_down run over that many tokens at a time in the forward, and the backward makes each
// chunk's hidden activations again from the kept residual just before that chunk's backward, so
// only one chunk of them (and of their gradients) exists at once, in one arena that the ring
// borrows for its workspace while attention runs. The weights' gradients then add up chunk by
// chunk (another summation order than one GEMM); at one chunk size the recompute modes stay
// bitwise alike.
//
// The phase profile (train.profile): between start_profiled_step() and finish_profiled_step()
// every op the model runs is timed under a stable phase name ("matmul.qkv", "attention.backward",
// "adamw", ...; the list is at the call sites in train/model_impl.hpp) by the backend's clock:
// steady_clock around each synchronous op on the CPU, a pair of CUDA events on the stream on the
// GPU, resolved at the step's end with one wait on the last event. The phases do not nest, so
// their sum is the time the ops took; what the step spends elsewhere (loading data, the host's
// scalar all-reduces) is in none. Outside a profiled step each marker costs one branch.
//
// Every call is collective over the cp communicator (the ring).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "train/config.hpp"
#include "train/documents.hpp"
#include "train/model_memory.hpp"
#include "train/model_shapes.hpp"
#include "train/op_adamw.hpp"
#include "train/op_cross_entropy.hpp"

namespace ringattn::train {

ModelShape model_shape(const ModelConfig& config);

// The elements (of `act_bytes` each) of Model's feed-forward arena for micro-batches of
// [batch, local_len] tokens in chunks of `chunk` (fewer than batch * local_len) on a ring of
// `ranks`: a chunk's h2, gu, act, dact and dgu ([chunk, d_model], [chunk, 2 ffn_hidden],
// [chunk, ffn_hidden] twice, [chunk, 2 ffn_hidden]), each from a 256-byte boundary, or the ring's
// workspace for the model's attention (ring_workspace_bytes) where that is more. In double, like
// model_memory().
double mlp_arena_elements(const ModelShape& shape, double batch, double local_len, double chunk,
                          int ranks, DType act_dtype);

// This rank's tokens of one micro-batch: [batch, Sl] row-major each (Sl = seq_len / cp), on the
// host whatever the backend.
// Packed documents (train/documents.hpp): `documents` [batch, document_count] holds each row's
// document starts as positions of the WHOLE sequence (0 < s < seq_len, increasing; the same on
// every cp rank), shorter lists padded with seq_len; document_count 0: every row is one document.
// The attention of every layer keeps within the documents (ringattn::Mask::documents), and with
// ModelOptions::rope_document_positions the rotary positions restart at each of them.
struct ShardBatch {
  std::span<const std::int32_t> inputs;
  std::span<const std::int32_t> targets;
  std::span<const float> loss_mask;
  std::span<const std::int64_t> documents{};
  std::int64_t document_count = 0;
  // The global position of every token of the rank (empty: not given). Where given, the model
  // checks that they are its layout's for the batch (under the balanced layout, which follows
  // the documents, the trainer lays the tokens out per batch).
  std::span<const std::int64_t> positions{};
};

// One phase of the profile: its intervals and their total over every profiled step.
struct PhaseTime {
  std::string name;
  std::int64_t calls = 0;
  double total_ms = 0.0;
};

struct ModelOptions {
  bool recompute = false;      // keep one block's activations, recompute the others
  // With recompute: run the ring attention again too, instead of keeping every block's attention
  // output and LSE.
  bool recompute_attention = false;
  bool deterministic = false;  // bitwise-reproducible gradients (the CPU backend always is)
  // Attention within each rank's shard only (parallel.local_attention): a control.
  bool local_attention = false;
  // RoPE at document-relative positions where a batch carries documents
  // (model.rope_document_positions): position minus the start of the token's document. The mask
  // keeps the global positions either way.
  bool rope_document_positions = false;
  // The output head and the loss run over this many tokens at a time, so the logits held at once
  // are [loss_chunk_tokens, vocab] rather than [batch * Sl, vocab].
  std::int64_t loss_chunk_tokens = 8192;
  // The feed-forward block over this many tokens at a time (train.mlp_chunk_tokens; 0: automatic,
  // resolved by mlp_chunk_tokens() in train/config.hpp). Where the chunk is fewer than the rank's
  // tokens, the block's hidden activations (h2, gate|up, swiglu and their gradients) exist for
  // one chunk only, and the backward makes them again chunk by chunk from the kept residual.
  std::int64_t mlp_chunk_tokens = 0;
  // The blocks' inputs in host memory (train.offload resolved): block l's input is copied out
  // while block l runs its forward, and back while block l + 1 runs its backward; the backend's
  // memory holds three of them (two blocks' and the final norm's) instead of n_layers + 1. Where
  // every block keeps its attention output and LSE, those go out after the block's forward and
  // come back the same way (two pairs on the backend's side); without recompute, so do the rest
  // of every block's kept activations (h1, qkv, x_mid, the norms' inverses, and untiled the
  // feed-forward's h2, gate|up and swiglu: two blocks' on the backend's side). The results are
  // bitwise those without.
  bool offload = false;
  // AdamW's moments sharded over the gradient communicator's ranks (train.shard_optimizer).
  bool shard_optimizer = false;
  // Called before each block's forward and backward in forward_backward (not in forward alone).
  // It may throw to abandon the step there (the trainer does on a stop signal, every rank at the
  // same boundary): the gradients are then partial, and the parameters and moments untouched.
  std::function<void()> layer_boundary;
};

// What the trainer needs of a model, whatever its backend. Parameters, gradients and moments
// travel to and from the host only for checkpoints.
class TrainModel {
 public:
  virtual ~TrainModel() = default;
  virtual const std::vector<ParameterInfo>& parameter_infos() const = 0;
  virtual std::int64_t parameter_count() const = 0;
  virtual std::int64_t local_tokens() const = 0;  // batch * Sl
  virtual std::int64_t local_len() const = 0;     // Sl
  virtual std::string backend_name() const = 0;   // "cpu fp32", "cuda bf16"

  // Normal(0, init_std) weights from the seed, the same on every rank and backend; gains 1.
  virtual void init(std::uint64_t seed) = 0;
  virtual void zero_grad() = 0;
  // The forward only: this rank's sums; predictions [batch * Sl] on the host if given.
  virtual cpu::CrossEntropySums forward(const ShardBatch& batch,
                                        std::span<std::int32_t> predictions = {}) = 0;
  virtual cpu::CrossEntropySums forward_backward(const ShardBatch& batch, double grad_scale,
                                                 std::span<std::int32_t> predictions = {}) = 0;

  // The optimizer step's pieces: sum the gradients over `world` (every rank that holds the same
  // parameters), the name of the first parameter whose gradient is not finite ("" when all are),
  // and the clipped AdamW step below.
  virtual void all_reduce_gradients() = 0;
  virtual std::string first_non_finite_gradient() = 0;
  // After a forward whose loss is not finite: where the first non-finite value is, in the order
  // the forward made them ("parameter layers.0.wqkv", "layers.1.attention output", ...; the
  // activations recomputation dropped are skipped), or "" when every tensor kept is finite.
  virtual std::string first_non_finite_tensor() = 0;
  // The gradients' sum of squares, then AdamW on every tensor with the gradients scaled by
  // cpu::step_clip_factor of it, formed where the gradients are: on a GPU nothing waits between
  // the two. Returns the sum; when it is not finite the step is skipped (every parameter and
  // moment as it was).
  virtual double clip_and_adamw(const cpu::AdamWHyper& hyper, std::int64_t step,
                                double max_norm) = 0;

  // Host copies of the parameters and the AdamW moments (parameter_count() floats each). With
  // ModelOptions::shard_optimizer, export_state is collective over the gradient communicator (every
  // rank calls it), and import_state keeps this rank's share of the moments.
  virtual void export_state(std::vector<float>& params, std::vector<float>& m,
                            std::vector<float>& v) = 0;
  virtual void import_state(const std::vector<float>& params, const std::vector<float>& m,
                            const std::vector<float>& v) = 0;
  // A host copy of the gradients (parameter_count() floats), for tests and diagnostics.
  virtual void export_gradients(std::vector<float>& grads) = 0;
  // Peak memory of the backend's device in MiB (0 on the CPU: the trainer reports the process's).
  virtual double device_memory_mib() = 0;
  // The bytes of workspace the model's ring attention holds of its own (0 when the buffers lent
  // to it as scratch hold all of it).
  virtual std::size_t ring_workspace_bytes() const = 0;

  // The phase profile (see the top of this file): the calls between the two are timed by phase;
  // finish_profiled_step() waits for the device and adds the step's times into phase_times()
  // (phases in the order first seen).
  virtual void start_profiled_step() = 0;
  virtual void finish_profiled_step() = 0;
  virtual const std::vector<PhaseTime>& phase_times() const = 0;
};

template <class Backend>
class Model final : public TrainModel {
 public:
  using Act = typename Backend::Act;        // activations
  using Acc = typename Backend::Acc;        // statistics, attention gradients
  using Master = typename Backend::Master;  // parameters, gradients, moments
  template <typename E>
  using Buffer = typename Backend::template Buffer<E>;

  // cp_comm is the ring's communicator (its memory is the backend's); grad_comm sums the
  // gradients over every rank holding the same parameters (nullptr: no all-reduce).
  Model(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len,
        std::shared_ptr<Communicator> cp_comm, SequenceLayoutKind layout,
        ModelOptions options = {}, std::shared_ptr<Communicator> grad_comm = nullptr);
  ~Model() override;

  const std::vector<ParameterInfo>& parameter_infos() const override { return infos_; }
  std::int64_t parameter_count() const override { return offsets_.back(); }
  std::int64_t local_tokens() const override { return batch_ * local_len_; }
  std::int64_t local_len() const override { return local_len_; }
  std::string backend_name() const override;

  // The backend's memory (host spans on the CPU, device spans on the GPU).
  std::span<Master> parameters() { return {params_.data(), params_.size()}; }
  std::span<Master> gradients() { return {grads_.data(), grads_.size()}; }
  std::span<Master> parameter(std::size_t index);
  std::span<Master> gradient(std::size_t index);
  const std::vector<std::int64_t>& global_positions() const { return positions_; }  // [Sl]
  Communicator& cp_communicator() { return *cp_; }
  Backend& backend() { return *backend_; }

  // Drawn in double on the host, rounded once to the master type.
  void init(std::uint64_t seed) override;
  void zero_grad() override;

  cpu::CrossEntropySums forward(const ShardBatch& batch,
                                std::span<std::int32_t> predictions = {}) override;
  cpu::CrossEntropySums forward_backward(const ShardBatch& batch, double grad_scale,
                                         std::span<std::int32_t> predictions = {}) override;

  // Convenience for one micro-batch that is the whole step: the weighted mean loss over the cp
  // group (weight sum all-reduced over it), gradients of that mean added (not all-reduced).
  double loss_and_gradients(const ShardBatch& batch);

  void all_reduce_gradients() override;
  std::string first_non_finite_gradient() override;
  std::string first_non_finite_tensor() override;
  double clip_and_adamw(const cpu::AdamWHyper& hyper, std::int64_t step, double max_norm) override;
  void export_state(std::vector<float>& params, std::vector<float>& m,
                    std::vector<float>& v) override;
  void import_state(const std::vector<float>& params, const std::vector<float>& m,
                    const std::vector<float>& v) override;
  void export_gradients(std::vector<float>& grads) override;
  double device_memory_mib() override;
  std::size_t ring_workspace_bytes() const override { return ring_.owned_workspace_bytes(); }
  // The bytes of its buffers, by part: model_memory() of its shape and options.
  const ModelMemory& allocated_memory() const { return allocator_.allocated(); }
  void start_profiled_step() override;
  void finish_profiled_step() override;
  const std::vector<PhaseTime>& phase_times() const override { return phases_; }

 private:
  struct Layer {
    Buffer<Acc> inv1, inv2;
    Buffer<Act> h1, qkv, x_mid, h2, gu, act;
  };
  struct LayerParams {
    std::size_t attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down;
  };
  void allocate_layer(Layer& layer);
  // Whether the feed-forward block runs in chunks of mlp_chunk_ < local_tokens() tokens.
  bool mlp_tiled() const { return mlp_chunk_ < local_tokens(); }
  // Where block L's feed-forward keeps its hidden activations and their gradients: L's own
  // buffers and dact_, dgu_ untiled, else a chunk's stretches of mlp_arena_.
  struct MlpBuffers {
    Act *h2, *gu, *act, *dact, *dgu;
  };
  MlpBuffers mlp_buffers(Layer& L);
  // The feed-forward block of layer l over the tokens [first, first + rows): RMSNorm of L.x_mid
  // into h2 (inv2 at those rows), gate|up, SwiGLU, and with `down` out = x_mid + act W_down^T at
  // those rows of x_in_[l + 1]. The hidden buffers hold the chunk from their start.
  void mlp_forward(std::size_t l, Layer& L, std::int64_t first, std::int64_t rows, bool down);
  // Its backward over the same rows: adds the weights' gradients and dx_ (+)= the gradient of
  // x_mid, from dx_ (the gradient of the block's output) at those rows; the hidden activations
  // are read from mlp_buffers(L) as mlp_forward left them.
  void mlp_backward(std::size_t l, Layer& L, std::int64_t first, std::int64_t rows);
  // Buffer<E>(count), counted under `part`; a failure names the part and the keys that size it.
  template <typename E>
  Buffer<E> allocate(std::int64_t count, ModelPart part) {
    return allocator_.allocate<Buffer<E>>(count, sizeof(E), Backend::memory, part);
  }
  // The forward of block l from its input x_in_[l] into `L`, its attention output and LSE, and
  // x_in_[l + 1]. Recomputing (before the block's backward) writes only `L`, and reads the
  // attention output where every block keeps its own instead of running the ring again.
  void layer_forward(std::size_t l, Layer& L, bool recomputing);
  // `interruptible`: layer_boundary before each block (in forward_backward).
  void run_forward(const ShardBatch& batch, bool interruptible);
  // The output head and the loss, chunk by chunk over the tokens (the loss sums from the backend's
  // loss_sums() once they are needed); with_grad also adds the head's gradient and writes dh_
  // (the gradient of the final norm's output).
  void head_and_loss(bool with_grad, double grad_scale, std::span<std::int32_t> predictions);
  // The batch's documents for the attention (in the backend's memory) and the rotary positions
  // of its tokens (per row where they restart at documents, else positions_ for every row).
  void load_documents(const ShardBatch& batch);
  // The width of a packed QKV row: q heads, then k heads (head_dim each), then v heads
  // (v_head_dim each).
  std::int64_t qkv_width() const { return shape_.qkv_width(); }
  const Master* master(std::size_t i) const { return params_.data() + offsets_[i]; }
  Master* grad(std::size_t i) { return grads_.data() + offsets_[i]; }
  const Act* weight(std::size_t i) const;  // what the GEMMs read
  void refresh_weights();                  // the bf16 copy after a change of the parameters
  // [batch, Sl, heads, dim] at `data`, its tokens `stride` elements apart.
  TensorView view(const void* data, DType dtype, std::int64_t heads, std::int64_t dim,
                  std::int64_t stride) const;
  // Whether every block keeps its attention output and LSE (one pair is shared when recomputation
  // runs the ring attention again), and which pair is block l's.
  bool keeps_attention() const { return !options_.recompute || !options_.recompute_attention; }
  // With ModelOptions::offload the kept pairs go to host memory like the blocks' inputs: two
  // pairs on the backend's side, block l's in pair l % 2.
  bool offloads_attention() const { return options_.offload && keeps_attention(); }
  std::size_t attention_slot(std::size_t l) const {
    return !keeps_attention() ? 0 : options_.offload ? l % 2 : l;
  }
  // Without recompute every block keeps its other activations; with the offload those go to host
  // memory too (the attention transfer slots carry them), two blocks' in layers_, block l's in
  // layers_[l % 2]. layer_slot(l): block l's Layer.
  bool offloads_layers() const { return options_.offload && !options_.recompute; }
  std::size_t layer_slot(std::size_t l) const {
    return options_.recompute ? 0 : options_.offload ? l % 2 : l;
  }
  // The transfer slots (the backend's events): the blocks' inputs in 0 and 1, the attention
  // outputs in 2 and 3, block l's in the one of parity l.
  static int input_transfer(std::size_t l) { return static_cast<int>(l % 2); }
  static int attention_transfer(std::size_t l) { return 2 + static_cast<int>(l % 2); }
  // The ring call of layer l's attention (its inputs in L.qkv, its output in attn_o_), with the
  // buffers that are dead while attention runs lent as the ring's scratch.
  RingForwardArgs ring_forward_args(std::size_t l, Layer& L);
  // Runs op(); within a profiled step, as one interval of `phase` on the backend's clock.
  template <class Op>
  void timed(const char* phase, Op&& op);

  ModelShape shape_;
  ModelConfig config_;
  ModelOptions options_;
  std::int64_t batch_, seq_len_, local_len_;
  std::shared_ptr<Communicator> cp_, grad_comm_;
  std::unique_ptr<Backend> backend_;
  ModelAllocator allocator_;
  RingAttention ring_;
  std::vector<ParameterInfo> infos_;
  std::vector<std::int64_t> offsets_;
  Buffer<Master> params_, grads_, adam_m_, adam_v_;
  // The flat parameters whose moments this rank holds and updates, [shard_first_, shard_end_):
  // all of them unless ModelOptions::shard_optimizer splits them over grad_comm_'s ranks.
  std::int64_t shard_first_ = 0, shard_end_ = 0;
  // That share tensor by tensor (each part's length and weight decay), for the one AdamW call.
  std::vector<cpu::AdamWSegment> shard_segments_;
  bool sharded() const { return shard_end_ - shard_first_ < offsets_.back(); }
  std::pair<std::int64_t, std::int64_t> share_of(int rank) const;
  Buffer<Act> weights_;  // the GEMMs' copy of params_ where Act differs from Master
  std::vector<std::int64_t> positions_;
  // The loaded batch's documents as the attention takes them (empty: none), and whether the
  // backend's rotary positions are per row (document-relative) rather than positions_.
  DocumentStarts documents_{};
  bool row_positions_ = false;
  // The balanced layout over more than one rank: positions_ follow each batch's documents.
  bool balanced_ = false;
  // The ring's mask of a batch: causal, model.attention_window and these documents (none where
  // the count is 0), host starts that `documents` keeps.
  Mask causal_mask(const DocumentBatch& documents) const;
  std::size_t emb_ = 0, final_norm_ = 0, head_ = 0;
  std::vector<LayerParams> lp_;
  // Block l's input (l = L: the final norm's): x_in_[l], or with ModelOptions::offload, where
  // x_in_ holds three buffers, x_in_[l % 2] for l < L and x_in_.back() for L. host_in_[l] is the
  // host copy of block l's input; resident_input(l): still in its buffer after the forward (the
  // last two blocks'), so neither copied out nor back.
  Act* block_input(std::size_t l);
  bool resident_input(std::size_t l) const { return l + 2 >= lp_.size(); }
  template <typename E>
  using HostBuffer = typename Backend::template HostBuffer<E>;
  std::vector<HostBuffer<Act>> host_in_;
  std::vector<HostBuffer<Act>> host_attn_o_;  // offloads_attention(): block l's for l + 2 < L
  std::vector<HostBuffer<Acc>> host_attn_lse_;
  // offloads_layers(): block l's Layer in host memory for l + 2 < L, buffer by buffer.
  struct HostLayer {
    HostBuffer<Acc> inv1, inv2;
    HostBuffer<Act> h1, qkv, x_mid, h2, gu, act;
  };
  std::vector<HostLayer> host_layers_;
  void allocate_host_layer(HostLayer& host);
  // The (backend's, host) pairs of block l's Layer and its host copy, with their bytes: the
  // feed-forward's hidden activations only where the block is not in chunks.
  struct LayerCopy {
    void* data;
    void* host;
    std::size_t bytes;
  };
  std::vector<LayerCopy> layer_copies(std::size_t l);
  // Activations: the input of every block (x_in_[L] is the final norm's input), the attention
  // output and LSE of every block (one pair when recomputing the attention, two with the offload),
  // and the rest of every block's (L of them, one when recomputing, two with the offload).
  std::vector<Buffer<Act>> x_in_;
  std::vector<Buffer<Act>> attn_o_;
  std::vector<Buffer<Acc>> attn_lse_;
  std::vector<Layer> layers_;
  // The feed-forward chunk (ModelOptions::mlp_chunk_tokens resolved). Where it is fewer than the
  // rank's tokens, one buffer holds a chunk's h2, gu, act, dact and dgu (each from a 256-byte
  // boundary) outside attention, and is lent whole to the ring while attention runs: it is as
  // large as the ring's workspace (ring_workspace_bytes) where that is more, so that the ring
  // owns nothing and places every call alike. mlp_arena_elements() is its size.
  std::int64_t mlp_chunk_ = 0;
  Buffer<Act> mlp_arena_;
  Buffer<Acc> inv_f_;
  Buffer<Act> hf_, logits_;  // logits_: [loss chunk, vocab]
  // The backward's temporaries (dact_ and dgu_ of one feed-forward chunk).
  Buffer<Act> dh_, dx_, dact_, dgu_, dqkv_, dout_;
  Buffer<Acc> dqkv_acc_;  // the ring's gradients in the accumulator dtype where Acc != Act
  // The profile: whether a step is being profiled, the phase of each of its intervals so far (the
  // backend's interval i is interval_phase_[i]), and the totals.
  bool profiling_ = false;
  std::vector<std::size_t> interval_phase_;
  std::vector<double> interval_ms_;
  std::vector<PhaseTime> phases_;
};

// The model on this rank's GPU (the CUDA backend, train/cuda/backend_cuda.hpp), for the trainer:
// cp_comm and grad_comm move device memory (NCCL). Throws Error (unsupported) in a ringattn built
// without CUDA.
std::unique_ptr<TrainModel> make_cuda_model(const ModelConfig& config, std::int64_t batch,
                                            std::int64_t seq_len,
                                            std::shared_ptr<Communicator> cp_comm,
                                            SequenceLayoutKind layout, ModelOptions options,
                                            std::shared_ptr<Communicator> grad_comm);

// The dense bf16 tensor-core peak of this process's GPU in FLOP/s, for MFU: RINGATTN_PEAK_TFLOPS
// when set, else by the device's name (H100/H200 989e12, A100 312e12), else 0 (unknown; also
// without CUDA).
double cuda_peak_bf16_flops();

// The memory of this process's GPU in bytes (the current device's total, read from its properties
// without creating a context), for the trainer's check before anything is allocated; 0 when
// unknown (also without CUDA).
double cuda_device_memory_bytes();

// The memory of this process's GPU in use now, by every process on it (cudaMemGetInfo's total
// less its free), in bytes; 0 when unknown (also without CUDA).
double cuda_device_memory_in_use_bytes();

}  // namespace ringattn::train
