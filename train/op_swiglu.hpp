// The SwiGLU activation of the MLP on the CPU. fp32 and fp64.
//
// Input: the output of the fused gate/up projection, [rows, 2 * hidden] row-major, each row the
// gate half a = columns [0, hidden) followed by the up half b = columns [hidden, 2 * hidden)
// (w_gate_up stacks W_gate over W_up). Output [rows, hidden]:
//
//   out = silu(a) * b        silu(a) = a * sigmoid(a)
#pragma once

#include <cstdint>
#include <span>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

struct SwigluShape {
  std::int64_t rows = 0;
  std::int64_t hidden = 0;  // width of the output; the input is twice as wide
};

template <typename T>
void swiglu_forward(std::span<T> out, std::span<const T> gate_up, const SwigluShape& shape);

// dgate_up [rows, 2 * hidden] = the gradients of a (first half) and b (second half).
template <typename T>
void swiglu_backward(std::span<T> dgate_up, std::span<const T> dout, std::span<const T> gate_up,
                     const SwigluShape& shape);

}  // namespace ringattn::train::cpu
