// The optimizer on the CPU: one AdamW step on fp32 master weights, and the helpers of gradient
// clipping by global norm.
//
// A step of tensor p with gradient g, moments m and v (fp32, same size), step count t >= 1:
//
//   p <- p - lr * weight_decay * p                       (decoupled; only where decay is applied)
//   m <- beta1 m + (1 - beta1) g        v <- beta2 v + (1 - beta2) g^2
//   p <- p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
//
// the update of torch.optim.AdamW. Clipping over several ranks:
//
//   local = sum_of_squares(grads)  ->  all-reduce(sum) over the ranks holding distinct gradient
//   parts  ->  scale_buffers(grads, clip_factor(global, max_norm))
#pragma once

#include <cstdint>
#include <span>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

struct AdamWHyper {
  double lr = 0.0;  // this step's learning rate (the caller's schedule), >= 0
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;  // applied only to tensors stepped with WeightDecay::apply
};

// Whether a tensor takes weight decay (matrices do; norms' gains and, by choice, embeddings not).
enum class WeightDecay { skip, apply };

// One step on one tensor: params, m, v updated in place; step counts steps taken including this
// one (1 on the first step), for the bias correction.
void adamw_step(std::span<float> params, std::span<const float> grads, std::span<float> m,
                std::span<float> v, const AdamWHyper& hyper, std::int64_t step, WeightDecay decay);

// sum_i sum_j buffers[i][j]^2, in double, in a fixed order (bitwise the same whatever the thread
// count). Empty buffers are allowed; a null buffer with elements is not.
double sum_of_squares(std::span<const std::span<const float>> buffers);

// The factor that brings a global gradient norm sqrt(global_sum_of_squares) down to max_norm:
// min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_). A non-finite sum gives a
// non-finite factor, for the caller's NaN check to catch.
double clip_factor(double global_sum_of_squares, double max_norm);

// buffers[i][j] *= factor.
void scale_buffers(std::span<const std::span<float>> buffers, float factor);

}  // namespace ringattn::train::cpu
