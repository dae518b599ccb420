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

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

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

// One of the consecutive tensors of a step over several: its element count and its decay.
struct AdamWSegment {
  std::int64_t count = 0;
  WeightDecay decay = WeightDecay::apply;
};

// The scalars of one step, formed once in double and rounded once to float: the CPU op and its
// CUDA twin (train/cuda/ops.hpp) update with the same values.
struct AdamWScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float lr, eps;
  float correction1, correction2;  // 1 / (1 - beta^t)
  float keep;                      // 1 - lr * weight_decay where decay applies, else 1
  float grad_scale;                // the gradient is multiplied by it first
};

// Checks the hyperparameters (errors name `where`, the value and what was expected) and forms
// the scalars of step `step` (>= 1).
AdamWScalars adamw_scalars(std::string_view where, const AdamWHyper& hyper, std::int64_t step,
                           WeightDecay decay, float grad_scale);

#if defined(__CUDACC__)
#define RINGATTN_TRAIN_HOST_DEVICE __host__ __device__
#else
#define RINGATTN_TRAIN_HOST_DEVICE
#endif

// The update of element i, operation for operation the same on the host and the device (the
// device's _rn intrinsics keep nvcc from contracting a multiply and an add into an FMA, so both
// round alike); returns the new parameter.
RINGATTN_TRAIN_HOST_DEVICE inline float adamw_update(float* params, const float* grads, float* m,
                                                     float* v, std::int64_t i,
                                                     const AdamWScalars& s) {
#if defined(__CUDA_ARCH__)
  const float g = __fmul_rn(grads[i], s.grad_scale);
  const float mi = __fadd_rn(__fmul_rn(s.beta1, m[i]), __fmul_rn(s.one_minus_beta1, g));
  const float vi =
      __fadd_rn(__fmul_rn(s.beta2, v[i]), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  m[i] = mi;
  v[i] = vi;
  const float denominator = __fadd_rn(__fsqrt_rn(__fmul_rn(vi, s.correction2)), s.eps);
  const float step = __fdiv_rn(__fmul_rn(s.lr, __fmul_rn(mi, s.correction1)), denominator);
  const float p = __fsub_rn(__fmul_rn(params[i], s.keep), step);
#else
  const float g = grads[i] * s.grad_scale;
  const float mi = s.beta1 * m[i] + s.one_minus_beta1 * g;
  const float vi = s.beta2 * v[i] + s.one_minus_beta2 * g * g;
  m[i] = mi;
  v[i] = vi;
  const float p =
      params[i] * s.keep - s.lr * (mi * s.correction1) / (std::sqrt(vi * s.correction2) + s.eps);
#endif
  params[i] = p;
  return p;
}

// The multiplier a training step applies to its gradients: min(1, float(clip_factor)), 1 without
// clipping (max_norm <= 0), NaN for a sum that is not finite (the step is then skipped). The
// same operations on the host and on the device (cuda::queue_clip_factor's kernel).
RINGATTN_TRAIN_HOST_DEVICE inline float step_clip_factor(double global_sum_of_squares,
                                                         double max_norm) {
#if defined(__CUDA_ARCH__)
  if (!isfinite(global_sum_of_squares)) return __int_as_float(0x7fc00000);
  const double root = sqrt(global_sum_of_squares);
#else
  if (!std::isfinite(global_sum_of_squares)) return std::numeric_limits<float>::quiet_NaN();
  const double root = std::sqrt(global_sum_of_squares);
#endif
  if (!(max_norm > 0.0)) return 1.0f;
  const double factor = max_norm / (root + 1e-6);  // then min(1, .), as clip_factor forms it
  const float rounded = static_cast<float>(factor < 1.0 ? factor : 1.0);
  return rounded < 1.0f ? rounded : 1.0f;
}

#undef RINGATTN_TRAIN_HOST_DEVICE

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
