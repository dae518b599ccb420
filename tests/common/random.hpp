// Seeded random inputs for the tests: a fresh seed per run, replayable from its printed value.
//
//   SCOPED_TRACE(ringattn::test::seed_trace());   // failures then name the seed
//   std::mt19937_64 rng = ringattn::test::make_rng();
//   std::vector<float> q = ringattn::test::normal_vector<float>(n, rng);
//   std::vector<float> o = ringattn::test::nan_vector<float>(n);   // must be fully written
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace ringattn::test {

// The seed of this run: RINGATTN_TEST_SEED when it is set (to replay a failure), else a fresh one
// from std::random_device. Constant within a process; the main() of the mpi tests gives every rank
// the seed of rank 0.
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    const char* text = std::getenv("RINGATTN_TEST_SEED");
    if (text != nullptr && *text != '\0') {
      const char* end = text + std::strlen(text);
      std::uint64_t value = 0;
      const auto [stop, error] = std::from_chars(text, end, value);
      if (error != std::errc() || stop != end) {
        throw std::invalid_argument(std::string("RINGATTN_TEST_SEED is '") + text +
                                    "', expected an unsigned 64-bit integer");
      }
      return value;
    }
    std::random_device device;
    return (std::uint64_t{device()} << 32) ^ std::uint64_t{device()};
  }();
  return seed;
}

// "seed 123 (replay: RINGATTN_TEST_SEED=123)", for SCOPED_TRACE.
inline std::string seed_trace() {
  const std::string seed = std::to_string(test_seed());
  return "seed " + seed + " (replay: RINGATTN_TEST_SEED=" + seed + ")";
}

// A generator seeded by the run's seed and `stream`: inputs drawn for different streams are
// independent, and one seed replays them all. (std::normal_distribution differs between standard
// libraries, so a seed replays on the same toolchain.)
inline std::mt19937_64 make_rng(std::uint64_t stream = 0) {
  const std::uint64_t seed = test_seed();
  std::seed_seq sequence{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                         static_cast<std::uint32_t>(stream),
                         static_cast<std::uint32_t>(stream >> 32)};
  return std::mt19937_64(sequence);
}

// Fills with independent N(0, 1) * scale values.
template <typename T>
void fill_normal(std::vector<T>& values, std::mt19937_64& rng, double scale = 1.0) {
  static_assert(std::is_floating_point_v<T>);
  std::normal_distribution<double> normal;
  for (T& value : values) value = static_cast<T>(normal(rng) * scale);
}

template <typename T>
std::vector<T> normal_vector(std::size_t count, std::mt19937_64& rng, double scale = 1.0) {
  std::vector<T> values(count);
  fill_normal(values, rng, scale);
  return values;
}

// Poison: an output filled with NaN before a call shows every element the call did not write.
template <typename T>
void fill_nan(std::vector<T>& values) {
  static_assert(std::is_floating_point_v<T>);
  std::fill(values.begin(), values.end(), std::numeric_limits<T>::quiet_NaN());
}

template <typename T>
std::vector<T> nan_vector(std::size_t count) {
  return std::vector<T>(count, std::numeric_limits<T>::quiet_NaN());
}

template <typename T>
std::size_t count_nan(const std::vector<T>& values) {
  return static_cast<std::size_t>(
      std::count_if(values.begin(), values.end(), [](T value) { return value != value; }));
}

}  // namespace ringattn::test
