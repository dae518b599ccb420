// The retrieval task: samples are a pure function of (seed, split, index); the held-out split is
// disjoint from training; every answer is the value that follows its key earlier in the sequence
// (checked by searching the sequence, independently of how the generator placed it); queried pairs
// land anywhere in the context, so in every rank's shard; the loss mask marks exactly the answers;
// scoring counts a query right only when all its value tokens are.
#include "train/retrieval_task.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "train/shard_ranges.hpp"

namespace ringattn::train {
namespace {

RetrievalSpec spec_with(int vocab, std::int64_t seq_len, int pairs, int key_tokens,
                        int value_tokens, int queries) {
  return RetrievalSpec{vocab, seq_len, pairs, key_tokens, value_tokens, queries, test::test_seed()};
}

TEST(RetrievalTask, SamplesArePureFunctionsOfSeedSplitAndIndex) {
  SCOPED_TRACE(test::seed_trace());
  const RetrievalSpec spec = spec_with(256, 1024, 16, 2, 2, 4);
  const RetrievalTask a(spec), b(spec);
  for (const std::uint64_t index : {0ull, 1ull, 12345ull}) {
    const RetrievalSample x = a.sample(RetrievalSplit::train, index);
    const RetrievalSample y = b.sample(RetrievalSplit::train, index);
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.loss_mask, y.loss_mask);
    EXPECT_EQ(x.answer_targets, y.answer_targets);
  }
  EXPECT_NE(a.sample(RetrievalSplit::train, 0).tokens, a.sample(RetrievalSplit::train, 1).tokens);
  RetrievalSpec other = spec;
  other.seed += 1;
  EXPECT_NE(a.sample(RetrievalSplit::train, 0).tokens,
            RetrievalTask(other).sample(RetrievalSplit::train, 0).tokens);
}

TEST(RetrievalTask, HeldOutSamplesAreNotTrainingSamples) {
  SCOPED_TRACE(test::seed_trace());
  const RetrievalTask task(spec_with(256, 256, 8, 1, 1, 8));
  std::set<std::vector<std::int32_t>> train;
  for (std::uint64_t i = 0; i < 500; ++i)
    train.insert(task.sample(RetrievalSplit::train, i).tokens);
  for (std::uint64_t i = 0; i < 500; ++i) {
    EXPECT_FALSE(train.contains(task.sample(RetrievalSplit::held_out, i).tokens)) << i;
  }
}

// Independent of the generator's bookkeeping: for each query, take the key that precedes its
// answer, find that key in the body of the sequence, and check that the answer is the value
// written right after it.
TEST(RetrievalTask, EveryAnswerIsTheValueStoredEarlierUnderItsKey) {
  SCOPED_TRACE(test::seed_trace());
  for (const auto& spec : {spec_with(256, 512, 8, 1, 1, 8), spec_with(64, 2048, 40, 2, 3, 5),
                           spec_with(1000, 300, 3, 3, 1, 1)}) {
    const RetrievalTask task(spec);
    const int k = spec.key_tokens, v = spec.value_tokens;
    for (std::uint64_t index = 0; index < 50; ++index) {
      const RetrievalSample s = task.sample(RetrievalSplit::train, index);
      ASSERT_EQ(static_cast<std::int64_t>(s.tokens.size()), spec.seq_len + 1);
      ASSERT_EQ(static_cast<std::int64_t>(s.loss_mask.size()), spec.seq_len);
      ASSERT_EQ(s.answer_targets.size(), static_cast<std::size_t>(spec.queries * v));
      for (const std::int32_t t : s.tokens) {
        ASSERT_GE(t, 0);
        ASSERT_LT(t, spec.vocab_size);
      }
      const std::int64_t body = spec.seq_len + 1 - spec.queries * (1 + k + v);
      EXPECT_EQ(std::count(s.tokens.begin(), s.tokens.begin() + body, RetrievalTask::kQueryMarker),
                0);
      for (int q = 0; q < spec.queries; ++q) {
        const std::int64_t first_answer = s.answer_targets[q * v] + 1;  // token position
        ASSERT_EQ(s.tokens[first_answer - k - 1], RetrievalTask::kQueryMarker);
        const std::vector<std::int32_t> key(s.tokens.begin() + first_answer - k,
                                            s.tokens.begin() + first_answer);
        std::vector<std::int64_t> found;
        for (std::int64_t p = 0; p + k <= body; ++p) {
          if (std::equal(key.begin(), key.end(), s.tokens.begin() + p)) found.push_back(p);
        }
        ASSERT_EQ(found.size(), 1u) << "the key of query " << q << " must occur once in the body";
        for (int i = 0; i < v; ++i) {
          EXPECT_EQ(s.answer_targets[q * v + i], first_answer - 1 + i);
          EXPECT_EQ(s.tokens[first_answer + i], s.tokens[found[0] + k + i]) << "query " << q;
        }
        EXPECT_EQ(found[0], s.pair_positions[s.queried_pairs[q]]);
      }
      std::set<int> asked(s.queried_pairs.begin(), s.queried_pairs.end());
      EXPECT_EQ(asked.size(), static_cast<std::size_t>(spec.queries))
          << "queries ask distinct pairs";
    }
  }
}

TEST(RetrievalTask, LossMaskMarksExactlyTheAnswers) {
  SCOPED_TRACE(test::seed_trace());
  const RetrievalTask task(spec_with(256, 1024, 20, 2, 2, 6));
  for (std::uint64_t index = 0; index < 20; ++index) {
    const RetrievalSample s = task.sample(RetrievalSplit::held_out, index);
    const std::set<std::int64_t> answers(s.answer_targets.begin(), s.answer_targets.end());
    for (std::int64_t t = 0; t < 1024; ++t) {
      EXPECT_EQ(s.loss_mask[t], answers.contains(t) ? 1.0f : 0.0f) << "target " << t;
      if (answers.contains(t)) {
        EXPECT_GE(s.tokens[t + 1], task.first_value_symbol());
        EXPECT_LT(s.tokens[t + 1], task.first_filler_symbol());
      }
    }
  }
}

// The queried pair sits anywhere: over many samples the queried positions reach both ends of the
// context and every one of the 8 zigzag chunks of cp = 4, i.e. every rank's shard.
TEST(RetrievalTask, QueriedPairsSpanTheWholeContext) {
  SCOPED_TRACE(test::seed_trace());
  const std::int64_t seq_len = 4096;
  const RetrievalTask task(spec_with(256, seq_len, 4, 1, 1, 1));
  std::int64_t earliest = seq_len, latest = 0;
  std::set<std::int64_t> chunks_hit;
  for (std::uint64_t index = 0; index < 400; ++index) {
    const RetrievalSample s = task.sample(RetrievalSplit::train, index);
    const std::int64_t position = s.pair_positions[s.queried_pairs[0]];
    earliest = std::min(earliest, position);
    latest = std::max(latest, position);
    chunks_hit.insert(position / (seq_len / 8));
  }
  EXPECT_LT(earliest, seq_len / 20);
  EXPECT_GT(latest, seq_len * 9 / 10);
  EXPECT_EQ(chunks_hit.size(), 8u) << "every zigzag chunk (2 per rank) holds some queried pair";
}

TEST(RetrievalTask, ShardOfASampleCarriesItsMask) {
  SCOPED_TRACE(test::seed_trace());
  const RetrievalTask task(spec_with(256, 256, 8, 1, 1, 8));
  const RetrievalSample s = task.sample(RetrievalSplit::train, 3);
  float total = 0.0f;
  for (int rank = 0; rank < 2; ++rank) {
    const TokenShard shard =
        take_shard(s.tokens, s.loss_mask, shard_ranges(256, 2, rank, ShardLayout::zigzag));
    for (float m : shard.loss_mask) total += m;
  }
  EXPECT_EQ(total, 8.0f);
  // The answers are at the end of the sequence: the last zigzag chunk, which rank 0 holds.
  const TokenShard rank0 =
      take_shard(s.tokens, s.loss_mask, shard_ranges(256, 2, 0, ShardLayout::zigzag));
  EXPECT_EQ(std::count(rank0.loss_mask.begin(), rank0.loss_mask.end(), 1.0f), 8);
}

TEST(RetrievalTask, ScoreCountsWholeAnswers) {
  SCOPED_TRACE(test::seed_trace());
  const RetrievalTask task(spec_with(256, 512, 10, 1, 2, 4));
  const RetrievalSample s = task.sample(RetrievalSplit::held_out, 0);
  std::vector<std::int32_t> right;
  for (const std::int64_t t : s.answer_targets) right.push_back(s.tokens[t + 1]);
  RetrievalScore score = score_answers(s, 2, right);
  EXPECT_EQ(score.queries, 4);
  EXPECT_EQ(score.correct, 4);
  EXPECT_EQ(score.accuracy(), 1.0);

  std::vector<std::int32_t> one_wrong = right;
  one_wrong[3] += 1;  // the second value token of query 1
  score += score_answers(s, 2, one_wrong);
  EXPECT_EQ(score.queries, 8);
  EXPECT_EQ(score.correct, 7);
  EXPECT_DOUBLE_EQ(score.accuracy(), 7.0 / 8.0);

  EXPECT_TRUE(
      test::throws_error_with([&] { score_answers(s, 2, std::vector<std::int32_t>(7)); },
                              {"predicted has 7 tokens; expected one per answer target (8)"}));
}

TEST(RetrievalTask, SpecProblemsNameTheConfigKeys) {
  EXPECT_TRUE(check_retrieval_spec(spec_with(256, 256, 8, 1, 1, 8)).empty());
  EXPECT_TRUE(
      test::throws_error_with([] { RetrievalTask(spec_with(256, 256, 64, 1, 1, 8)); },
                              {"data.retrieval.pairs (64) is more than the 63 distinct keys"}));
  EXPECT_TRUE(test::throws_error_with(
      [] { RetrievalTask(spec_with(256, 256, 4, 1, 1, 5)); },
      {"data.retrieval.queries (5) is more than data.retrieval.pairs (4)"}));
  EXPECT_TRUE(test::throws_error_with([] { RetrievalTask(spec_with(256, 10, 4, 1, 1, 2)); },
                                      {"need 14 tokens", "train.seq_len + 1 = 11"}));
  EXPECT_TRUE(test::throws_error_with([] { RetrievalTask(spec_with(4, 256, 1, 1, 1, 1)); },
                                      {"model.vocab_size (4) is too small"}));
  EXPECT_TRUE(test::throws_error_with([] { RetrievalTask(spec_with(256, 256, 1, 0, 1, 1)); },
                                      {"data.retrieval.key_tokens is 0; expected at least 1"}));
}

}  // namespace
}  // namespace ringattn::train
