// AdamW and gradient clipping. The step's scalars (bias corrections, the decay factor) are formed
// once in double; the per-element update runs in float, as the CUDA twin does.
#include "train/op_adamw.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "src/thread_pool.hpp"

namespace ringattn::train::cpu {
namespace {

// Elements per task of the elementwise passes and per partial sum of sum_of_squares: the
// partition depends only on the buffer sizes, so the partial sums, and their total, do too.
constexpr std::int64_t kChunkElements = 1 << 16;

void check_unit_interval(std::string_view where, std::string_view name, double value) {
  if (!(value >= 0.0 && value < 1.0)) {
    ringattn::detail::fail(where, name, " is ", value, "; expected a value in [0, 1)");
  }
}

}  // namespace

AdamWScalars adamw_scalars(std::string_view where, const AdamWHyper& h, std::int64_t step,
                           WeightDecay decay, float grad_scale) {
  detail::check_positive(where, "step", step);
  if (!(h.lr >= 0.0) || !std::isfinite(h.lr)) {
    ringattn::detail::fail(where, "hyper.lr is ", h.lr, "; expected a finite value >= 0");
  }
  check_unit_interval(where, "hyper.beta1", h.beta1);
  check_unit_interval(where, "hyper.beta2", h.beta2);
  if (!(h.eps > 0.0) || !std::isfinite(h.eps)) {
    ringattn::detail::fail(where, "hyper.eps is ", h.eps, "; expected a finite value > 0");
  }
  if (!(h.weight_decay >= 0.0) || !std::isfinite(h.weight_decay)) {
    ringattn::detail::fail(where, "hyper.weight_decay is ", h.weight_decay,
                           "; expected a finite value >= 0");
  }
  if (!std::isfinite(grad_scale)) {
    ringattn::detail::fail(where, "grad_scale is ", grad_scale, "; expected a finite value");
  }
  AdamWScalars s{};
  s.beta1 = static_cast<float>(h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta1 = 1.0f - s.beta1;
  s.one_minus_beta2 = 1.0f - s.beta2;
  s.lr = static_cast<float>(h.lr);
  s.eps = static_cast<float>(h.eps);
  const double t = static_cast<double>(step);
  s.correction1 = static_cast<float>(1.0 / (1.0 - std::pow(h.beta1, t)));
  s.correction2 = static_cast<float>(1.0 / (1.0 - std::pow(h.beta2, t)));
  s.keep = decay == WeightDecay::apply ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.grad_scale = grad_scale;
  return s;
}

void adamw_step(std::span<float> params, std::span<const float> grads, std::span<float> m,
                std::span<float> v, const AdamWHyper& h, std::int64_t step, WeightDecay decay) {
  constexpr const char* kWhere = "train::cpu::adamw_step";
  if (params.data() == nullptr) ringattn::detail::fail(kWhere, "params is null");
  const auto n = static_cast<std::int64_t>(params.size());
  detail::check_positive(kWhere, "params.size()", n);
  detail::check_size(kWhere, "grads", grads, n, "params.size()");
  detail::check_size(kWhere, "m", m, n, "params.size()");
  detail::check_size(kWhere, "v", v, n, "params.size()");
  const AdamWScalars s = adamw_scalars(kWhere, h, step, decay, 1.0f);
  ringattn::detail::parallel_for((n + kChunkElements - 1) / kChunkElements, [&](std::int64_t c) {
    const std::int64_t end = std::min(n, (c + 1) * kChunkElements);
    for (std::int64_t i = c * kChunkElements; i < end; ++i) {
      adamw_update(params.data(), grads.data(), m.data(), v.data(), i, s);
    }
  });
}

double sum_of_squares(std::span<const std::span<const float>> buffers) {
  constexpr const char* kWhere = "train::cpu::sum_of_squares";
  // Chunks of every buffer, in order: (buffer, first element).
  struct Chunk {
    std::size_t buffer;
    std::int64_t begin;
  };
  std::vector<Chunk> chunks;
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    const auto n = static_cast<std::int64_t>(buffers[b].size());
    if (n > 0 && buffers[b].data() == nullptr) {
      ringattn::detail::fail(kWhere, "buffers[", b, "] is null with ", n, " elements");
    }
    for (std::int64_t begin = 0; begin < n; begin += kChunkElements) chunks.push_back({b, begin});
  }
  std::vector<double> partial(chunks.size());
  ringattn::detail::parallel_for(static_cast<std::int64_t>(chunks.size()), [&](std::int64_t c) {
    const std::span<const float> buffer = buffers[chunks[c].buffer];
    const std::int64_t end =
        std::min(static_cast<std::int64_t>(buffer.size()), chunks[c].begin + kChunkElements);
    double sum = 0.0;
    for (std::int64_t i = chunks[c].begin; i < end; ++i) sum += double(buffer[i]) * buffer[i];
    partial[c] = sum;
  });
  double total = 0.0;
  for (const double p : partial) total += p;
  return total;
}

double clip_factor(double global_sum_of_squares, double max_norm) {
  constexpr const char* kWhere = "train::cpu::clip_factor";
  if (!(max_norm > 0.0) || !std::isfinite(max_norm)) {
    ringattn::detail::fail(kWhere, "max_norm is ", max_norm, "; expected a finite value > 0");
  }
  if (global_sum_of_squares < 0.0) {
    ringattn::detail::fail(kWhere, "global_sum_of_squares is ", global_sum_of_squares,
                           "; expected >= 0");
  }
  // std::min would turn a NaN into 1 and an inf into 0, hiding the overflow.
  if (!std::isfinite(global_sum_of_squares)) return std::numeric_limits<double>::quiet_NaN();
  return std::min(1.0, max_norm / (std::sqrt(global_sum_of_squares) + 1e-6));
}

void scale_buffers(std::span<const std::span<float>> buffers, float factor) {
  constexpr const char* kWhere = "train::cpu::scale_buffers";
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    if (!buffers[b].empty() && buffers[b].data() == nullptr) {
      ringattn::detail::fail(kWhere, "buffers[", b, "] is null with ", buffers[b].size(),
                             " elements");
    }
  }
  for (const std::span<float> buffer : buffers) {
    const auto n = static_cast<std::int64_t>(buffer.size());
    ringattn::detail::parallel_for((n + kChunkElements - 1) / kChunkElements, [&](std::int64_t c) {
      const std::int64_t end = std::min(n, (c + 1) * kChunkElements);
      for (std::int64_t i = c * kChunkElements; i < end; ++i) buffer[i] *= factor;
    });
  }
}

}  // namespace ringattn::train::cpu
