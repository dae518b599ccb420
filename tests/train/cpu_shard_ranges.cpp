// The data side's shard rule (train/shard_ranges.hpp), which must agree with parallel/'s sequence
// layouts: pinned on small examples, a partition of the sequence for every cp, and the slicing of
// a sample into a rank's inputs, targets and loss mask.
#include "train/shard_ranges.hpp"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"

namespace ringattn::train {
namespace {

using R = TokenRange;

TEST(ShardRanges, ZigzagPinned) {
  // 16 tokens, cp = 4: eight chunks of 2; rank r holds chunks r and 7 - r.
  EXPECT_EQ(shard_ranges(16, 4, 0, ShardLayout::zigzag), (std::vector<R>{{0, 2}, {14, 16}}));
  EXPECT_EQ(shard_ranges(16, 4, 1, ShardLayout::zigzag), (std::vector<R>{{2, 4}, {12, 14}}));
  EXPECT_EQ(shard_ranges(16, 4, 2, ShardLayout::zigzag), (std::vector<R>{{4, 6}, {10, 12}}));
  EXPECT_EQ(shard_ranges(16, 4, 3, ShardLayout::zigzag), (std::vector<R>{{6, 8}, {8, 10}}));
  EXPECT_EQ(shard_ranges(8, 1, 0, ShardLayout::zigzag), (std::vector<R>{{0, 4}, {4, 8}}));
}

TEST(ShardRanges, ContiguousPinned) {
  EXPECT_EQ(shard_ranges(12, 3, 0, ShardLayout::contiguous), (std::vector<R>{{0, 4}}));
  EXPECT_EQ(shard_ranges(12, 3, 2, ShardLayout::contiguous), (std::vector<R>{{8, 12}}));
}

// Every position is held by exactly one rank, and every rank holds seq_len / cp of them.
TEST(ShardRanges, EveryLayoutPartitionsTheSequence) {
  for (const ShardLayout layout : {ShardLayout::zigzag, ShardLayout::contiguous}) {
    for (int cp = 1; cp <= 8; ++cp) {
      const std::int64_t seq_len = 2 * cp * 5;
      std::vector<int> owners(seq_len, 0);
      for (int rank = 0; rank < cp; ++rank) {
        std::int64_t held = 0;
        for (const TokenRange& r : shard_ranges(seq_len, cp, rank, layout)) {
          for (std::int64_t i = r.begin; i < r.end; ++i) ++owners[i];
          held += r.size();
        }
        EXPECT_EQ(held, seq_len / cp) << layout_name(layout) << " cp " << cp << " rank " << rank;
      }
      for (std::int64_t i = 0; i < seq_len; ++i) {
        EXPECT_EQ(owners[i], 1) << layout_name(layout) << " cp " << cp << " position " << i;
      }
    }
  }
}

TEST(ShardRanges, RejectsWhatTheLayoutCannotSplit) {
  EXPECT_TRUE(test::throws_error_with(
      [] { shard_ranges(250, 2, 0, ShardLayout::zigzag); },
      {"seq_len is 250", "zigzag layout over 2 ranks needs a positive multiple of 4"}));
  EXPECT_TRUE(test::throws_error_with([] { shard_ranges(10, 3, 0, ShardLayout::contiguous); },
                                      {"seq_len is 10", "multiple of 3"}));
  EXPECT_TRUE(test::throws_error_with([] { shard_ranges(16, 2, 2, ShardLayout::zigzag); },
                                      {"cp_rank is 2; expected 0 <= cp_rank < 2"}));
}

TEST(ShardRanges, TakeShardSlicesInputsTargetsAndMask) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng();
  const std::int64_t seq_len = 24;
  std::vector<std::int32_t> tokens(seq_len + 1);
  std::vector<float> mask(seq_len);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 1000);
  for (auto& m : mask) m = static_cast<float>(rng() % 2);
  const auto ranges = shard_ranges(seq_len, 3, 1, ShardLayout::zigzag);  // [4,8) and [16,20)
  const TokenShard shard = take_shard(tokens, mask, ranges);
  const std::vector<std::int64_t> positions = {4, 5, 6, 7, 16, 17, 18, 19};
  ASSERT_EQ(shard.inputs.size(), positions.size());
  ASSERT_EQ(shard.targets.size(), positions.size());
  ASSERT_EQ(shard.loss_mask.size(), positions.size());
  for (std::size_t i = 0; i < positions.size(); ++i) {
    EXPECT_EQ(shard.inputs[i], tokens[positions[i]]);
    EXPECT_EQ(shard.targets[i], tokens[positions[i] + 1]);
    EXPECT_EQ(shard.loss_mask[i], mask[positions[i]]);
  }
  EXPECT_TRUE(
      test::throws_error_with([&] { take_shard(std::span(tokens).first(seq_len), mask, ranges); },
                              {"tokens has 24 entries; expected seq_len + 1 = 25"}));
}

}  // namespace
}  // namespace ringattn::train
