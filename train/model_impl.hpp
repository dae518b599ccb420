// The definitions of Model<Backend> (train/model.hpp), included by the file that instantiates each
// backend (train/model_cpu.cpp, train/cuda/model_cuda.cpp). The model's math is here once; the
// backend supplies buffers and ops:
//
//   types      Act, Acc, Master, Buffer<E> (with data(), size(), constructible from a count)
//   constants  act_dtype, acc_dtype (DType), memory (Memory), name() (a string)
//   data       load_batch(ShardBatch), load_documents(host starts) -> the same in the backend's
//              memory (valid until the next call), upload / download between host floats and
//              Master buffers,
//              fill_zero, copy, to_act (Acc or Master -> Act where they differ), stream()
//   ops        embedding, rmsnorm, matmul, rope (set_rope with the positions of one row, shared by
//              every row, or of all batch * Sl tokens; where Acc and Act differ, also
//              rope_backward(Act*, const Acc*, shape): the rotation from Acc, rounded once, with
//              the rest of each token row converted, and rope_backward_heads(Act*, const Acc*,
//              shape): the same over the heads alone, the rest of the rows left as they are; and
//              key_rotation(): the tables of the local tokens' rotation as the attention's
//              KeyRotation), swiglu, cross_entropy, sum_of_squares,
//              queue_clip (the sum of squares and its cpu::step_clip_factor, not waited for),
//              adamw_clipped (one call over consecutive tensors, a cpu::AdamWSegment each, with
//              that factor; none when it is not finite), clip_total (waits for the sum),
//              memory_mib
//   profile    begin_interval(i), end_interval(i) around interval i (0, 1, ...) of a step, and
//              intervals_ms(count, ms): waits for the end of interval count - 1 and gives the
//              durations of intervals 0 .. count - 1
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/error.hpp"
#include "train/documents.hpp"
#include "train/model.hpp"

namespace ringattn::train {

template <class B>
Model<B>::Model(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len,
                std::shared_ptr<Communicator> cp_comm, SequenceLayoutKind layout,
                ModelOptions options, std::shared_ptr<Communicator> grad_comm)
    : shape_(model_shape(config)),
      config_(config),
      options_(options),
      batch_(batch),
      seq_len_(seq_len),
      local_len_(0),
      cp_(cp_comm),
      grad_comm_(std::move(grad_comm)),
      backend_(std::make_unique<B>()),
      // The local-attention control: a ring of this rank alone over its shard, whose positions
      // are then 0 .. Sl-1 in the shard's (increasing) order.
      ring_(options.local_attention ? split_communicator(*cp_comm, cp_comm->rank(), 0) : cp_comm,
            layout),
      infos_(parameter_list(shape_)) {
  // model_memory() tells the types apart by their sizes.
  static_assert(std::is_same_v<Act, Master> == (sizeof(Act) == sizeof(Master)) &&
                std::is_same_v<Act, Acc> == (sizeof(Act) == sizeof(Acc)));
  if (batch <= 0 || seq_len <= 0) {
    ringattn::detail::fail("Model", "batch ", batch, " and seq_len ", seq_len, " must be > 0");
  }
  if (cp_->memory() != B::memory) {
    ringattn::detail::fail("Model", "the cp communicator moves ",
                           cp_->memory() == Memory::host ? "host" : "device",
                           " memory; the ", B::name(), " backend needs ",
                           B::memory == Memory::host ? "host" : "device", " memory");
  }
  std::int64_t offset = 0;
  for (const ParameterInfo& p : infos_) {
    offsets_.push_back(offset);
    offset += p.elements;
  }
  offsets_.push_back(offset);
  params_ = allocate<Master>(offset, ModelPart::parameters);
  grads_ = allocate<Master>(offset, ModelPart::parameters);
  shard_end_ = offset;
  if (options_.shard_optimizer && grad_comm_ && grad_comm_->size() > 1) {
    std::tie(shard_first_, shard_end_) = share_of(grad_comm_->rank());
  }
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    const std::int64_t first = std::max(offsets_[i], shard_first_);
    const std::int64_t end = std::min(offsets_[i + 1], shard_end_);
    if (first >= end) continue;
    shard_segments_.push_back({end - first, infos_[i].weight_decay ? cpu::WeightDecay::apply
                                                                   : cpu::WeightDecay::skip});
  }
  adam_m_ = allocate<Master>(shard_end_ - shard_first_, ModelPart::parameters);
  adam_v_ = allocate<Master>(shard_end_ - shard_first_, ModelPart::parameters);
  if constexpr (!std::is_same_v<Act, Master>) {
    weights_ = allocate<Act>(offset, ModelPart::parameters);
  }
  backend_->fill_zero(adam_m_.data(), shard_end_ - shard_first_);
  backend_->fill_zero(adam_v_.data(), shard_end_ - shard_first_);
  const auto find = [&](const std::string& name) {
    for (std::size_t i = 0; i < infos_.size(); ++i) {
      if (infos_[i].name == name) return i;
    }
    ringattn::detail::fail("Model", "no parameter ", name);
  };
  emb_ = find("tok_embedding");
  final_norm_ = find("final_norm");
  head_ = shape_.tied_embeddings ? emb_ : find("lm_head");
  for (std::int64_t l = 0; l < shape_.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    lp_.push_back({find(p + "attn_norm"), find(p + "wqkv"), find(p + "wo"), find(p + "mlp_norm"),
                   find(p + "w_gate_up"), find(p + "w_down")});
  }
  // The tokens' positions in the whole sequence (throws when seq_len does not split); balanced:
  // those of a batch without documents until a batch brings its own (load_documents).
  balanced_ = layout == SequenceLayoutKind::balanced && cp_->size() > 1;
  positions_ = call_layout(layout, cp_->size(), cp_->rank(), seq_len, RingMask{causal_mask({}), 1})
                   .global_positions();
  local_len_ = static_cast<std::int64_t>(positions_.size());
  backend_->set_rope(positions_, shape_.head_dim, config_.rope_theta);
  const std::int64_t n = local_tokens();
  const std::int64_t d = shape_.d_model, f = shape_.ffn_hidden;
  const std::int64_t row = qkv_width(), o_width = shape_.attention_width();
  constexpr ModelPart kActivations = ModelPart::activations;
  if (options_.mlp_chunk_tokens < 0) {
    ringattn::detail::fail("Model", "mlp_chunk_tokens is ", options_.mlp_chunk_tokens,
                           "; expected >= 0 (0: automatic)");
  }
  mlp_chunk_ = mlp_chunk_tokens(options_.mlp_chunk_tokens, options_.recompute, n);
  const std::int64_t device_inputs =
      options_.offload ? std::min<std::int64_t>(3, shape_.layers + 1) : shape_.layers + 1;
  for (std::int64_t l = 0; l < device_inputs; ++l) {
    x_in_.push_back(allocate<Act>(n * d, kActivations));
  }
  if (options_.offload) {
    for (std::int64_t l = 0; l + 2 < shape_.layers; ++l) {
      host_in_.push_back(allocator_.allocate<HostBuffer<Act>>(n * d, sizeof(Act), Memory::host,
                                                              ModelPart::offloaded));
    }
  }
  const std::int64_t one_or_none = std::min<std::int64_t>(1, shape_.layers);
  const std::int64_t attention_pairs = !keeps_attention() ? one_or_none
                                       : options_.offload ? std::min<std::int64_t>(2, shape_.layers)
                                                          : shape_.layers;
  for (std::int64_t l = 0; l < attention_pairs; ++l) {
    attn_o_.push_back(allocate<Act>(n * o_width, kActivations));
    attn_lse_.push_back(allocate<Acc>(n * shape_.q_heads, kActivations));
  }
  for (std::int64_t l = 0; offloads_attention() && l + 2 < shape_.layers; ++l) {
    host_attn_o_.push_back(allocator_.allocate<HostBuffer<Act>>(
        n * o_width, sizeof(Act), Memory::host, ModelPart::offloaded));
    host_attn_lse_.push_back(allocator_.allocate<HostBuffer<Acc>>(
        n * shape_.q_heads, sizeof(Acc), Memory::host, ModelPart::offloaded));
  }
  layers_.resize(options_.recompute  ? one_or_none
                 : options_.offload ? std::min<std::int64_t>(2, shape_.layers)
                                    : shape_.layers);
  for (Layer& L : layers_) allocate_layer(L);
  for (std::int64_t l = 0; offloads_layers() && l + 2 < shape_.layers; ++l) {
    allocate_host_layer(host_layers_.emplace_back());
  }
  if (mlp_tiled() && shape_.layers > 0) {
    const double elements = mlp_arena_elements(shape_, static_cast<double>(batch_),
                                               static_cast<double>(local_len_),
                                               static_cast<double>(mlp_chunk_),
                                               ring_.size(), B::act_dtype);
    mlp_arena_ = allocate<Act>(static_cast<std::int64_t>(elements), kActivations);
  }
  inv_f_ = allocate<Acc>(n, kActivations);
  hf_ = allocate<Act>(n * d, kActivations);
  if (options_.loss_chunk_tokens < 1) {
    ringattn::detail::fail("Model", "loss_chunk_tokens is ", options_.loss_chunk_tokens,
                           "; expected >= 1");
  }
  logits_ =
      allocate<Act>(std::min(n, options_.loss_chunk_tokens) * shape_.vocab, ModelPart::logits);
  dh_ = allocate<Act>(n * d, kActivations);
  dx_ = allocate<Act>(n * d, kActivations);
  if (!mlp_tiled()) {
    dact_ = allocate<Act>(n * f, kActivations);
    dgu_ = allocate<Act>(n * 2 * f, kActivations);
  }
  dqkv_ = allocate<Act>(n * row, kActivations);
  dout_ = allocate<Act>(n * o_width, kActivations);
  if constexpr (!std::is_same_v<Act, Acc>) dqkv_acc_ = allocate<Acc>(n * row, kActivations);
}

// The scratch lent to the ring as persistent is freed with the members, after this: every rank
// lets go of the others' first. Bounded, so that a rank unwinding alone from an error waits at
// most 10 s for the others.
template <class B>
Model<B>::~Model() {
  try {
    ring_.release_scratch(10.0);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "ringattn: releasing the ring's scratch failed: %s\n", error.what());
  }
}

template <class B>
std::string Model<B>::backend_name() const {
  return B::name();
}

template <class B>
void Model<B>::allocate_layer(Layer& L) {
  const std::int64_t n = local_tokens();
  const std::int64_t d = shape_.d_model, f = shape_.ffn_hidden;
  const std::int64_t row = qkv_width();
  constexpr ModelPart kActivations = ModelPart::activations;
  L.inv1 = allocate<Acc>(n, kActivations);
  L.inv2 = allocate<Acc>(n, kActivations);
  L.h1 = allocate<Act>(n * d, kActivations);
  L.qkv = allocate<Act>(n * row, kActivations);
  L.x_mid = allocate<Act>(n * d, kActivations);
  if (mlp_tiled()) return;  // the hidden activations live in the arena
  L.h2 = allocate<Act>(n * d, kActivations);
  L.gu = allocate<Act>(n * 2 * f, kActivations);
  L.act = allocate<Act>(n * f, kActivations);
}

template <class B>
void Model<B>::allocate_host_layer(HostLayer& H) {
  const std::int64_t n = local_tokens();
  const std::int64_t d = shape_.d_model, f = shape_.ffn_hidden;
  const auto act = [&](HostBuffer<Act>& buffer, std::int64_t count) {
    buffer = allocator_.allocate<HostBuffer<Act>>(count, sizeof(Act), Memory::host,
                                                  ModelPart::offloaded);
  };
  const auto acc = [&](HostBuffer<Acc>& buffer, std::int64_t count) {
    buffer = allocator_.allocate<HostBuffer<Acc>>(count, sizeof(Acc), Memory::host,
                                                  ModelPart::offloaded);
  };
  acc(H.inv1, n);
  acc(H.inv2, n);
  act(H.h1, n * d);
  act(H.qkv, n * qkv_width());
  act(H.x_mid, n * d);
  if (mlp_tiled()) return;
  act(H.h2, n * d);
  act(H.gu, n * 2 * f);
  act(H.act, n * f);
}

template <class B>
std::vector<typename Model<B>::LayerCopy> Model<B>::layer_copies(std::size_t l) {
  Layer& L = layers_[layer_slot(l)];
  HostLayer& H = host_layers_[l];
  std::vector<LayerCopy> copies;
  const auto pair = [&](auto& data, auto& host) {
    copies.push_back({data.data(), host.data(), data.size() * sizeof(*data.data())});
  };
  pair(L.inv1, H.inv1);
  pair(L.inv2, H.inv2);
  pair(L.h1, H.h1);
  pair(L.qkv, H.qkv);
  pair(L.x_mid, H.x_mid);
  if (!mlp_tiled()) {
    pair(L.h2, H.h2);
    pair(L.gu, H.gu);
    pair(L.act, H.act);
  }
  return copies;
}

template <class B>
typename B::Act* Model<B>::block_input(std::size_t l) {
  if (!options_.offload) return x_in_[l].data();
  return l == lp_.size() ? x_in_.back().data() : x_in_[l % 2].data();
}

template <class B>
typename Model<B>::MlpBuffers Model<B>::mlp_buffers(Layer& L) {
  if (!mlp_tiled()) return {L.h2.data(), L.gu.data(), L.act.data(), dact_.data(), dgu_.data()};
  const std::int64_t c = mlp_chunk_, d = shape_.d_model, f = shape_.ffn_hidden;
  constexpr std::int64_t boundary = 256 / sizeof(Act);
  Act* next = mlp_arena_.data();
  const auto take = [&](std::int64_t elements) {
    Act* stretch = next;
    next += (elements + boundary - 1) / boundary * boundary;
    return stretch;
  };
  MlpBuffers m;
  m.h2 = take(c * d);
  m.gu = take(c * 2 * f);
  m.act = take(c * f);
  m.dact = take(c * f);
  m.dgu = take(c * 2 * f);
  return m;
}

template <class B>
std::span<typename B::Master> Model<B>::parameter(std::size_t i) {
  return {params_.data() + offsets_[i], static_cast<std::size_t>(infos_[i].elements)};
}

template <class B>
std::span<typename B::Master> Model<B>::gradient(std::size_t i) {
  return {grads_.data() + offsets_[i], static_cast<std::size_t>(infos_[i].elements)};
}

template <class B>
const typename B::Act* Model<B>::weight(std::size_t i) const {
  if constexpr (std::is_same_v<Act, Master>) {
    return params_.data() + offsets_[i];
  } else {
    return weights_.data() + offsets_[i];
  }
}

template <class B>
void Model<B>::refresh_weights() {
  if constexpr (!std::is_same_v<Act, Master>) {
    backend_->to_act(weights_.data(), params_.data(), offsets_.back());
  }
}

template <class B>
void Model<B>::init(std::uint64_t seed) {
  // Box-Muller over mt19937_64: the same doubles on every platform and for every backend.
  std::mt19937_64 rng(seed);
  const auto uniform = [&] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  std::vector<double> wide;
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    const std::size_t count = static_cast<std::size_t>(infos_[i].elements);
    wide.assign(count, 1.0);
    if (infos_[i].shape.size() != 1) {
      for (std::size_t j = 0; j < count; j += 2) {
        const double r = std::sqrt(-2.0 * std::log(uniform()));
        const double a = 2.0 * M_PI * uniform();
        wide[j] = config_.init_std * r * std::cos(a);
        if (j + 1 < count) wide[j + 1] = config_.init_std * r * std::sin(a);
      }
    }
    backend_->upload_wide(params_.data() + offsets_[i], wide.data(), count);
  }
  refresh_weights();
  zero_grad();
}

template <class B>
void Model<B>::zero_grad() {
  timed("grad.zero", [&] { backend_->fill_zero(grads_.data(), offsets_.back()); });
}

template <class B>
TensorView Model<B>::view(const void* data, DType dtype, std::int64_t heads, std::int64_t dim,
                          std::int64_t stride) const {
  return TensorView::contiguous(const_cast<void*>(data), dtype, {batch_, local_len_, heads, dim},
                                B::memory)
      .with_strides({local_len_ * stride, stride, dim, 1});
}

template <class B>
RingForwardArgs Model<B>::ring_forward_args(std::size_t l, Layer& L) {
  const std::int64_t hd = shape_.head_dim, vhd = shape_.v_head_dim, hq = shape_.q_heads,
                     hkv = shape_.kv_heads;
  const std::int64_t row = qkv_width();
  const std::size_t a = attention_slot(l);
  RingForwardArgs args;
  args.q = view(L.qkv.data(), B::act_dtype, hq, hd, row);
  args.k = view(L.qkv.data() + hq * hd, B::act_dtype, hkv, hd, row);
  args.v = view(L.qkv.data() + (hq + hkv) * hd, B::act_dtype, hkv, vhd, row);
  args.o = view(attn_o_[a].data(), B::act_dtype, hq, vhd, hq * vhd);
  args.lse = TensorView::contiguous(attn_lse_[a].data(), B::acc_dtype, {batch_, hq, local_len_},
                                    B::memory);
  args.scale = 1.0 / std::sqrt(static_cast<double>(hd));
  args.causal = true;
  args.window_left = config_.attention_window;
  args.documents = documents_;
  args.stream = backend_->stream();
  // Dead whenever attention runs: the MLP's activations of L (written after the attention forward
  // and read before the attention backward), dh_ and the MLP's gradients (each written and read
  // within one layer's backward, before its attention backward); in chunks, the arena that holds
  // them, as large as the ring's workspace. So the ring's workspace costs no memory of its own on
  // the cp ranks. The buffers live as long as the model, which releases them from the ring first
  // (~Model): persistent.
  const auto lend = [&](auto& buffer) {
    args.scratch.push_back({buffer.data(), buffer.size() * sizeof(*buffer.data()), true});
  };
  if (mlp_tiled()) {
    lend(mlp_arena_);
    return args;
  }
  lend(dgu_);
  lend(L.gu);
  lend(dact_);
  lend(L.act);
  lend(dh_);
  lend(L.h2);
  return args;
}

template <class B>
template <class Op>
void Model<B>::timed(const char* phase, Op&& op) {
  if (!profiling_) {
    op();
    return;
  }
  std::size_t p = 0;
  while (p < phases_.size() && phases_[p].name != phase) ++p;
  if (p == phases_.size()) phases_.push_back({phase, 0, 0.0});
  const std::size_t interval = interval_phase_.size();
  interval_phase_.push_back(p);
  backend_->begin_interval(interval);
  op();
  backend_->end_interval(interval);
}

template <class B>
void Model<B>::start_profiled_step() {
  interval_phase_.clear();
  profiling_ = true;
}

template <class B>
void Model<B>::finish_profiled_step() {
  profiling_ = false;
  backend_->intervals_ms(interval_phase_.size(), interval_ms_);
  for (std::size_t i = 0; i < interval_phase_.size(); ++i) {
    PhaseTime& phase = phases_[interval_phase_[i]];
    ++phase.calls;
    phase.total_ms += interval_ms_[i];
  }
  interval_phase_.clear();
}

// The phases' names are the profile's columns (train.profile): keep them stable. A recomputed
// forward (ModelOptions::recompute) counts under the forward's names.
template <class B>
void Model<B>::layer_forward(std::size_t l, Layer& L, bool recomputing) {
  B& be = *backend_;
  const std::int64_t n = local_tokens();
  const std::int64_t d = shape_.d_model, hd = shape_.head_dim, hq = shape_.q_heads,
                     hkv = shape_.kv_heads;
  const std::int64_t row = qkv_width(), o_width = shape_.attention_width();
  const LayerParams& P = lp_[l];
  const Act* x_in = block_input(l);
  timed("rmsnorm", [&] {
    be.rmsnorm_forward(L.h1.data(), L.inv1.data(), x_in, master(P.attn_norm), {n, d},
                       config_.norm_eps);
  });
  timed("matmul.qkv", [&] {
    be.matmul_forward(L.qkv.data(), L.h1.data(), weight(P.wqkv), {n, d, row}, Write::overwrite);
  });
  // q's and k's heads lie next to each other at the same positions: one rotation over hq + hkv.
  timed("rope", [&] { be.rope_forward(L.qkv.data(), {n, hq + hkv, hd, row}); });
  if (!recomputing || !keeps_attention()) {
    timed("attention.forward", [&] { ring_.forward(ring_forward_args(l, L)); });
  }
  // x_mid = x_in + o W_o^T
  timed("matmul.wo", [&] {
    be.matmul_forward(L.x_mid.data(), attn_o_[attention_slot(l)].data(), weight(P.wo),
                      {n, o_width, d}, Write::add, x_in);
  });
  // Recomputing a tiled block leaves its feed-forward to the backward, chunk by chunk.
  if (recomputing && mlp_tiled()) return;
  for (std::int64_t first = 0; first < n; first += mlp_chunk_) {
    mlp_forward(l, L, first, std::min(mlp_chunk_, n - first), !recomputing);
  }
}

template <class B>
void Model<B>::mlp_forward(std::size_t l, Layer& L, std::int64_t first, std::int64_t rows,
                           bool down) {
  B& be = *backend_;
  const std::int64_t d = shape_.d_model, f = shape_.ffn_hidden;
  const LayerParams& P = lp_[l];
  const MlpBuffers M = mlp_buffers(L);
  const Act* x_mid = L.x_mid.data() + first * d;
  timed("rmsnorm", [&] {
    be.rmsnorm_forward(M.h2, L.inv2.data() + first, x_mid, master(P.mlp_norm), {rows, d},
                       config_.norm_eps);
  });
  timed("matmul.gate_up", [&] {
    be.matmul_forward(M.gu, M.h2, weight(P.w_gate_up), {rows, d, 2 * f}, Write::overwrite);
  });
  timed("swiglu", [&] { be.swiglu_forward(M.act, M.gu, {rows, f}); });
  if (down) {
    timed("matmul.down", [&] {
      be.matmul_forward(block_input(l + 1) + first * d, M.act, weight(P.w_down), {rows, f, d},
                        Write::add, x_mid);
    });
  }
}

template <class B>
void Model<B>::mlp_backward(std::size_t l, Layer& L, std::int64_t first, std::int64_t rows) {
  B& be = *backend_;
  const std::int64_t d = shape_.d_model, f = shape_.ffn_hidden;
  const LayerParams& P = lp_[l];
  const MlpBuffers M = mlp_buffers(L);
  Act* dx = dx_.data() + first * d;
  Act* dh = dh_.data() + first * d;
  // out = x_mid + act W_down^T
  timed("matmul.down.backward", [&] {
    be.matmul_backward_weight(grad(P.w_down), dx, M.act, {rows, f, d}, Write::add);
    be.matmul_backward_input(M.dact, dx, weight(P.w_down), {rows, f, d}, Write::overwrite);
  });
  timed("swiglu.backward", [&] { be.swiglu_backward(M.dgu, M.dact, M.gu, {rows, f}); });
  timed("matmul.gate_up.backward", [&] {
    be.matmul_backward_weight(grad(P.w_gate_up), M.dgu, M.h2, {rows, d, 2 * f}, Write::add);
    be.matmul_backward_input(dh, M.dgu, weight(P.w_gate_up), {rows, d, 2 * f}, Write::overwrite);
  });
  timed("rmsnorm.backward", [&] {
    be.rmsnorm_backward(dx, grad(P.mlp_norm), dh, L.x_mid.data() + first * d, master(P.mlp_norm),
                        L.inv2.data() + first, {rows, d}, Write::add);
  });
}

template <class B>
void Model<B>::run_forward(const ShardBatch& batch, bool interruptible) {
  const std::int64_t n = local_tokens();
  const auto check = [&](std::size_t size, const char* name) {
    if (static_cast<std::int64_t>(size) != n) {
      ringattn::detail::fail("Model::forward", name, " has ", size,
                             " tokens; expected batch * Sl = ", n);
    }
  };
  check(batch.inputs.size(), "inputs");
  check(batch.targets.size(), "targets");
  check(batch.loss_mask.size(), "loss_mask");
  B& be = *backend_;
  timed("batch.load", [&] {
    be.load_batch(batch, shape_.vocab);
    load_documents(batch);
  });
  const std::int64_t d = shape_.d_model, v = shape_.vocab;
  if (options_.offload) {
    // A step abandoned at a block boundary may have left a copy in flight into or out of any
    // buffer the forward writes.
    for (const int slot : {0, 1, 2, 3}) be.wait_transfer(slot);
  }
  timed("embedding", [&] { be.embedding_forward(block_input(0), weight(emb_), {n, v, d}); });
  for (std::size_t l = 0; l < lp_.size(); ++l) {
    if (interruptible && options_.layer_boundary) options_.layer_boundary();
    if (options_.offload) {
      // Block l writes its output where block l - 1's input was: that input's copy out must be
      // done. Then block l's input goes out beside block l's compute.
      if (l >= 1 && !resident_input(l - 1)) {
        timed("offload.wait", [&] { be.wait_transfer(input_transfer(l - 1)); });
      }
      // Block l's attention output goes where block l - 2's was.
      if (offloads_attention() && l >= 2 && !resident_input(l - 2)) {
        timed("offload.wait", [&] { be.wait_transfer(attention_transfer(l - 2)); });
      }
      if (!resident_input(l)) {
        be.offload(host_in_[l].data(), block_input(l), n * d * sizeof(Act), input_transfer(l));
      }
    }
    layer_forward(l, layers_[layer_slot(l)], false);
    if (offloads_attention() && !resident_input(l)) {
      const std::size_t a = attention_slot(l);
      be.offload(host_attn_o_[l].data(), attn_o_[a].data(), attn_o_[a].size() * sizeof(Act),
                 attention_transfer(l));
      be.offload(host_attn_lse_[l].data(), attn_lse_[a].data(),
                 attn_lse_[a].size() * sizeof(Acc), attention_transfer(l));
      // Block l + 2 writes this Layer after the same wait as its attention output.
      if (offloads_layers()) {
        for (const LayerCopy& c : layer_copies(l)) {
          be.offload(c.host, c.data, c.bytes, attention_transfer(l));
        }
      }
    }
  }
  timed("rmsnorm", [&] {
    be.rmsnorm_forward(hf_.data(), inv_f_.data(), block_input(lp_.size()), master(final_norm_),
                       {n, d}, config_.norm_eps);
  });
}

template <class B>
void Model<B>::load_documents(const ShardBatch& batch) {
  B& be = *backend_;
  const std::int64_t count = batch.document_count;
  if (count < 0 || static_cast<std::int64_t>(batch.documents.size()) != batch_ * count) {
    ringattn::detail::fail("Model::forward", "documents has ", batch.documents.size(),
                           " starts; expected batch * document_count = ", batch_, " * ", count);
  }
  documents_ = {};
  std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(batch_));
  for (std::int64_t b = 0; b < batch_; ++b) {
    const auto row = batch.documents.subspan(b * count, count);
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t start = row[i];
      if (start < 0 || (i > 0 && start < row[i - 1])) {
        ringattn::detail::fail("Model::forward", "documents[", b, ", ", i, "] is ", start,
                               "; expected non-decreasing positions >= 0");
      }
      if (start < seq_len_) rows[b].push_back(start);
    }
  }
  // The balanced layout follows the batch's documents: this rank's tokens are the ones the ring
  // lays out from the same mask (the documents of the whole sequence), and the batch must hold
  // the tokens at those positions.
  bool moved = false;
  if (balanced_) {
    const DocumentBatch global = pad_document_lists(rows, seq_len_);
    std::vector<std::int64_t> positions =
        balanced_layout(cp_->size(), cp_->rank(), seq_len_,
                        RingMask{causal_mask(global), batch_})
            .global_positions();
    moved = positions != positions_;
    positions_ = std::move(positions);
  }
  if (!batch.positions.empty() &&
      !std::equal(batch.positions.begin(), batch.positions.end(), positions_.begin(),
                  positions_.end())) {
    ringattn::detail::fail("Model::forward", "the batch's ", batch.positions.size(),
                           " tokens sit at other positions than the ", positions_.size(),
                           " of this rank's ", sequence_layout_name(ring_.layout()),
                           " layout for the batch's documents");
  }
  if (count == 0) {
    if (row_positions_ || moved) be.set_rope(positions_, shape_.head_dim, config_.rope_theta);
    row_positions_ = false;
    return;
  }
  // The local-attention control sees its shard as a sequence of its own, indexed locally.
  DocumentBatch ring_list;
  if (options_.local_attention) {
    std::vector<std::vector<std::int64_t>> local;
    for (const auto& row : rows) local.push_back(local_document_starts(positions_, row));
    ring_list = pad_document_lists(local, local_len_);
  } else {
    ring_list = pad_document_lists(rows, seq_len_);
  }
  if (ring_list.count > 0) {
    documents_ = {be.load_documents(ring_list.starts), ring_list.count, ring_list.count};
  }
  if (options_.rope_document_positions) {
    std::vector<std::int64_t> all;
    all.reserve(static_cast<std::size_t>(local_tokens()));
    for (const auto& row : rows) {
      const std::vector<std::int64_t> p = document_positions(positions_, row);
      all.insert(all.end(), p.begin(), p.end());
    }
    be.set_rope(all, shape_.head_dim, config_.rope_theta);
    row_positions_ = true;
  } else if (row_positions_ || moved) {
    be.set_rope(positions_, shape_.head_dim, config_.rope_theta);
    row_positions_ = false;
  }
}

template <class B>
Mask Model<B>::causal_mask(const DocumentBatch& documents) const {
  Mask mask;
  mask.causal = true;
  mask.window_left = config_.attention_window;
  if (documents.count > 0) {
    mask.documents = DocumentStarts{documents.starts.data(), documents.count, documents.count};
  }
  return mask;
}

template <class B>
void Model<B>::head_and_loss(bool with_grad, double grad_scale,
                             std::span<std::int32_t> predictions) {
  B& be = *backend_;
  const std::int64_t n = local_tokens(), d = shape_.d_model, v = shape_.vocab;
  const std::int64_t chunk = std::min(n, options_.loss_chunk_tokens);
  for (std::int64_t first = 0; first < n; first += chunk) {
    const std::int64_t rows = std::min(chunk, n - first);
    const Act* h = hf_.data() + first * d;
    timed("loss.head_matmul", [&] {
      be.matmul_forward(logits_.data(), h, weight(head_), {rows, d, v}, Write::overwrite);
    });
    // dlogits over the logits in place.
    timed("loss.cross_entropy", [&] {
      be.cross_entropy(logits_.data(), {rows, v}, with_grad, grad_scale,
                       predictions.empty() ? predictions : predictions.subspan(first, rows), first);
    });
    if (with_grad) {
      timed("loss.head_matmul.backward", [&] {
        be.matmul_backward_weight(grad(head_), logits_.data(), h, {rows, d, v}, Write::add);
        be.matmul_backward_input(dh_.data() + first * d, logits_.data(), weight(head_),
                                 {rows, d, v}, Write::overwrite);
      });
    }
  }
}

template <class B>
cpu::CrossEntropySums Model<B>::forward(const ShardBatch& batch,
                                        std::span<std::int32_t> predictions) {
  run_forward(batch, false);
  head_and_loss(false, 0.0, predictions);
  return backend_->loss_sums();
}

template <class B>
cpu::CrossEntropySums Model<B>::forward_backward(const ShardBatch& batch, double grad_scale,
                                                 std::span<std::int32_t> predictions) {
  run_forward(batch, true);
  B& be = *backend_;
  const std::int64_t n = local_tokens();
  const std::int64_t d = shape_.d_model, hd = shape_.head_dim, vhd = shape_.v_head_dim,
                     hq = shape_.q_heads, hkv = shape_.kv_heads, v = shape_.vocab;
  const std::int64_t row = qkv_width(), o_width = shape_.attention_width();
  head_and_loss(true, grad_scale, predictions);
  timed("rmsnorm.backward", [&] {
    be.rmsnorm_backward(dx_.data(), grad(final_norm_), dh_.data(), block_input(lp_.size()),
                        master(final_norm_), inv_f_.data(), {n, d}, Write::overwrite);
  });
  for (std::size_t l = lp_.size(); l-- > 0;) {
    if (options_.layer_boundary) options_.layer_boundary();
    if (options_.offload) {
      // Block l's input came back beside block l + 1's backward; block l - 1's comes back beside
      // this one, into the buffer block l + 1 used.
      if (!resident_input(l)) {
        timed("offload.wait", [&] {
          be.wait_transfer(input_transfer(l));
          if (offloads_attention()) be.wait_transfer(attention_transfer(l));
        });
      }
      if (l >= 1 && !resident_input(l - 1)) {
        be.prefetch(block_input(l - 1), host_in_[l - 1].data(), n * d * sizeof(Act),
                    input_transfer(l - 1));
        if (offloads_attention()) {
          const std::size_t a = attention_slot(l - 1);
          be.prefetch(attn_o_[a].data(), host_attn_o_[l - 1].data(),
                      attn_o_[a].size() * sizeof(Act), attention_transfer(l - 1));
          be.prefetch(attn_lse_[a].data(), host_attn_lse_[l - 1].data(),
                      attn_lse_[a].size() * sizeof(Acc), attention_transfer(l - 1));
          // Into the Layer that block l + 1's backward used.
          if (offloads_layers()) {
            for (const LayerCopy& c : layer_copies(l - 1)) {
              be.prefetch(c.data, c.host, c.bytes, attention_transfer(l - 1));
            }
          }
        }
      }
    }
    Layer& L = layers_[layer_slot(l)];
    if (options_.recompute) layer_forward(l, L, true);
    const LayerParams& P = lp_[l];
    // A tiled block makes each chunk's hidden activations again just before its backward.
    for (std::int64_t first = 0; first < n; first += mlp_chunk_) {
      const std::int64_t rows = std::min(mlp_chunk_, n - first);
      if (mlp_tiled()) mlp_forward(l, L, first, rows, false);
      mlp_backward(l, L, first, rows);
    }
    // x_mid = x_in + o W_o^T
    timed("matmul.wo.backward", [&] {
      be.matmul_backward_weight(grad(P.wo), dx_.data(), attn_o_[attention_slot(l)].data(),
                                {n, o_width, d}, Write::add);
      be.matmul_backward_input(dout_.data(), dx_.data(), weight(P.wo), {n, o_width, d},
                               Write::overwrite);
    });
    const RingForwardArgs fwd = ring_forward_args(l, L);
    Acc* dqkv_acc;
    if constexpr (std::is_same_v<Act, Acc>) {
      dqkv_acc = dqkv_.data();
    } else {
      dqkv_acc = dqkv_acc_.data();
    }
    RingBackwardArgs args;
    args.q = fwd.q;
    args.k = fwd.k;
    args.v = fwd.v;
    args.o = fwd.o;
    args.lse = fwd.lse;
    args.dout = view(dout_.data(), B::act_dtype, hq, vhd, o_width);
    args.dq = view(dqkv_acc, B::acc_dtype, hq, hd, row);
    // One cp rank where Act is narrower: the ring's one block call writes dK and dV rounded
    // straight into dqkv_, with k's rotation already undone, which spares the RoPE backward a
    // pass over dK and its fp32 copies.
    // The key rotation's table is one row's: not where each row rotates by its own positions.
    const bool rounded_keys =
        !std::is_same_v<Act, Acc> && cp_->size() == 1 && (!row_positions_ || batch_ == 1);
    if (rounded_keys) {
      args.dk = view(dqkv_.data() + hq * hd, B::act_dtype, hkv, hd, row);
      args.dv = view(dqkv_.data() + (hq + hkv) * hd, B::act_dtype, hkv, vhd, row);
      if constexpr (!std::is_same_v<Act, Acc>) args.key_rotation = be.key_rotation();
    } else {
      args.dk = view(dqkv_acc + hq * hd, B::acc_dtype, hkv, hd, row);
      args.dv = view(dqkv_acc + (hq + hkv) * hd, B::acc_dtype, hkv, vhd, row);
    }
    args.scale = fwd.scale;
    args.causal = true;
    args.window_left = fwd.window_left;
    args.documents = fwd.documents;
    args.deterministic = options_.deterministic || B::memory == Memory::host;
    args.stream = fwd.stream;
    args.scratch = fwd.scratch;
    timed("attention.backward", [&] { ring_.backward(args); });
    if constexpr (std::is_same_v<Act, Acc>) {
      timed("rope.backward", [&] { be.rope_backward(dqkv_.data(), {n, hq + hkv, hd, row}); });
    } else if (rounded_keys) {
      // q's heads from Acc; k's and v's are final.
      timed("rope.backward",
            [&] { be.rope_backward_heads(dqkv_.data(), dqkv_acc, {n, hq, hd, row}); });
    } else {
      // One rotation over q's and k's hq + hkv heads, with v's converted to Act in the same pass.
      timed("rope.backward", [&] {
        be.rope_backward(dqkv_.data(), dqkv_acc, {n, hq + hkv, hd, row});
      });
    }
    timed("matmul.qkv.backward", [&] {
      be.matmul_backward_weight(grad(P.wqkv), dqkv_.data(), L.h1.data(), {n, d, row}, Write::add);
      be.matmul_backward_input(dh_.data(), dqkv_.data(), weight(P.wqkv), {n, d, row},
                               Write::overwrite);
    });
    timed("rmsnorm.backward", [&] {
      be.rmsnorm_backward(dx_.data(), grad(P.attn_norm), dh_.data(), block_input(l),
                          master(P.attn_norm), L.inv1.data(), {n, d}, Write::add);
    });
  }
  timed("embedding.backward", [&] {
    be.embedding_backward(grad(emb_), dx_.data(), {n, v, d}, options_.deterministic);
  });
  // Asked for last: on a GPU every op of the step is queued by then.
  return be.loss_sums();
}

template <class B>
double Model<B>::loss_and_gradients(const ShardBatch& batch) {
  double weight = 0.0;
  for (const float w : batch.loss_mask) weight += w;
  host_all_reduce_sum(*cp_, &weight, 1);
  if (!(weight > 0.0))
    ringattn::detail::fail("Model::loss_and_gradients", "the loss mask is all zero");
  cpu::CrossEntropySums sums = forward_backward(batch, 1.0 / weight);
  double loss = sums.loss_sum;
  host_all_reduce_sum(*cp_, &loss, 1);
  return loss / weight;
}

template <class B>
void Model<B>::all_reduce_gradients() {
  if (grad_comm_ && grad_comm_->size() > 1) {
    timed("grad.allreduce", [&] {
      grad_comm_->all_reduce_sum(grads_.data(), grads_.size(), B::master_dtype, backend_->stream());
    });
  }
}

template <class B>
std::string Model<B>::first_non_finite_gradient() {
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    if (!std::isfinite(backend_->sum_of_squares(grad(i), infos_[i].elements))) {
      return infos_[i].name;
    }
  }
  return {};
}

template <class B>
std::string Model<B>::first_non_finite_tensor() {
  B& be = *backend_;
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    if (!std::isfinite(be.sum_of_squares(master(i), infos_[i].elements))) {
      return "parameter " + infos_[i].name;
    }
  }
  const std::int64_t n = local_tokens();
  const std::int64_t d = shape_.d_model, f = shape_.ffn_hidden;
  const std::int64_t row = qkv_width(), o_width = shape_.attention_width();
  const auto finite = [&](const Act* data, std::int64_t count) {
    return be.all_finite(data, count);
  };
  // Block l's input: on the device, or with offload in its host copy (the last two blocks' stay).
  const auto input_finite = [&](std::size_t l) {
    if (!options_.offload || l == lp_.size() || resident_input(l)) {
      return finite(block_input(l), n * d);
    }
    return be.host_all_finite(host_in_[l].data(), n * d);
  };
  // Block l's attention output, likewise.
  const auto attention_finite = [&](std::size_t l) {
    if (offloads_attention() && !resident_input(l)) {
      return be.host_all_finite(host_attn_o_[l].data(), n * o_width);
    }
    return finite(attn_o_[attention_slot(l)].data(), n * o_width);
  };
  if (!input_finite(0)) return "tok_embedding output";
  for (std::size_t l = 0; l < lp_.size(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    if (!options_.recompute) {
      // The feed-forward's hidden activations are kept only where the block is not in chunks;
      // with the offload, block l's are in its host copy (but the last two blocks').
      const bool host = offloads_layers() && !resident_input(l);
      const Layer& L = layers_[layer_slot(l)];
      const auto at = [&](Buffer<Act> Layer::*data, HostBuffer<Act> HostLayer::*copy) {
        return host ? static_cast<const Act*>((host_layers_[l].*copy).data())
                    : static_cast<const Act*>((L.*data).data());
      };
      const std::pair<const Act*, std::int64_t> kept[] = {
          {at(&Layer::h1, &HostLayer::h1), n * d},   {at(&Layer::qkv, &HostLayer::qkv), n * row},
          {at(&Layer::x_mid, &HostLayer::x_mid), n * d}, {at(&Layer::h2, &HostLayer::h2), n * d},
          {at(&Layer::gu, &HostLayer::gu), n * 2 * f}, {at(&Layer::act, &HostLayer::act), n * f}};
      const char* names[] = {"attn_norm output", "wqkv output (after RoPE)",
                             "attention residual", "mlp_norm output", "w_gate_up output",
                             "swiglu output"};
      for (std::size_t k = 0; k < (mlp_tiled() ? 3 : std::size(names)); ++k) {
        if (k == 2 && !attention_finite(l)) return p + "attention output";
        const auto [data, count] = kept[k];
        if (!(host ? be.host_all_finite(data, count) : finite(data, count))) return p + names[k];
      }
    } else if (keeps_attention() && !attention_finite(l)) {
      return p + "attention output";  // the one activation of a block that recomputation keeps
    }
    if (!input_finite(l + 1)) return p + "output";
  }
  if (!finite(hf_.data(), n * d)) return "final_norm output";
  return {};
}

// Rank `rank`'s share of the flat parameters under shard_optimizer: equal parts of grad_comm_'s
// ranks, starting on 64-element (256-byte) boundaries.
template <class B>
std::pair<std::int64_t, std::int64_t> Model<B>::share_of(int rank) const {
  const std::int64_t count = offsets_.back(), ranks = grad_comm_->size();
  constexpr std::int64_t kAlignment = 64;
  const auto start = [&](std::int64_t r) {
    return r == ranks ? count : count * r / ranks / kAlignment * kAlignment;
  };
  return {start(rank), start(rank + 1)};
}

template <class B>
double Model<B>::clip_and_adamw(const cpu::AdamWHyper& hyper, std::int64_t step,
                                double max_norm) {
  timed("grad.norm", [&] { backend_->queue_clip(grads_.data(), offsets_.back(), max_norm); });
  timed("adamw", [&] {
    if (shard_segments_.empty()) return;
    Act* copy = nullptr;
    if constexpr (!std::is_same_v<Act, Master>) copy = weights_.data() + shard_first_;
    backend_->adamw_clipped(params_.data() + shard_first_, copy, grads_.data() + shard_first_,
                            adam_m_.data(), adam_v_.data(), shard_segments_, hyper, step);
  });
  if (sharded()) {
    // Each rank zeroes the weights outside its share; their sum over the ranks is then every
    // share's update everywhere (x + 0 is x, but for the sign of a zero).
    timed("adamw.gather", [&] {
      const std::int64_t count = offsets_.back();
      backend_->fill_zero(params_.data(), shard_first_);
      backend_->fill_zero(params_.data() + shard_end_, count - shard_end_);
      grad_comm_->all_reduce_sum(params_.data(), count, B::master_dtype, backend_->stream());
      refresh_weights();
    });
  }
  return backend_->clip_total();
}

template <class B>
void Model<B>::export_state(std::vector<float>& params, std::vector<float>& m,
                            std::vector<float>& v) {
  const std::int64_t count = offsets_.back();
  params.resize(count);
  m.resize(count);
  v.resize(count);
  backend_->download(params.data(), params_.data(), count);
  if (!sharded()) {
    backend_->download(m.data(), adam_m_.data(), count);
    backend_->download(v.data(), adam_v_.data(), count);
    return;
  }
  // Every rank's share of the moments, gathered on the host in parts of the widest share.
  const int ranks = grad_comm_->size();
  std::int64_t widest = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto [first, end] = share_of(r);
    widest = std::max(widest, end - first);
  }
  std::vector<float> mine(widest), all(static_cast<std::size_t>(widest) * ranks);
  for (auto [moments, out] : {std::pair{&adam_m_, &m}, std::pair{&adam_v_, &v}}) {
    backend_->download(mine.data(), moments->data(), shard_end_ - shard_first_);
    grad_comm_->host_all_gather(mine.data(), mine.size() * sizeof(float), all.data());
    for (int r = 0; r < ranks; ++r) {
      const auto [first, end] = share_of(r);
      std::copy_n(all.begin() + r * widest, end - first, out->begin() + first);
    }
  }
}

template <class B>
void Model<B>::import_state(const std::vector<float>& params, const std::vector<float>& m,
                            const std::vector<float>& v) {
  const std::int64_t count = offsets_.back();
  for (const auto* s : {&params, &m, &v}) {
    if (static_cast<std::int64_t>(s->size()) != count) {
      ringattn::detail::fail("Model::import_state", "a state vector holds ", s->size(),
                             " values; the model has ", count, " parameters");
    }
  }
  backend_->upload(params_.data(), params.data(), count);
  backend_->upload(adam_m_.data(), m.data() + shard_first_, shard_end_ - shard_first_);
  backend_->upload(adam_v_.data(), v.data() + shard_first_, shard_end_ - shard_first_);
  refresh_weights();
}

template <class B>
void Model<B>::export_gradients(std::vector<float>& grads) {
  grads.resize(offsets_.back());
  backend_->download(grads.data(), grads_.data(), offsets_.back());
}

template <class B>
double Model<B>::device_memory_mib() {
  return backend_->memory_mib();
}

}  // namespace ringattn::train
