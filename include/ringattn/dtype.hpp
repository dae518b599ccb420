// Element types and exact host conversions for the 16-bit floating-point formats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ringattn {

// Values match ringattn_dtype_t of the C API.
enum class DType : int { f32 = 0, f64 = 1, f16 = 2, bf16 = 3 };

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
// Parses "f32", "f64", "f16", "bf16" (also "float32", "fp32", "float", "double", "half",
// "bfloat16"); throws Error naming the text otherwise.
DType parse_dtype(std::string_view name);
// The dtype that accumulates results of `dtype` inputs: f64 for f64, f32 for everything else.
constexpr DType accumulator_dtype(DType dtype) {
  return dtype == DType::f64 ? DType::f64 : DType::f32;
}

// Conversions between float and the bit patterns of bf16 / IEEE binary16. Widening is exact;
// narrowing rounds to nearest, ties to even, keeps infinities, subnormals and NaN (quieted).
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float value);
float f16_to_float(std::uint16_t bits);
std::uint16_t float_to_f16(float value);

}  // namespace ringattn
