// Helpers of the C API tests: a C tensor descriptor over a host vector.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "ringattn/ringattn.h"

namespace ringattn::test {

// A row-major f64 host descriptor of `shape` at `data`. Strides stop growing where they would
// overflow int64 (a shape whose element count does, for tests of that refusal).
inline ringattn_tensor_t describe_at(void* data, std::initializer_list<std::int64_t> shape) {
  ringattn_tensor_t t{};
  t.data = data;
  t.dtype = RINGATTN_F64;
  t.memory = RINGATTN_HOST;
  t.rank = static_cast<int32_t>(shape.size());
  int axis = 0;
  for (std::int64_t extent : shape) t.shape[axis++] = extent;
  std::int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.strides[i] = stride;
    if (i > 0 && __builtin_mul_overflow(stride, t.shape[i], &stride)) stride = 1;
  }
  return t;
}

// The same over a vector's elements.
inline ringattn_tensor_t describe(std::vector<double>& data, std::initializer_list<std::int64_t> shape) {
  return describe_at(data.data(), shape);
}

}  // namespace ringattn::test
