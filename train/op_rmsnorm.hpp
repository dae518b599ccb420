// RMSNorm on the CPU, over the last dimension of row-major [rows, dim] activations. fp32 and fp64.
//
//   y[r, :] = x[r, :] * inv_rms[r] * g        inv_rms[r] = 1 / sqrt(mean(x[r, :]^2) + eps)
//
// The forward saves inv_rms [rows] for the backward (recomputing it is as cheap, but the saved
// value makes the backward use exactly the forward's normalisation).
#pragma once

#include <cstdint>
#include <span>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

struct RmsNormShape {
  std::int64_t rows = 0;
  std::int64_t dim = 0;
};

// y [rows, dim], inv_rms [rows]; x [rows, dim], g [dim]; eps > 0.
template <typename T>
void rmsnorm_forward(std::span<T> y, std::span<T> inv_rms, std::span<const T> x,
                     std::span<const T> g, const RmsNormShape& shape, double eps);

// dx [rows, dim] (+)= the gradient of x; dg [dim] (+)= the gradient of g, summed over rows in row
// order (bitwise the same whatever the thread count). inv_rms is the forward's.
template <typename T>
void rmsnorm_backward(std::span<T> dx, std::span<T> dg, std::span<const T> dy, std::span<const T> x,
                      std::span<const T> g, std::span<const T> inv_rms, const RmsNormShape& shape,
                      Write dx_write = Write::overwrite, Write dg_write = Write::overwrite);

}  // namespace ringattn::train::cpu
