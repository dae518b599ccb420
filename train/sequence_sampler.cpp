#include "train/sequence_sampler.hpp"

#include "ringattn/error.hpp"
#include "train/counter_rng.hpp"

namespace ringattn::train {
namespace {

constexpr int kRounds = 4;  // four Feistel rounds make a pseudorandom permutation (Luby-Rackoff)

}  // namespace

SequenceSampler::SequenceSampler(std::uint64_t seed, std::int64_t num_sequences)
    : seed_(seed), count_(num_sequences), half_bits_(1) {
  if (num_sequences < 1) {
    detail::fail("SequenceSampler", "num_sequences is ", num_sequences, "; expected at least 1");
  }
  while ((std::uint64_t{1} << (2 * half_bits_)) < static_cast<std::uint64_t>(num_sequences)) {
    ++half_bits_;
  }
}

// A balanced Feistel network on 2 * half_bits_ bits with round keys from (seed, epoch) is a
// bijection of [0, 4^h); cycle walking (apply it again while the result is >= N) restricts it to a
// bijection of [0, N). 4^h < 4 N, so a walk takes fewer than 4 applications on average.
std::int64_t SequenceSampler::sequence(std::uint64_t n) const {
  const auto count = static_cast<std::uint64_t>(count_);
  const std::uint64_t epoch = n / count;
  CounterRng keys(seed_, RngStream::sampler, epoch);
  std::uint64_t round_keys[kRounds];
  for (auto& key : round_keys) key = keys.next();
  const std::uint64_t mask = (std::uint64_t{1} << half_bits_) - 1;
  std::uint64_t x = n % count;
  do {
    std::uint64_t left = x >> half_bits_, right = x & mask;
    for (const std::uint64_t key : round_keys) {
      const std::uint64_t next_right = left ^ (mix64(right ^ key) & mask);
      left = right;
      right = next_right;
    }
    x = (left << half_bits_) | right;
  } while (x >= count);
  return static_cast<std::int64_t>(x);
}

}  // namespace ringattn::train
