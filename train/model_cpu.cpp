#include "train/model_cpu.hpp"

#include <cmath>
#include <random>
#include <string>

#include "ringattn/error.hpp"
#include "train/op_embedding.hpp"
#include "train/op_matmul.hpp"
#include "train/op_residual.hpp"
#include "train/op_rmsnorm.hpp"
#include "train/op_rope.hpp"
#include "train/op_swiglu.hpp"

namespace ringattn::train {

ModelShape model_shape(const ModelConfig& c) {
  ModelShape s;
  s.vocab = c.vocab_size;
  s.d_model = c.d_model;
  s.layers = c.n_layers;
  s.q_heads = c.n_heads;
  s.kv_heads = c.n_kv_heads;
  s.head_dim = c.resolved_head_dim();
  s.ffn_hidden = c.ffn_hidden;
  s.tied_embeddings = c.tied_embeddings;
  return s;
}

namespace {

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}

template <typename T>
std::span<const T> cs(const std::vector<T>& v) {
  return {v.data(), v.size()};
}
template <typename T>
std::span<T> ms(std::vector<T>& v) {
  return {v.data(), v.size()};
}

}  // namespace

template <typename T>
CpuModel<T>::CpuModel(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len,
                      std::shared_ptr<Communicator> cp_comm, SequenceLayoutKind layout)
    : shape_(model_shape(config)),
      config_(config),
      batch_(batch),
      seq_len_(seq_len),
      local_len_(0),
      cp_(cp_comm),
      ring_(cp_comm, layout),
      infos_(parameter_list(shape_)) {
  if (batch <= 0 || seq_len <= 0) {
    ringattn::detail::fail("CpuModel", "batch ", batch, " and seq_len ", seq_len, " must be > 0");
  }
  std::int64_t offset = 0;
  for (const ParameterInfo& p : infos_) {
    offsets_.push_back(offset);
    offset += p.elements;
  }
  offsets_.push_back(offset);
  params_.assign(offset, T(0));
  grads_.assign(offset, T(0));
  const auto find = [&](const std::string& name) {
    for (std::size_t i = 0; i < infos_.size(); ++i) {
      if (infos_[i].name == name) return i;
    }
    ringattn::detail::fail("CpuModel", "no parameter ", name);
  };
  emb_ = find("tok_embedding");
  final_norm_ = find("final_norm");
  head_ = shape_.tied_embeddings ? emb_ : find("lm_head");
  for (std::int64_t l = 0; l < shape_.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    lp_.push_back({find(p + "attn_norm"), find(p + "wqkv"), find(p + "wo"), find(p + "mlp_norm"),
                   find(p + "w_gate_up"), find(p + "w_down")});
  }
  positions_ = ring_.global_positions(seq_len);  // throws when seq_len does not split
  local_len_ = static_cast<std::int64_t>(positions_.size());
  for (std::int64_t b = 0; b < batch_; ++b) {
    token_positions_.insert(token_positions_.end(), positions_.begin(), positions_.end());
  }
  const std::int64_t n = batch_ * local_len_;
  const std::int64_t d = shape_.d_model, hd = shape_.head_dim;
  const std::int64_t row = (shape_.q_heads + 2 * shape_.kv_heads) * hd;
  layers_.resize(shape_.layers);
  for (Layer& L : layers_) {
    L.x_in.resize(n * d);
    L.inv1.resize(n);
    L.h1.resize(n * d);
    L.qkv.resize(n * row);
    L.o.resize(n * shape_.q_heads * hd);
    L.lse.resize(n * shape_.q_heads);
    L.x_mid.resize(n * d);
    L.inv2.resize(n);
    L.h2.resize(n * d);
    L.gu.resize(n * 2 * shape_.ffn_hidden);
    L.act.resize(n * shape_.ffn_hidden);
  }
  x_final_.resize(n * d);
  inv_f_.resize(n);
  hf_.resize(n * d);
  logits_.resize(n * shape_.vocab);
  losses_.resize(n);
  weights_.resize(n);
  predictions_.resize(n);
}

template <typename T>
std::span<T> CpuModel<T>::parameter(std::size_t i) {
  return std::span<T>(params_).subspan(offsets_[i], infos_[i].elements);
}

template <typename T>
std::span<T> CpuModel<T>::gradient(std::size_t i) {
  return std::span<T>(grads_).subspan(offsets_[i], infos_[i].elements);
}

template <typename T>
void CpuModel<T>::init(std::uint64_t seed) {
  // Box-Muller over mt19937_64: the same doubles on every platform and for both element types.
  std::mt19937_64 rng(seed);
  const auto uniform = [&] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    std::span<T> p = parameter(i);
    if (infos_[i].shape.size() == 1) {
      for (T& x : p) x = T(1);
      continue;
    }
    for (std::size_t j = 0; j < p.size(); j += 2) {
      const double r = std::sqrt(-2.0 * std::log(uniform()));
      const double a = 2.0 * M_PI * uniform();
      p[j] = static_cast<T>(config_.init_std * r * std::cos(a));
      if (j + 1 < p.size()) p[j + 1] = static_cast<T>(config_.init_std * r * std::sin(a));
    }
  }
  zero_grad();
}

template <typename T>
void CpuModel<T>::zero_grad() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <typename T>
void CpuModel<T>::run_forward(const ShardBatch& batch) {
  const std::int64_t n = batch_ * local_len_;
  const auto check = [&](std::size_t size, const char* name) {
    if (static_cast<std::int64_t>(size) != n) {
      ringattn::detail::fail("CpuModel::forward", name, " has ", size,
                             " tokens; expected batch * Sl = ", n);
    }
  };
  check(batch.inputs.size(), "inputs");
  check(batch.targets.size(), "targets");
  check(batch.loss_mask.size(), "loss_mask");
  const std::int64_t d = shape_.d_model, hd = shape_.head_dim, hq = shape_.q_heads,
                     hkv = shape_.kv_heads, f = shape_.ffn_hidden, v = shape_.vocab;
  const std::int64_t row = (hq + 2 * hkv) * hd;
  const DType dt = dtype_of<T>();
  const double norm_eps = config_.norm_eps;

  cpu::embedding_forward<T>(ms(layers_.empty() ? x_final_ : layers_[0].x_in), batch.inputs,
                            param_c(emb_), {n, v, d});
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = layers_[l];
    const LayerParams& P = lp_[l];
    cpu::rmsnorm_forward<T>(ms(L.h1), ms(L.inv1), cs(L.x_in), param_c(P.attn_norm), {n, d},
                            norm_eps);
    cpu::matmul_forward<T>(ms(L.qkv), cs(L.h1), param_c(P.wqkv), {n, d, row});
    cpu::rope_forward<T>(ms(L.qkv), token_positions_, {n, hq, hd, row}, config_.rope_theta);
    cpu::rope_forward<T>(ms(L.qkv).subspan(hq * hd), token_positions_, {n, hkv, hd, row},
                         config_.rope_theta);
    T* qkv = L.qkv.data();
    const auto view = [&](T* data, std::int64_t heads) {
      return TensorView::contiguous(data, dt, {batch_, local_len_, heads, hd})
          .with_strides({local_len_ * row, row, hd, 1});
    };
    RingForwardArgs args;
    args.q = view(qkv, hq);
    args.k = view(qkv + hq * hd, hkv);
    args.v = view(qkv + (hq + hkv) * hd, hkv);
    args.o = TensorView::contiguous(L.o.data(), dt, {batch_, local_len_, hq, hd});
    args.lse = TensorView::contiguous(L.lse.data(), dt, {batch_, hq, local_len_});
    args.scale = 1.0 / std::sqrt(static_cast<double>(hd));
    args.causal = true;
    ring_.forward(args);
    // x_mid = x_in + o W_o^T
    L.x_mid = L.x_in;
    cpu::matmul_forward<T>(ms(L.x_mid), cs(L.o), param_c(P.wo), {n, hq * hd, d}, Write::add);
    cpu::rmsnorm_forward<T>(ms(L.h2), ms(L.inv2), cs(L.x_mid), param_c(P.mlp_norm), {n, d},
                            norm_eps);
    cpu::matmul_forward<T>(ms(L.gu), cs(L.h2), param_c(P.w_gate_up), {n, d, 2 * f});
    cpu::swiglu_forward<T>(ms(L.act), cs(L.gu), {n, f});
    std::vector<T>& out = l + 1 < layers_.size() ? layers_[l + 1].x_in : x_final_;
    out = L.x_mid;
    cpu::matmul_forward<T>(ms(out), cs(L.act), param_c(P.w_down), {n, f, d}, Write::add);
  }
  cpu::rmsnorm_forward<T>(ms(hf_), ms(inv_f_), cs(x_final_), param_c(final_norm_), {n, d},
                          norm_eps);
  cpu::matmul_forward<T>(ms(logits_), cs(hf_), param_c(head_), {n, d, v});
  for (std::int64_t i = 0; i < n; ++i) weights_[i] = static_cast<T>(batch.loss_mask[i]);
}

template <typename T>
cpu::CrossEntropySums CpuModel<T>::forward(const ShardBatch& batch,
                                           std::span<std::int32_t> predictions) {
  run_forward(batch);
  const std::int64_t n = batch_ * local_len_;
  const cpu::CrossEntropySums sums = cpu::cross_entropy_forward<T>(
      ms(losses_), ms(predictions_), cs(logits_), batch.targets, cs(weights_), {n, shape_.vocab});
  if (!predictions.empty())
    std::copy(predictions_.begin(), predictions_.end(), predictions.begin());
  return sums;
}

template <typename T>
cpu::CrossEntropySums CpuModel<T>::forward_backward(const ShardBatch& batch, double grad_scale,
                                                    std::span<std::int32_t> predictions) {
  run_forward(batch);
  const std::int64_t n = batch_ * local_len_;
  const std::int64_t d = shape_.d_model, hd = shape_.head_dim, hq = shape_.q_heads,
                     hkv = shape_.kv_heads, f = shape_.ffn_hidden, v = shape_.vocab;
  const std::int64_t row = (hq + 2 * hkv) * hd;
  const DType dt = dtype_of<T>();
  // dlogits over the logits in place.
  const cpu::CrossEntropySums sums = cpu::cross_entropy_forward_backward<T>(
      ms(logits_), ms(losses_), ms(predictions_), cs(logits_), batch.targets, cs(weights_), {n, v},
      grad_scale);
  if (!predictions.empty())
    std::copy(predictions_.begin(), predictions_.end(), predictions.begin());
  const std::span<const T> dlogits = cs(logits_);

  std::vector<T> dh(n * d), dx(n * d);
  cpu::matmul_backward_weight<T>(gradient(head_), dlogits, cs(hf_), {n, d, v}, Write::add);
  cpu::matmul_backward_input<T>(ms(dh), dlogits, param_c(head_), {n, d, v});
  cpu::rmsnorm_backward<T>(ms(dx), gradient(final_norm_), cs(dh), cs(x_final_),
                           param_c(final_norm_), cs(inv_f_), {n, d}, Write::overwrite, Write::add);
  std::vector<T> dact(n * f), dgu(n * 2 * f), dqkv(n * row), dout(n * hq * hd);
  for (std::size_t l = layers_.size(); l-- > 0;) {
    Layer& L = layers_[l];
    const LayerParams& P = lp_[l];
    // out = x_mid + act W_down^T
    cpu::matmul_backward_weight<T>(gradient(P.w_down), cs(dx), cs(L.act), {n, f, d}, Write::add);
    cpu::matmul_backward_input<T>(ms(dact), cs(dx), param_c(P.w_down), {n, f, d});
    cpu::swiglu_backward<T>(ms(dgu), cs(dact), cs(L.gu), {n, f});
    cpu::matmul_backward_weight<T>(gradient(P.w_gate_up), cs(dgu), cs(L.h2), {n, d, 2 * f},
                                   Write::add);
    cpu::matmul_backward_input<T>(ms(dh), cs(dgu), param_c(P.w_gate_up), {n, d, 2 * f});
    cpu::rmsnorm_backward<T>(ms(dx), gradient(P.mlp_norm), cs(dh), cs(L.x_mid), param_c(P.mlp_norm),
                             cs(L.inv2), {n, d}, Write::add, Write::add);
    // x_mid = x_in + o W_o^T
    cpu::matmul_backward_weight<T>(gradient(P.wo), cs(dx), cs(L.o), {n, hq * hd, d}, Write::add);
    cpu::matmul_backward_input<T>(ms(dout), cs(dx), param_c(P.wo), {n, hq * hd, d});
    const auto view = [&](T* data, std::int64_t heads) {
      return TensorView::contiguous(data, dt, {batch_, local_len_, heads, hd})
          .with_strides({local_len_ * row, row, hd, 1});
    };
    RingBackwardArgs args;
    args.q = view(L.qkv.data(), hq);
    args.k = view(L.qkv.data() + hq * hd, hkv);
    args.v = view(L.qkv.data() + (hq + hkv) * hd, hkv);
    args.o = TensorView::contiguous(L.o.data(), dt, {batch_, local_len_, hq, hd});
    args.lse = TensorView::contiguous(L.lse.data(), dt, {batch_, hq, local_len_});
    args.dout = TensorView::contiguous(dout.data(), dt, {batch_, local_len_, hq, hd});
    args.dq = view(dqkv.data(), hq);
    args.dk = view(dqkv.data() + hq * hd, hkv);
    args.dv = view(dqkv.data() + (hq + hkv) * hd, hkv);
    args.scale = 1.0 / std::sqrt(static_cast<double>(hd));
    args.causal = true;
    args.deterministic = true;
    ring_.backward(args);
    cpu::rope_backward<T>(ms(dqkv), token_positions_, {n, hq, hd, row}, config_.rope_theta);
    cpu::rope_backward<T>(ms(dqkv).subspan(hq * hd), token_positions_, {n, hkv, hd, row},
                          config_.rope_theta);
    cpu::matmul_backward_weight<T>(gradient(P.wqkv), cs(dqkv), cs(L.h1), {n, d, row}, Write::add);
    cpu::matmul_backward_input<T>(ms(dh), cs(dqkv), param_c(P.wqkv), {n, d, row});
    cpu::rmsnorm_backward<T>(ms(dx), gradient(P.attn_norm), cs(dh), cs(L.x_in),
                             param_c(P.attn_norm), cs(L.inv1), {n, d}, Write::add, Write::add);
  }
  cpu::embedding_backward<T>(gradient(emb_), batch.inputs, cs(dx), {n, v, d}, Write::add);
  return sums;
}

template <typename T>
double CpuModel<T>::loss_and_gradients(const ShardBatch& batch) {
  double weight = 0.0;
  for (const float w : batch.loss_mask) weight += w;
  cp_->all_reduce_sum(&weight, 1, DType::f64, nullptr);
  if (!(weight > 0.0))
    ringattn::detail::fail("CpuModel::loss_and_gradients", "the loss mask is all zero");
  cpu::CrossEntropySums sums = forward_backward(batch, 1.0 / weight);
  double loss = sums.loss_sum;
  cp_->all_reduce_sum(&loss, 1, DType::f64, nullptr);
  return loss / weight;
}

template class CpuModel<float>;
template class CpuModel<double>;

}  // namespace ringattn::train
