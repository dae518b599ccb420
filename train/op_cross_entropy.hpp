// Softmax cross-entropy fused with its softmax on the CPU: the loss of fp32 logits against target
// ids, with a weight per token (0 leaves a token out: prompt, padding), and its gradient. fp32 (the
// CPU backend) and fp64 (gradient checks). Nothing larger than the logits is materialised: the
// gradient can be written over the logits in place.
//
//   logits  [tokens, vocab]   row-major
//   targets [tokens]          int32 ids in [0, vocab)
//   weights [tokens]          finite, >= 0
//
//   loss_t = logsumexp(logits[t, :]) - logits[t, targets[t]]
//
// Under context (or data) parallelism the mean runs over every rank's tokens: each rank returns
// its sums, the caller all-reduces them (or the weight sums ahead of the step, for the scale).
#pragma once

#include <cstdint>
#include <span>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

struct CrossEntropyShape {
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;
};

// Sums over this call's tokens, in token order in double (deterministic):
// loss_sum = sum_t weights[t] * loss_t and weight_sum = sum_t weights[t]. The weighted mean loss
// is loss_sum / weight_sum (after summing both across ranks).
struct CrossEntropySums {
  double loss_sum = 0.0;
  double weight_sum = 0.0;
  // Another call's sums, added after these (the sums of consecutive chunks of tokens).
  CrossEntropySums& operator+=(const CrossEntropySums& later) {
    loss_sum += later.loss_sum;
    weight_sum += later.weight_sum;
    return *this;
  }
};

// The sums of losses [tokens] under weights [tokens], in token order in double.
template <typename T>
CrossEntropySums cross_entropy_sums(std::span<const T> losses, std::span<const T> weights);

// Writes losses [tokens] (loss_t, unweighted) and predictions [tokens] (the argmax of each row;
// the lowest index among equal maxima), returns the sums.
template <typename T>
CrossEntropySums cross_entropy_forward(std::span<T> losses, std::span<std::int32_t> predictions,
                                       std::span<const T> logits,
                                       std::span<const std::int32_t> targets,
                                       std::span<const T> weights, const CrossEntropyShape& shape);

// The forward, and the gradient of scale * loss_sum:
//
//   dlogits[t, :] = (softmax(logits[t, :]) - onehot(targets[t])) * weights[t] * scale
//
// For the mean over weighted tokens, scale = 1 / (the sum of weights over every rank that shares
// the batch). dlogits may be the same memory as logits (in place); any other overlap is an error
// the op does not detect.
template <typename T>
CrossEntropySums cross_entropy_forward_backward(std::span<T> dlogits, std::span<T> losses,
                                                std::span<std::int32_t> predictions,
                                                std::span<const T> logits,
                                                std::span<const std::int32_t> targets,
                                                std::span<const T> weights,
                                                const CrossEntropyShape& shape, double scale);

}  // namespace ringattn::train::cpu
