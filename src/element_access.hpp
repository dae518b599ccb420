// Reading and writing single elements of any dtype as double: the slow, general path of the
// reference and of the tests. Kernels use typed pointers instead.
#pragma once

#include <cstdint>

#include "ringattn/dtype.hpp"
#include "ringattn/tensor.hpp"

namespace ringattn::detail {

inline double load_element(const TensorView& t, std::int64_t offset) {
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[offset];
    case DType::f64: return static_cast<const double*>(t.data)[offset];
    case DType::f16: return f16_to_float(static_cast<const std::uint16_t*>(t.data)[offset]);
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(t.data)[offset]);
  }
  return 0.0;
}

// Narrowing to a 16-bit format goes through float: double -> float -> 16 bit can round twice,
// which the oracle's outputs (f64/f32 in practice) never do.
inline void store_element(const TensorView& t, std::int64_t offset, double value) {
  switch (t.dtype) {
    case DType::f32: static_cast<float*>(t.data)[offset] = static_cast<float>(value); break;
    case DType::f64: static_cast<double*>(t.data)[offset] = value; break;
    case DType::f16:
      static_cast<std::uint16_t*>(t.data)[offset] = float_to_f16(static_cast<float>(value));
      break;
    case DType::bf16:
      static_cast<std::uint16_t*>(t.data)[offset] = float_to_bf16(static_cast<float>(value));
      break;
  }
}

}  // namespace ringattn::detail
