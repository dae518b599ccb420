// The residual stream's elementwise adds on the CPU. fp32 and fp64.
//
// A block computes h = x + f(x); its backward is dx = dh + (the gradient through f), so the same
// adds serve both directions.
#pragma once

#include <span>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

// y += x, elementwise; x has y's size.
template <typename T>
void residual_add(std::span<T> y, std::span<const T> x);

// out = a + b, elementwise, when the stream before the add must be kept (a norm's backward reads
// it); a and b have out's size.
template <typename T>
void residual_sum(std::span<T> out, std::span<const T> a, std::span<const T> b);

}  // namespace ringattn::train::cpu
