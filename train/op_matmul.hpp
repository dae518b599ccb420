// The linear layers of the model on the CPU: Y = X W^T with W in the nn.Linear layout, and its two
// backward products. fp32 (the CPU backend) and fp64 (gradient checks).
//
//   X  [rows, in]    row-major (rows = tokens)
//   W  [out, in]     row-major: one output feature per row, as nn.Linear stores it
//   Y  [rows, out]   row-major
//
// Every product sums over its inner dimension in order, in the element type, independently of the
// thread count: results are bitwise reproducible run to run.
#pragma once

#include <cstdint>
#include <span>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

struct MatmulShape {
  std::int64_t rows = 0;          // M: rows of X and Y (tokens)
  std::int64_t in_features = 0;   // K: columns of X and W
  std::int64_t out_features = 0;  // N: rows of W, columns of Y
};

// Y (+)= X W^T.
template <typename T>
void matmul_forward(std::span<T> y, std::span<const T> x, std::span<const T> w,
                    const MatmulShape& shape, Write write = Write::overwrite);

// dX (+)= dY W: the gradient of X, [rows, in].
template <typename T>
void matmul_backward_input(std::span<T> dx, std::span<const T> dy, std::span<const T> w,
                           const MatmulShape& shape, Write write = Write::overwrite);

// dW (+)= dY^T X: the gradient of W, [out, in]; Write::add accumulates over micro-batches.
template <typename T>
void matmul_backward_weight(std::span<T> dw, std::span<const T> dy, std::span<const T> x,
                            const MatmulShape& shape, Write write = Write::overwrite);

}  // namespace ringattn::train::cpu
