// The decoder-only transformer on the CPU backend (fp32 for training, fp64 for gradient checks),
// run on this rank's shard of each sequence with ring attention over the context-parallel group.
//
//   embedding -> L x [rmsnorm -> wqkv -> rope(q, k at GLOBAL positions) -> ring attention ->
//   wo -> residual -> rmsnorm -> w_gate_up -> swiglu -> w_down -> residual] -> final rmsnorm ->
//   lm_head (or the tied embedding) -> fused softmax cross-entropy with the loss mask.
//
// Parameters live in one flat buffer with a view per parameter_list() entry, gradients likewise.
// forward_backward ADDS the gradient of grad_scale * (this rank's weighted loss sum) to the
// gradient buffer: the caller zeroes it once per optimizer step, passes grad_scale = 1 / (the
// loss-mask sum over every rank and micro-batch of the step), and all-reduces (sums) the
// gradients over every rank that holds the same parameters (the cp group and the dp replicas).
//
// Every call is collective over the cp communicator (the ring).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "train/config.hpp"
#include "train/model_shapes.hpp"
#include "train/op_cross_entropy.hpp"

namespace ringattn::train {

ModelShape model_shape(const ModelConfig& config);

// This rank's tokens of one micro-batch: [batch, Sl] row-major each (Sl = seq_len / cp).
struct ShardBatch {
  std::span<const std::int32_t> inputs;
  std::span<const std::int32_t> targets;
  std::span<const float> loss_mask;
};

template <typename T>
class CpuModel {
 public:
  CpuModel(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len,
           std::shared_ptr<Communicator> cp_comm, SequenceLayoutKind layout);

  const std::vector<ParameterInfo>& parameter_infos() const { return infos_; }
  std::span<T> parameters() { return params_; }
  std::span<T> gradients() { return grads_; }
  std::span<T> parameter(std::size_t index);
  std::span<T> gradient(std::size_t index);
  std::int64_t local_tokens() const { return batch_ * local_len_; }  // batch * Sl
  std::int64_t local_len() const { return local_len_; }
  const std::vector<std::int64_t>& global_positions() const { return positions_; }  // [Sl]
  Communicator& cp_communicator() { return *cp_; }

  // Normal(0, init_std) weights from the seed (the same on every rank), norm gains 1.
  void init(std::uint64_t seed);
  void zero_grad();

  // The forward only: this rank's sums (loss_sum, weight_sum); predictions [batch * Sl] if given.
  cpu::CrossEntropySums forward(const ShardBatch& batch, std::span<std::int32_t> predictions = {});
  // The forward and the backward; adds grad_scale * d(loss_sum)/d(params) to gradients().
  cpu::CrossEntropySums forward_backward(const ShardBatch& batch, double grad_scale,
                                         std::span<std::int32_t> predictions = {});

  // Convenience for one micro-batch that is the whole step: the weighted mean loss over the cp
  // group (weight sum all-reduced over it), gradients of that mean added (not all-reduced).
  double loss_and_gradients(const ShardBatch& batch);

 private:
  struct Layer {
    std::vector<T> x_in, inv1, h1, qkv, o, lse, x_mid, inv2, h2, gu, act;
  };
  void run_forward(const ShardBatch& batch);
  std::span<const T> param_c(std::size_t i) { return parameter(i); }

  ModelShape shape_;
  ModelConfig config_;
  std::int64_t batch_, seq_len_, local_len_;
  std::shared_ptr<Communicator> cp_;
  RingAttention ring_;
  std::vector<ParameterInfo> infos_;
  std::vector<std::int64_t> offsets_;
  std::vector<T> params_, grads_;
  std::vector<std::int64_t> positions_, token_positions_;
  // indices into infos_
  std::size_t emb_ = 0, final_norm_ = 0, head_ = 0;
  struct LayerParams {
    std::size_t attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down;
  };
  std::vector<LayerParams> lp_;
  // activations
  std::vector<Layer> layers_;
  std::vector<T> x_final_, inv_f_, hf_, logits_, losses_, weights_;
  std::vector<std::int32_t> predictions_;
};

extern template class CpuModel<float>;
extern template class CpuModel<double>;

}  // namespace ringattn::train
