#include "ringattn/dtype.hpp"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "ringattn/error.hpp"

namespace ringattn {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::f16:
    case DType::bf16: return 2;
  }
  detail::fail("dtype_size", "unknown dtype value ", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "invalid";
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32" || name == "float") return DType::f32;
  if (name == "f64" || name == "fp64" || name == "float64" || name == "double") return DType::f64;
  if (name == "f16" || name == "fp16" || name == "float16" || name == "half") return DType::f16;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  detail::fail("parse_dtype", "unknown dtype '", name, "'; expected one of f32, f64, f16, bf16");
}

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t float_to_bf16(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);  // quiet
  // Round to nearest even on the 16 dropped bits; a carry into the exponent gives the next
  // binade or infinity, which is what rounding requires.
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

float f16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) {  // infinity or NaN
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

std::uint16_t float_to_f16(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  if (std::isnan(value)) return static_cast<std::uint16_t>(sign | 0x7e00u | ((bits >> 13) & 0x3ffu));
  const float magnitude = std::fabs(value);
  if (magnitude >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (magnitude < 0x1p-14f) {
    // Subnormal range: the result is magnitude / 2^-24 rounded to an integer, ties to even;
    // nearbyint uses the default rounding mode, which is round-to-nearest-even.
    const auto units = static_cast<std::uint16_t>(std::nearbyint(magnitude * 0x1p24f));
    return static_cast<std::uint16_t>(sign | units);
  }
  // Normal range: re-bias the exponent and round the 13 dropped mantissa bits to nearest even;
  // a carry propagates into the exponent (up to 0x7c00 = inf only from >= 65520, handled above).
  const std::uint32_t abs_bits = bits & 0x7fffffffu;
  const std::uint32_t rebased = abs_bits - (112u << 23);
  const std::uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rebased + rounding) >> 13));
}

}  // namespace ringattn
