// The data order: every epoch is a permutation of the dataset's sequences, epochs and seeds differ,
// and the order is a pure function of (seed, position).
#include "train/sequence_sampler.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"

namespace ringattn::train {
namespace {

std::vector<std::int64_t> epoch_order(const SequenceSampler& sampler, std::uint64_t epoch) {
  const auto n = static_cast<std::uint64_t>(sampler.num_sequences());
  std::vector<std::int64_t> order;
  for (std::uint64_t i = 0; i < n; ++i) order.push_back(sampler.sequence(epoch * n + i));
  return order;
}

TEST(SequenceSampler, EveryEpochVisitsEverySequenceOnce) {
  const std::uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace());
  for (const std::int64_t n : {1, 2, 3, 4, 5, 16, 17, 1000, 4097}) {
    const SequenceSampler sampler(seed, n);
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      std::vector<int> visits(n, 0);
      for (const std::int64_t s : epoch_order(sampler, epoch)) {
        ASSERT_GE(s, 0);
        ASSERT_LT(s, n);
        ++visits[s];
      }
      for (std::int64_t s = 0; s < n; ++s) {
        EXPECT_EQ(visits[s], 1) << "n " << n << " epoch " << epoch << " sequence " << s;
      }
    }
  }
}

TEST(SequenceSampler, OrdersDifferByEpochAndSeedAndRepeatExactly) {
  const std::uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace());
  const SequenceSampler sampler(seed, 1000);
  const std::vector<std::int64_t> first = epoch_order(sampler, 0);
  std::vector<std::int64_t> identity(1000);
  for (std::int64_t i = 0; i < 1000; ++i) identity[i] = i;
  EXPECT_NE(first, identity);
  EXPECT_NE(first, epoch_order(sampler, 1));
  EXPECT_NE(first, epoch_order(SequenceSampler(seed + 1, 1000), 0));
  EXPECT_EQ(first, epoch_order(SequenceSampler(seed, 1000), 0));
  // Resuming: position n alone gives the sequence, whatever was read before.
  EXPECT_EQ(sampler.sequence(1537), SequenceSampler(seed, 1000).sequence(1537));
}

TEST(SequenceSampler, NeedsAtLeastOneSequence) {
  EXPECT_TRUE(test::throws_error_with([] { SequenceSampler(1, 0); },
                                      {"num_sequences is 0; expected at least 1"}));
}

}  // namespace
}  // namespace ringattn::train
