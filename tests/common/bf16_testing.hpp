// bf16 values for the tests of GPU ops against their fp32 CPU twins: inputs drawn as bf16 bit
// patterns, widened exactly to fp32 for the twin, bitwise comparison of results, and (in a CUDA
// build) the copies to and from the device on a test's stream.
//
//   std::mt19937_64 rng = test::make_rng(1);
//   const test::Bits x = test::random_bf16(n, rng);   // the GPU's input
//   const std::vector<float> x_f = test::widen(x);    // the twin's: the same values
//   const DeviceBuffer d_x = test::to_device(x, stream);
//   ...
//   const std::vector<float> y = test::download_bf16(d_y.data(), n, stream);
//   EXPECT_TRUE(test::BitwiseEqual("y", y, ref_y));
//
// Copies are asynchronous on the given stream (a non-blocking one does not wait for the legacy
// default stream); download waits for the stream before it returns.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "ringattn/config.h"
#include "ringattn/dtype.hpp"
#include "tests/common/random.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/cuda_check.hpp"
#include "src/cuda/device_buffer.hpp"
#endif

namespace ringattn::test {

// bf16 values as their bit patterns.
using Bits = std::vector<std::uint16_t>;

// The unit roundoff of bf16's 8-bit significand: the relative error of rounding an fp32 result to
// a bf16 output.
inline constexpr double kBf16Unit = 0x1p-8;

// N(0, scale^2) draws rounded to bf16, as bit patterns.
inline Bits random_bf16(std::size_t count, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> normal;
  Bits bits(count);
  for (auto& b : bits) b = float_to_bf16(static_cast<float>(normal(rng) * scale));
  return bits;
}

// The values of bf16 bit patterns, exactly.
inline std::vector<float> widen(const Bits& bits) {
  std::vector<float> values(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_float(bits[i]);
  return values;
}

// fp32 values rounded to bf16 (to nearest even).
inline Bits narrow(const std::vector<float>& values) {
  Bits bits(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) bits[i] = float_to_bf16(values[i]);
  return bits;
}

// A value's bits, as an unsigned integer of its size.
template <typename T>
std::uint64_t bit_pattern(T value) {
  static_assert(std::is_trivially_copyable_v<T>);
  if constexpr (sizeof(T) == 2) {
    return std::bit_cast<std::uint16_t>(value);
  } else if constexpr (sizeof(T) == 4) {
    return std::bit_cast<std::uint32_t>(value);
  } else {
    static_assert(sizeof(T) == 8);
    return std::bit_cast<std::uint64_t>(value);
  }
}

// The same bits everywhere (floats compared by their bit patterns: -0 differs from +0, NaN equals
// a NaN of the same payload), reported as a count and the first mismatch.
template <typename T>
::testing::AssertionResult BitwiseEqual(const std::string& what, const std::vector<T>& out,
                                        const std::vector<T>& ref) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << out.size() << " values, expected " << ref.size();
  }
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (bit_pattern(out[i]) != bit_pattern(ref[i]) && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream detail;
  detail << what << ": " << bad << " of " << ref.size() << " elements differ; first at " << first
         << ": " << +out[first] << " (0x" << std::hex << bit_pattern(out[first]) << std::dec
         << "), expected " << +ref[first] << " (0x" << std::hex << bit_pattern(ref[first])
         << std::dec << ")";
  return ::testing::AssertionFailure() << detail.str() << " [" << seed_trace() << "]";
}

#if RINGATTN_WITH_CUDA

// Copies `values` to `device`, on the stream.
template <typename T>
void upload(void* device, const std::vector<T>& values, cudaStream_t stream) {
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(device, values.data(), values.size() * sizeof(T),
                                      cudaMemcpyHostToDevice, stream));
}

// A new device buffer holding `values`.
template <typename T>
DeviceBuffer to_device(const std::vector<T>& values, cudaStream_t stream) {
  DeviceBuffer buffer(values.size() * sizeof(T));
  upload(buffer.data(), values, stream);
  return buffer;
}

// Waits for the stream, then copies `count` elements back.
template <typename T>
std::vector<T> download(const void* device, std::size_t count, cudaStream_t stream) {
  std::vector<T> values(count);
  RINGATTN_CUDA_CHECK(
      cudaMemcpyAsync(values.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  return values;
}

// Waits for the stream, then copies `count` bf16 values back, widened to fp32.
inline std::vector<float> download_bf16(const void* device, std::size_t count,
                                        cudaStream_t stream) {
  return widen(download<std::uint16_t>(device, count, stream));
}

#endif

}  // namespace ringattn::test
