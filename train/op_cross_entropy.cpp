// Cross-entropy fused with softmax. One task per block of rows; each row is read three times from
// cache (max and argmax; the sum of exponentials; the gradient) and written once, so the in-place
// gradient overwrites a row only after its last read. The sum of exponentials is taken around the
// row's maximum (no overflow for any finite logits) and accumulated in double.
#include "train/op_cross_entropy.hpp"

#include <cmath>

namespace ringattn::train::cpu {
namespace {

template <typename T>
void check_args(std::string_view where, std::span<T> losses, std::span<std::int32_t> predictions,
                std::span<const T> logits, std::span<const std::int32_t> targets,
                std::span<const T> weights, const CrossEntropyShape& s) {
  detail::check_positive(where, "shape.tokens", s.tokens);
  detail::check_positive(where, "shape.vocab", s.vocab);
  detail::check_size(where, "losses", losses, s.tokens, "tokens");
  detail::check_size(where, "predictions", predictions, s.tokens, "tokens");
  detail::check_size(where, "logits", logits, s.tokens * s.vocab, "tokens * vocab");
  detail::check_size(where, "targets", targets, s.tokens, "tokens");
  detail::check_size(where, "weights", weights, s.tokens, "tokens");
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    if (targets[t] < 0 || targets[t] >= s.vocab) {
      ringattn::detail::fail(where, "targets[", t, "] is ", targets[t], "; expected an id in [0, ",
                             s.vocab, ")");
    }
    if (!(weights[t] >= T(0)) || !std::isfinite(weights[t])) {
      ringattn::detail::fail(where, "weights[", t, "] is ", weights[t],
                             "; expected a finite value >= 0");
    }
  }
}

// dlogits is empty for the forward alone.
template <typename T>
CrossEntropySums run(std::span<T> dlogits, std::span<T> losses, std::span<std::int32_t> predictions,
                     std::span<const T> logits, std::span<const std::int32_t> targets,
                     std::span<const T> weights, const CrossEntropyShape& s, double scale) {
  const bool backward = !dlogits.empty();
  detail::parallel_rows(s.tokens, s.vocab, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t t = begin; t < end; ++t) {
      const T* row = logits.data() + t * s.vocab;
      std::int64_t argmax = 0;
      for (std::int64_t j = 1; j < s.vocab; ++j) {
        if (row[j] > row[argmax]) argmax = j;
      }
      const T max = row[argmax];
      double sum = 0.0;
      for (std::int64_t j = 0; j < s.vocab; ++j) sum += std::exp(double(row[j]) - double(max));
      const double lse = double(max) + std::log(sum);
      losses[t] = static_cast<T>(lse - double(row[targets[t]]));
      predictions[t] = static_cast<std::int32_t>(argmax);
      if (!backward) continue;
      const T factor = static_cast<T>(double(weights[t]) * scale);
      const T target_logit = row[targets[t]];
      T* out = dlogits.data() + t * s.vocab;
      for (std::int64_t j = 0; j < s.vocab; ++j) {
        out[j] = static_cast<T>(std::exp(double(row[j]) - lse)) * factor;
      }
      // The one-hot term last: row[targets[t]] may just have been overwritten (in place).
      out[targets[t]] = static_cast<T>(std::exp(double(target_logit) - lse)) * factor - factor;
    }
  });
  return cross_entropy_sums<T>(losses, weights);
}

}  // namespace

template <typename T>
CrossEntropySums cross_entropy_sums(std::span<const T> losses, std::span<const T> weights) {
  CrossEntropySums sums;
  for (std::size_t t = 0; t < losses.size(); ++t) {
    sums.loss_sum += double(weights[t]) * double(losses[t]);
    sums.weight_sum += double(weights[t]);
  }
  return sums;
}

template <typename T>
CrossEntropySums cross_entropy_forward(std::span<T> losses, std::span<std::int32_t> predictions,
                                       std::span<const T> logits,
                                       std::span<const std::int32_t> targets,
                                       std::span<const T> weights, const CrossEntropyShape& s) {
  check_args("train::cpu::cross_entropy_forward", losses, predictions, logits, targets, weights, s);
  return run<T>({}, losses, predictions, logits, targets, weights, s, 0.0);
}

template <typename T>
CrossEntropySums cross_entropy_forward_backward(std::span<T> dlogits, std::span<T> losses,
                                                std::span<std::int32_t> predictions,
                                                std::span<const T> logits,
                                                std::span<const std::int32_t> targets,
                                                std::span<const T> weights,
                                                const CrossEntropyShape& s, double scale) {
  constexpr const char* kWhere = "train::cpu::cross_entropy_forward_backward";
  check_args(kWhere, losses, predictions, logits, targets, weights, s);
  detail::check_size(kWhere, "dlogits", dlogits, s.tokens * s.vocab, "tokens * vocab");
  if (!std::isfinite(scale)) {
    ringattn::detail::fail(kWhere, "scale is ", scale, "; expected a finite value");
  }
  return run<T>(dlogits, losses, predictions, logits, targets, weights, s, scale);
}

#define RINGATTN_INSTANTIATE(T)                                                                 \
  template CrossEntropySums cross_entropy_sums<T>(std::span<const T>, std::span<const T>);      \
  template CrossEntropySums cross_entropy_forward<T>(                                           \
      std::span<T>, std::span<std::int32_t>, std::span<const T>, std::span<const std::int32_t>, \
      std::span<const T>, const CrossEntropyShape&);                                            \
  template CrossEntropySums cross_entropy_forward_backward<T>(                                  \
      std::span<T>, std::span<T>, std::span<std::int32_t>, std::span<const T>,                  \
      std::span<const std::int32_t>, std::span<const T>, const CrossEntropyShape&, double);
RINGATTN_INSTANTIATE(float)
RINGATTN_INSTANTIATE(double)
#undef RINGATTN_INSTANTIATE

}  // namespace ringattn::train::cpu
