// Element types: sizes, names, parsing, and the bf16 / f16 conversions, checked on every 16-bit
// pattern against values computed from the formats' fields in double arithmetic.
#include "ringattn/dtype.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_name(DType::f32), "f32");
  EXPECT_EQ(dtype_name(DType::f64), "f64");
  EXPECT_EQ(dtype_name(DType::f16), "f16");
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
}

TEST(DType, AccumulatorIsF64OnlyForF64) {
  static_assert(accumulator_dtype(DType::f64) == DType::f64);
  static_assert(accumulator_dtype(DType::f32) == DType::f32);
  static_assert(accumulator_dtype(DType::f16) == DType::f32);
  static_assert(accumulator_dtype(DType::bf16) == DType::f32);
}

TEST(DType, ParsesNamesAndAliases) {
  const struct {
    const char* text;
    DType dtype;
  } cases[] = {{"f32", DType::f32},      {"float32", DType::f32}, {"fp32", DType::f32},
               {"float", DType::f32},    {"f64", DType::f64},     {"double", DType::f64},
               {"f16", DType::f16},      {"half", DType::f16},    {"bf16", DType::bf16},
               {"bfloat16", DType::bf16}};
  for (const auto& c : cases) {
    EXPECT_EQ(parse_dtype(c.text), c.dtype) << c.text;
  }
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype) << dtype_name(dtype);
  }
}

TEST(DType, ParseErrorNamesTheText) {
  for (const std::string text : {"f8", "int8", "bf16x", "float128"}) {
    try {
      parse_dtype(text);
      ADD_FAILURE() << "parse_dtype accepted '" << text << "'";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(text), std::string::npos)
          << "message does not name '" << text << "': " << error.what();
    }
  }
  EXPECT_THROW(parse_dtype(""), Error);
}

// --- 16-bit formats ------------------------------------------------------------------------------

// The value of a bit pattern from its sign, exponent and mantissa fields (NaN for NaN patterns).
double field_value(std::uint16_t bits, int mantissa_bits, int exponent_bias) {
  const int exponent_mask = (1 << (15 - mantissa_bits)) - 1;
  const int exponent = (bits >> mantissa_bits) & exponent_mask;
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  double magnitude;
  if (exponent == exponent_mask) {
    magnitude = mantissa == 0 ? std::numeric_limits<double>::infinity()
                              : std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {  // subnormal: no implicit leading 1
    magnitude = std::ldexp(mantissa, 1 - exponent_bias - mantissa_bits);
  } else {
    magnitude =
        std::ldexp((1 << mantissa_bits) + mantissa, exponent - exponent_bias - mantissa_bits);
  }
  return (bits & 0x8000) ? -magnitude : magnitude;
}

struct Format {
  const char* name;
  float (*widen)(std::uint16_t);
  std::uint16_t (*narrow)(float);
  int mantissa_bits;
  int exponent_bias;
  std::uint16_t inf_bits;  // +inf, the pattern after the largest finite magnitude
  // The value the +inf pattern would stand for with an unbounded exponent: the upper neighbour of
  // the largest finite value for rounding (so the midpoint between them rounds to inf, as IEEE
  // round-to-nearest-even says).
  double overflow_value;
  // Biased float exponents to draw random floats from: the format's range and a little beyond.
  int random_exponent_min, random_exponent_max;

  double value(std::uint16_t bits) const { return field_value(bits, mantissa_bits, exponent_bias); }
  // The magnitude of a pattern in [0, inf_bits], with +inf standing for overflow_value.
  double magnitude(std::uint16_t bits) const {
    return bits == inf_bits ? overflow_value : value(bits);
  }
  bool is_nan(std::uint16_t bits) const {
    return (bits & inf_bits) == inf_bits && (bits & ((1 << mantissa_bits) - 1)) != 0;
  }
};

void PrintTo(const Format& format, std::ostream* out) {
  *out << format.name;
}

const Format kBf16{"bf16", bf16_to_float, float_to_bf16, 7, 127, 0x7F80, std::ldexp(1.0, 128), 0,
                   255};
const Format kF16{"f16", f16_to_float, float_to_f16, 10, 15, 0x7C00, 65536.0, 127 - 27, 127 + 17};

// Round to nearest, ties to even, decided in double: the two representable neighbours of |x| are
// found by bisection over the (monotone) positive patterns, then compared with their midpoint,
// which is exact in double. An odd/even pattern is an odd/even mantissa.
std::uint16_t expected_narrow(const Format& format, float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double magnitude = std::abs(static_cast<double>(x));
  if (magnitude >= format.overflow_value) return sign | format.inf_bits;
  std::uint16_t low = 0, high = format.inf_bits;  // magnitude(low) <= |x| < magnitude(high)
  while (high - low > 1) {
    const auto middle = static_cast<std::uint16_t>((low + high) / 2);
    (format.magnitude(middle) <= magnitude ? low : high) = middle;
  }
  const double midpoint = (format.magnitude(low) + format.magnitude(high)) / 2;
  std::uint16_t nearest;
  if (magnitude < midpoint) {
    nearest = low;
  } else if (magnitude > midpoint) {
    nearest = high;
  } else {
    nearest = (low % 2 == 0) ? low : high;
  }
  return sign | nearest;
}

std::string hex(std::uint32_t bits, int digits) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%0*X", digits, bits);
  return text;
}

// Stops a loop over many cases after a few failures, so that one bug does not print 65536 lines.
constexpr int kMaxReportedFailures = 10;

// narrow(x) against expected_narrow (a NaN input must give a NaN pattern); true when they agree.
bool check_narrow(const Format& format, float x) {
  const std::uint16_t got = format.narrow(x);
  if (std::isnan(x)) {
    if (format.is_nan(got)) return true;
    ADD_FAILURE() << format.name << ": narrowing NaN " << hex(std::bit_cast<std::uint32_t>(x), 8)
                  << " gave " << hex(got, 4) << ", not a NaN";
    return false;
  }
  const std::uint16_t want = expected_narrow(format, x);
  if (got == want) return true;
  ADD_FAILURE() << format.name << ": narrowing " << x << " ("
                << hex(std::bit_cast<std::uint32_t>(x), 8) << ") gave " << hex(got, 4) << " = "
                << format.value(got) << ", round-to-nearest-even gives " << hex(want, 4) << " = "
                << format.value(want);
  return false;
}

class SixteenBit : public testing::TestWithParam<Format> {};

TEST_P(SixteenBit, WideningIsExactForEveryPattern) {
  const Format& format = GetParam();
  int failures = 0;
  for (std::uint32_t bits = 0; bits <= 0xFFFF && failures < kMaxReportedFailures; ++bits) {
    const auto pattern = static_cast<std::uint16_t>(bits);
    const double want = format.value(pattern);
    const float got = format.widen(pattern);
    const bool ok = std::isnan(want) ? std::isnan(got)
                                     : (got == want && std::signbit(got) == std::signbit(want));
    if (!ok) {
      ++failures;
      ADD_FAILURE() << format.name << ": widening " << hex(pattern, 4) << " gave " << got
                    << ", its fields say " << want;
    }
  }
}

TEST_P(SixteenBit, NarrowingAWidenedPatternGivesItBack) {
  const Format& format = GetParam();
  int failures = 0;
  for (std::uint32_t bits = 0; bits <= 0xFFFF && failures < kMaxReportedFailures; ++bits) {
    const auto pattern = static_cast<std::uint16_t>(bits);
    const std::uint16_t back = format.narrow(format.widen(pattern));
    const bool ok = format.is_nan(pattern) ? format.is_nan(back) : back == pattern;
    if (!ok) {
      ++failures;
      ADD_FAILURE() << format.name << ": " << hex(pattern, 4) << " -> float -> " << hex(back, 4);
    }
  }
}

// Every midpoint between neighbouring patterns (a tie), and the floats just below and above it.
TEST_P(SixteenBit, NarrowingRoundsTiesToEven) {
  const Format& format = GetParam();
  int failures = 0;
  for (std::uint16_t low = 0; low < format.inf_bits && failures < kMaxReportedFailures; ++low) {
    const double midpoint = (format.magnitude(low) + format.magnitude(low + 1)) / 2;
    const auto tie = static_cast<float>(midpoint);
    ASSERT_EQ(static_cast<double>(tie), midpoint) << "midpoint above " << hex(low, 4);
    for (float x : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, INFINITY)}) {
      if (!check_narrow(format, x)) ++failures;
      if (!check_narrow(format, -x)) ++failures;
    }
  }
}

TEST_P(SixteenBit, NarrowingRandomFloatsRoundsToNearestEven) {
  SCOPED_TRACE(test::seed_trace());
  const Format& format = GetParam();
  std::mt19937_64 rng = test::make_rng(format.mantissa_bits);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_int_distribution<std::uint32_t> exponent(format.random_exponent_min,
                                                        format.random_exponent_max);
  constexpr int kSamples = 1 << 20;
  int failures = 0;
  // Half are uniform 32-bit patterns (every float class: zeros, subnormals, inf, NaN), half have
  // exponents around the format's range, where its rounding is decided.
  for (int i = 0; i < kSamples && failures < kMaxReportedFailures; ++i) {
    std::uint32_t bits = any_bits(rng);
    if (i % 2 == 1) bits = (bits & 0x807FFFFFu) | (exponent(rng) << 23);
    if (!check_narrow(format, std::bit_cast<float>(bits))) ++failures;
  }
}

TEST_P(SixteenBit, NarrowingKeepsNaNsWithLowPayloads) {
  const Format& format = GetParam();
  // A payload only in the low bits would be shifted out by a plain truncation, turning NaN to inf.
  for (std::uint32_t bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7F801000u,
                             0x7F80FFFFu, 0x7FBFFFFFu}) {
    check_narrow(format, std::bit_cast<float>(bits));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, SixteenBit, testing::Values(kBf16, kF16),
                         [](const testing::TestParamInfo<Format>& info) {
                           return std::string(info.param.name);
                         });

// Named cases, beside the exhaustive ones, for a reader who wants the format's edges.
TEST(F16, OverflowSubnormalsAndKnownValues) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_f16(0.1f), 0x2E66);
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);  // largest finite
  EXPECT_EQ(float_to_f16(65519.0f), 0x7BFF);  // below the midpoint to 65536
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);  // the midpoint: ties to the even neighbour, inf
  EXPECT_EQ(float_to_f16(-65520.0f), 0xFC00);
  EXPECT_EQ(float_to_f16(1e6f), 0x7C00);
  EXPECT_EQ(float_to_f16(INFINITY), 0x7C00);
  EXPECT_EQ(float_to_f16(-INFINITY), 0xFC00);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)), 0x0400);     // smallest normal
  EXPECT_EQ(float_to_f16(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);     // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);     // tie between 0 and 2^-24
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -26)), 0x0001);     // 0.75 * 2^-24
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);     // tie between 1 and 2 ulps
  EXPECT_EQ(float_to_f16(-std::ldexp(1.0f, -26)), 0x8000);    // underflow keeps the sign
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_float(0xFC00), -INFINITY);
  EXPECT_TRUE(std::isnan(f16_to_float(0x7E00)));
}

TEST(Bf16, OverflowSubnormalsAndKnownValues) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);        // tie, to even
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(3.0f, -8)), 0x3F82);        // tie, to even
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // past the midpoint: inf
  EXPECT_EQ(float_to_bf16(std::ldexp(1.0f, -133)), 0x0001);             // smallest subnormal
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(bf16_to_float(0x7F7F), 0x1.FEp127f);  // largest finite
  EXPECT_EQ(bf16_to_float(0x0001), std::ldexp(1.0f, -133));
  EXPECT_TRUE(std::isnan(bf16_to_float(0x7FC0)));
}

}  // namespace
}  // namespace ringattn
