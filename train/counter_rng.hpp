// Counter-based random numbers: the numbers of (seed, stream, index) are a pure function of the
// three, so a data position is one integer, any rank can draw any sample without drawing the ones
// before it, and results do not depend on the standard library (std::*_distribution do).
#pragma once

#include <cstdint>

namespace ringattn::train {

// GCC and Clang's 128-bit integer (`__extension__` keeps -Wpedantic quiet about it).
__extension__ using Uint128 = unsigned __int128;

// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijection on 64-bit words whose outputs pass
// BigCrush for consecutive inputs.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The uses of one seed. Each draws from its own stream, so their numbers are independent.
enum class RngStream : std::uint64_t {
  sampler = 1,             // the data order of a token dataset (train/sequence_sampler.hpp)
  retrieval_train = 2,     // training samples of the retrieval task
  retrieval_held_out = 3,  // its held-out samples
};

// A SplitMix64 generator started at a state derived from (seed, stream, index): the index selects
// a sample (or a permutation round) within a stream.
class CounterRng {
 public:
  CounterRng(std::uint64_t seed, RngStream stream, std::uint64_t index)
      : state_(mix64(mix64(mix64(seed) ^ static_cast<std::uint64_t>(stream)) ^ index)) {}

  std::uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  // Uniform in [0, bound), bound >= 1, without modulo bias (Lemire 2019: multiply, reject the
  // few low products that would over-represent some values).
  std::uint64_t below(std::uint64_t bound) {
    Uint128 product = static_cast<Uint128>(next()) * bound;
    auto low = static_cast<std::uint64_t>(product);
    if (low < bound) {
      const std::uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        product = static_cast<Uint128>(next()) * bound;
        low = static_cast<std::uint64_t>(product);
      }
    }
    return static_cast<std::uint64_t>(product >> 64);
  }

 private:
  std::uint64_t state_;
};

}  // namespace ringattn::train
