// The CPU backend of the model (train/model.hpp): host buffers and the ops of train/op_*.hpp, in
// fp32 for training and fp64 for gradient checks. Activations, statistics and parameters all have
// the element type T; the ring runs the CPU flash block over MPI. Every op is done when it returns,
// so the profile's intervals are steady_clock readings around the calls.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringattn/error.hpp"
#include "ringattn/tensor.hpp"
#include "train/model.hpp"
#include "train/op_adamw.hpp"
#include "train/op_cross_entropy.hpp"
#include "train/op_embedding.hpp"
#include "train/op_matmul.hpp"
#include "train/op_rmsnorm.hpp"
#include "train/op_rope.hpp"
#include "train/op_swiglu.hpp"

namespace ringattn::train {

template <typename T>
class CpuBackend {
 public:
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  using Act = T;
  using Acc = T;
  using Master = T;
  template <typename E>
  using Buffer = std::vector<E>;
  static constexpr DType act_dtype = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  static constexpr DType acc_dtype = act_dtype;
  static constexpr DType master_dtype = act_dtype;
  static constexpr Memory memory = Memory::host;
  static std::string name() { return std::is_same_v<T, double> ? "cpu fp64" : "cpu fp32"; }

  void* stream() { return nullptr; }

  // ---- data ----
  void load_batch(const ShardBatch& batch, std::int64_t /*vocab: the ops check the ids*/) {
    batch_ = batch;
    weights_.assign(batch.loss_mask.begin(), batch.loss_mask.end());
    pending_sums_ = {};
  }
  // The attention's document starts: a host copy, valid until the next call.
  const std::int64_t* load_documents(std::span<const std::int64_t> starts) {
    documents_.assign(starts.begin(), starts.end());
    return documents_.data();
  }
  void fill_zero(T* data, std::int64_t count) { std::fill_n(data, count, T(0)); }
  void copy(T* dst, const T* src, std::int64_t count) { std::copy_n(src, count, dst); }
  void upload(T* dst, const float* src, std::int64_t count) { std::copy_n(src, count, dst); }
  void upload_wide(T* dst, const double* src, std::int64_t count) {
    for (std::int64_t i = 0; i < count; ++i) dst[i] = static_cast<T>(src[i]);
  }
  void download(float* dst, const T* src, std::int64_t count) {
    for (std::int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]);
  }
  double memory_mib() { return 0.0; }
  // The offload (ModelOptions::offload): host-to-host copies, done when they return, in the order
  // and slots the GPU's asynchronous ones take.
  template <typename E>
  using HostBuffer = std::vector<E>;
  void offload(void* host, const void* data, std::size_t bytes, int /*slot*/) {
    std::memcpy(host, data, bytes);
  }
  void prefetch(void* data, const void* host, std::size_t bytes, int /*slot*/) {
    std::memcpy(data, host, bytes);
  }
  void wait_transfer(int /*slot*/) {}
  bool host_all_finite(const T* host, std::int64_t count) {
    return std::all_of(host, host + count, [](T x) { return std::isfinite(x); });
  }

  // ---- ops ----
  void embedding_forward(T* out, const T* table, const cpu::EmbeddingShape& s) {
    cpu::embedding_forward<T>(span(out, s.tokens * s.dim), batch_.inputs,
                              span(table, s.vocab * s.dim), s);
  }
  void embedding_backward(T* dtable, const T* dout, const cpu::EmbeddingShape& s,
                          bool /*always deterministic*/) {
    cpu::embedding_backward<T>(span(dtable, s.vocab * s.dim), batch_.inputs,
                               span(dout, s.tokens * s.dim), s, Write::add);
  }
  void rmsnorm_forward(T* y, T* inv, const T* x, const T* g, const cpu::RmsNormShape& s,
                       double eps) {
    const std::int64_t n = s.rows * s.dim;
    cpu::rmsnorm_forward<T>(span(y, n), span(inv, s.rows), span(x, n), span(g, s.dim), s, eps);
  }
  void rmsnorm_backward(T* dx, T* dg, const T* dy, const T* x, const T* g, const T* inv,
                        const cpu::RmsNormShape& s, Write dx_write) {
    const std::int64_t n = s.rows * s.dim;
    cpu::rmsnorm_backward<T>(span(dx, n), span(dg, s.dim), span(dy, n), span(x, n),
                             span(g, s.dim), span(inv, s.rows), s, dx_write, Write::add);
  }
  // residual (Write::add): y = residual + x W^T.
  void matmul_forward(T* y, const T* x, const T* w, const cpu::MatmulShape& s, Write write,
                      const T* residual = nullptr) {
    if (residual != nullptr && residual != y) copy(y, residual, s.rows * s.out_features);
    cpu::matmul_forward<T>(span(y, s.rows * s.out_features), span(x, s.rows * s.in_features),
                           span(w, s.out_features * s.in_features), s, write);
  }
  void matmul_backward_input(T* dx, const T* dy, const T* w, const cpu::MatmulShape& s,
                             Write write) {
    cpu::matmul_backward_input<T>(span(dx, s.rows * s.in_features),
                                  span(dy, s.rows * s.out_features),
                                  span(w, s.out_features * s.in_features), s, write);
  }
  void matmul_backward_weight(T* dw, const T* dy, const T* x, const cpu::MatmulShape& s,
                              Write write) {
    cpu::matmul_backward_weight<T>(span(dw, s.out_features * s.in_features),
                                   span(dy, s.rows * s.out_features),
                                   span(x, s.rows * s.in_features), s, write);
  }
  // The positions of one sequence's local tokens, which every row of a batch repeats, or of all
  // the batch's tokens.
  void set_rope(const std::vector<std::int64_t>& positions, std::int64_t /*head_dim*/,
                double theta) {
    positions_ = positions;
    token_positions_.clear();
    theta_ = theta;
  }
  void rope_forward(T* x, const cpu::RopeShape& s) {
    cpu::rope_forward<T>(span(x, extent(s)), token_positions(s.tokens), s, theta_);
  }
  void rope_backward(T* dx, const cpu::RopeShape& s) {
    cpu::rope_backward<T>(span(dx, extent(s)), token_positions(s.tokens), s, theta_);
  }
  void swiglu_forward(T* out, const T* gu, const cpu::SwigluShape& s) {
    cpu::swiglu_forward<T>(span(out, s.rows * s.hidden), span(gu, 2 * s.rows * s.hidden), s);
  }
  void swiglu_backward(T* dgu, const T* dout, const T* gu, const cpu::SwigluShape& s) {
    cpu::swiglu_backward<T>(span(dgu, 2 * s.rows * s.hidden), span(dout, s.rows * s.hidden),
                            span(gu, 2 * s.rows * s.hidden), s);
  }
  // The loss of the loaded batch's tokens [first, first + s.tokens) from their logits; with_grad
  // writes the gradient of scale * loss_sum over the logits. The sums wait for loss_sums().
  void cross_entropy(T* logits, const cpu::CrossEntropyShape& s, bool with_grad, double scale,
                     std::span<std::int32_t> predictions, std::int64_t first) {
    losses_.resize(s.tokens);
    predictions_.resize(s.tokens);
    const std::span<T> all = span(logits, s.tokens * s.vocab);
    const auto targets = batch_.targets.subspan(first, s.tokens);
    const std::span<const T> weights = std::span<const T>(weights_).subspan(first, s.tokens);
    pending_sums_ +=
        with_grad ? cpu::cross_entropy_forward_backward<T>(all, losses_, predictions_, all,
                                                           targets, weights, s, scale)
                  : cpu::cross_entropy_forward<T>(losses_, predictions_, all, targets, weights, s);
    if (!predictions.empty()) std::copy(predictions_.begin(), predictions_.end(), predictions.begin());
  }
  // The sums of the cross_entropy calls since the last loss_sums(), each call's added in order.
  cpu::CrossEntropySums loss_sums() { return std::exchange(pending_sums_, {}); }

  bool all_finite(const T* data, std::int64_t count) {
    for (std::int64_t i = 0; i < count; ++i) {
      if (!std::isfinite(data[i])) return false;
    }
    return true;
  }

  // ---- optimizer ----
  double sum_of_squares(const T* grads, std::int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
      const std::span<const float> all[] = {span(grads, count)};
      return cpu::sum_of_squares(all);
    } else {
      double sum = 0.0;
      for (std::int64_t i = 0; i < count; ++i) sum += grads[i] * grads[i];
      return sum;
    }
  }
  void adamw(T* params, T* /*no low-precision copy*/, const T* grads, T* m, T* v,
             std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& hyper,
             std::int64_t step, float grad_scale) {
    if constexpr (std::is_same_v<T, float>) {
      for (const cpu::AdamWSegment& segment : segments) {
        const std::int64_t count = segment.count;
        std::span<const float> g = span(grads, count);
        if (grad_scale != 1.0f) {
          scaled_.assign(g.begin(), g.end());
          for (float& x : scaled_) x *= grad_scale;
          g = scaled_;
        }
        cpu::adamw_step(span(params, count), g, span(m, count), span(v, count), hyper, step,
                        segment.decay);
        params += count;
        grads += count;
        m += count;
        v += count;
      }
    } else {
      ringattn::detail::fail("CpuBackend<double>::adamw",
                             "the fp64 model is for gradient checks; it has no optimizer");
    }
  }
  // The CUDA backend's clip without a wait, here at once: the sum of squares and
  // cpu::step_clip_factor of it, which adamw_clipped uses (no step when it is not finite).
  void queue_clip(const T* grads, std::int64_t count, double max_norm) {
    clip_total_ = sum_of_squares(grads, count);
    clip_factor_ = cpu::step_clip_factor(clip_total_, max_norm);
  }
  void adamw_clipped(T* params, T* params_copy, const T* grads, T* m, T* v,
                     std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& hyper,
                     std::int64_t step) {
    if (!std::isfinite(clip_factor_)) return;
    adamw(params, params_copy, grads, m, v, segments, hyper, step, clip_factor_);
  }
  double clip_total() const { return clip_total_; }

  // ---- profile ----
  void begin_interval(std::size_t i) {
    if (interval_begin_.size() <= i) interval_begin_.resize(i + 1);
    interval_begin_[i] = std::chrono::steady_clock::now();
  }
  void end_interval(std::size_t i) {
    const auto end = std::chrono::steady_clock::now();
    if (interval_ms_.size() <= i) interval_ms_.resize(i + 1);
    interval_ms_[i] = std::chrono::duration<double, std::milli>(end - interval_begin_[i]).count();
  }
  void intervals_ms(std::size_t count, std::vector<double>& ms) {
    ms.assign(interval_ms_.begin(), interval_ms_.begin() + static_cast<std::ptrdiff_t>(count));
  }

 private:
  template <typename E>
  static std::span<E> span(E* data, std::int64_t count) {
    return {data, static_cast<std::size_t>(count)};
  }
  static std::int64_t extent(const cpu::RopeShape& s) {
    return s.tokens > 0 ? (s.tokens - 1) * s.token_stride + s.heads * s.head_dim : 0;
  }
  std::span<const std::int64_t> token_positions(std::int64_t tokens) {
    if (static_cast<std::int64_t>(token_positions_.size()) != tokens) {
      token_positions_.clear();
      const std::int64_t local = static_cast<std::int64_t>(positions_.size());
      for (std::int64_t t = 0; t < tokens; ++t) token_positions_.push_back(positions_[t % local]);
    }
    return token_positions_;
  }

  ShardBatch batch_{};
  std::vector<T> weights_, losses_;
  cpu::CrossEntropySums pending_sums_;
  std::vector<float> scaled_;
  double clip_total_ = 0.0;  // queue_clip's
  float clip_factor_ = 1.0f;
  std::vector<std::int32_t> predictions_;
  std::vector<std::int64_t> positions_, token_positions_, documents_;
  double theta_ = 10000.0;
  std::vector<std::chrono::steady_clock::time_point> interval_begin_;
  std::vector<double> interval_ms_;
};

}  // namespace ringattn::train
