// The interval form of the mask (src/mask_rule.hpp), which every kernel and the ring's schedule
// use to skip and to classify tiles, against the mask's definition checked position by position:
// keys_of, queries_of, any_visible, all_visible and block_reach over every block of small
// sequences, for windows and documents placed at, just before and just after block edges, empty
// documents, starts outside the sequence, positions near the int64 limits, and the checks of a
// Mask's fields.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"
#include "src/mask_rule.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using detail::MaskRule;

struct RuleCase {
  std::string name;
  bool causal;
  std::int64_t window_left, window_right;
  std::vector<std::int64_t> starts;
};

// The definition, literally (an independent copy: the test helpers' sees() is a third).
bool defined_visible(const RuleCase& c, std::int64_t i, std::int64_t j) {
  if (c.causal && j > i) return false;
  if (c.window_left > 0 && i - j >= c.window_left) return false;
  if (c.window_right > 0 && j - i >= c.window_right) return false;
  std::int64_t doc_i = 0, doc_j = 0;
  for (std::int64_t start : c.starts) {
    doc_i += start <= i;
    doc_j += start <= j;
  }
  return doc_i == doc_j;
}

MaskRule rule_of(const RuleCase& c) {
  MaskRule rule;
  rule.causal = c.causal;
  rule.window_left = c.window_left;
  rule.window_right = c.window_right;
  rule.starts = c.starts.data();
  rule.count = static_cast<std::int64_t>(c.starts.size());
  return rule;
}

std::vector<RuleCase> cases() {
  std::vector<RuleCase> out;
  const std::vector<std::vector<std::int64_t>> documents = {
      {},                       // one document
      {16},                     // a boundary at a block edge (blocks of 8 and 16 below)
      {15, 17, 40},             // just before and just after edges
      {0, 0, 5, 5, 5, 33, 70},  // empty documents, a start at 0, a start past the sequence
      {-4, 1, 2, 3, 4, 30},     // a start before the sequence, one-token documents
      {9, 100},                 // a start past the end only
  };
  const std::vector<std::pair<std::int64_t, std::int64_t>> windows = {
      {0, 0}, {1, 0}, {8, 0}, {9, 0}, {7, 3}, {0, 1}, {0, 16}, {3, 3}, {64, 64}};
  int n = 0;
  for (bool causal : {false, true}) {
    for (const auto& [left, right] : windows) {
      for (const auto& starts : documents) {
        out.push_back({"case" + std::to_string(n++), causal, left, right, starts});
      }
    }
  }
  return out;
}

constexpr std::int64_t kLength = 48;

TEST(MaskRule, IntervalsHoldExactlyTheVisibleKeysAndQueries) {
  for (const RuleCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const MaskRule rule = rule_of(c);
    for (std::int64_t p = -3; p < kLength + 3; ++p) {
      const auto keys = rule.keys_of(p), queries = rule.queries_of(p);
      // The intervals hold the diagonal, and exactly the positions the definition allows.
      EXPECT_TRUE(keys.contains(p));
      EXPECT_TRUE(queries.contains(p));
      for (std::int64_t x = -80; x < kLength + 80; ++x) {
        ASSERT_EQ(keys.contains(x), defined_visible(c, p, x)) << "query " << p << " key " << x;
        ASSERT_EQ(queries.contains(x), defined_visible(c, x, p)) << "key " << p << " query " << x;
        ASSERT_EQ(rule.visible(p, x), defined_visible(c, p, x));
      }
    }
  }
}

TEST(MaskRule, BlockClassificationMatchesEveryPair) {
  for (const RuleCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const MaskRule rule = rule_of(c);
    for (std::int64_t rows : {1, 8, 16}) {
      for (std::int64_t keys : {1, 8, 16}) {
        for (std::int64_t qa = 0; qa < kLength; qa += rows) {
          for (std::int64_t ka = 0; ka < kLength; ka += keys) {
            bool any = false, all = true;
            for (std::int64_t i = qa; i < qa + rows; ++i) {
              for (std::int64_t j = ka; j < ka + keys; ++j) {
                const bool seen = defined_visible(c, i, j);
                any = any || seen;
                all = all && seen;
              }
            }
            ASSERT_EQ(rule.any_visible(qa, qa + rows - 1, ka, ka + keys - 1), any)
                << "queries " << qa << "+" << rows << " keys " << ka << "+" << keys;
            ASSERT_EQ(rule.all_visible(qa, qa + rows - 1, ka, ka + keys - 1), all)
                << "queries " << qa << "+" << rows << " keys " << ka << "+" << keys;
          }
        }
      }
    }
  }
}

// A random rule: causal or not, each window side absent or up to `max_window`, up to
// `max_documents` sorted starts in [-10, max_position].
RuleCase random_rule(std::mt19937_64& rng, std::int64_t max_position, std::int64_t max_window,
                     std::int64_t max_documents) {
  std::uniform_int_distribution<std::int64_t> position(-10, max_position), window(0, max_window),
      coin(0, 1);
  RuleCase c{"random", coin(rng) == 1, window(rng) * coin(rng), window(rng) * coin(rng), {}};
  const std::int64_t count = std::uniform_int_distribution<std::int64_t>(0, max_documents)(rng);
  for (std::int64_t n = 0; n < count; ++n) c.starts.push_back(position(rng));
  std::sort(c.starts.begin(), c.starts.end());
  return c;
}

// Random rules over longer sequences: any_visible against a brute-force count.
TEST(MaskRule, RandomRulesMatchTheDefinition) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(91);
  std::uniform_int_distribution<std::int64_t> position(-10, 300);
  for (int trial = 0; trial < 200; ++trial) {
    const RuleCase c = random_rule(rng, 300, 40, 12);
    const MaskRule rule = rule_of(c);
    for (int block = 0; block < 50; ++block) {
      const std::int64_t qa = position(rng), ka = position(rng);
      const std::int64_t qb = qa + std::uniform_int_distribution<std::int64_t>(0, 40)(rng);
      const std::int64_t kb = ka + std::uniform_int_distribution<std::int64_t>(0, 40)(rng);
      bool any = false, all = true;
      for (std::int64_t i = qa; i <= qb; ++i) {
        for (std::int64_t j = ka; j <= kb; ++j) {
          any = any || defined_visible(c, i, j);
          all = all && defined_visible(c, i, j);
        }
      }
      ASSERT_EQ(rule.any_visible(qa, qb, ka, kb), any) << qa << ".." << qb << " x " << ka << ".." << kb;
      ASSERT_EQ(rule.all_visible(qa, qb, ka, kb), all) << qa << ".." << qb << " x " << ka << ".." << kb;
    }
  }
}

// The kernels' classification of tiles (kernels/cuda/flash_forward.cuh: row_block_keys,
// key_block_rows, tile_needs_mask): a block's reach from its first and last members' intervals
// as local ranges of the other side's chunk (block_reach), for chunks anywhere in the sequence and
// partial last tiles, against every pair: a tile is skipped iff it misses `some`, and runs
// without the mask iff it lies inside `every`.
TEST(MaskRule, BlockReachOfTheEndMembersClassifiesEveryTile) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(92);
  std::uniform_int_distribution<std::int64_t> position(-10, 200), length(1, 50);
  using detail::local_range;
  for (int trial = 0; trial < 150; ++trial) {
    const RuleCase c = random_rule(rng, 200, 30, 10);
    const MaskRule rule = rule_of(c);
    const std::int64_t q_start = position(rng), k_start = position(rng);
    const std::int64_t q_len = length(rng), k_len = length(rng);
    // Every pair of the tile [r0, r1] x [k0, k1] (local, inclusive): some seen, all seen.
    const auto pairs = [&](std::int64_t r0, std::int64_t r1, std::int64_t k0, std::int64_t k1) {
      bool any = false, all = true;
      for (std::int64_t i = r0; i <= r1; ++i) {
        for (std::int64_t j = k0; j <= k1; ++j) {
          const bool seen = defined_visible(c, q_start + i, k_start + j);
          any = any || seen;
          all = all && seen;
        }
      }
      return std::pair<bool, bool>{any, all};
    };
    const auto meets = [](const detail::LocalRange& r, std::int64_t a, std::int64_t b) {
      return std::max(a, r.first) < std::min(b + 1, r.last);
    };
    const auto inside = [](const detail::LocalRange& r, std::int64_t a, std::int64_t b) {
      return r.first <= a && b < r.last;
    };
    // Blocks of `block` rows walking key tiles of `tile` (the forward's CTAs), or blocks of keys
    // walking row tiles (the backward's).
    const auto check = [&](bool rows_stay, std::int64_t block, std::int64_t tile) {
      const std::int64_t len = rows_stay ? q_len : k_len, start = rows_stay ? q_start : k_start;
      const std::int64_t other_len = rows_stay ? k_len : q_len;
      const std::int64_t other_start = rows_stay ? k_start : q_start;
      const auto reach_of = [&](std::int64_t member) {
        const std::int64_t p = start + member;
        return local_range(rows_stay ? rule.keys_of(p) : rule.queries_of(p), other_start,
                           other_len);
      };
      for (std::int64_t a = 0; a < len; a += block) {
        const std::int64_t b = std::min(a + block, len) - 1;
        const detail::BlockReach reach = detail::block_reach(reach_of(a), reach_of(b));
        for (std::int64_t t = 0; t < other_len; t += tile) {
          const std::int64_t u = std::min(t + tile, other_len) - 1;
          const auto [any, all] = rows_stay ? pairs(a, b, t, u) : pairs(t, u, a, b);
          ASSERT_EQ(meets(reach.some, t, u), any)
              << (rows_stay ? "rows " : "keys ") << a << ".." << b << ", tile " << t << ".." << u;
          ASSERT_EQ(inside(reach.every, t, u), all)
              << (rows_stay ? "rows " : "keys ") << a << ".." << b << ", tile " << t << ".." << u;
        }
      }
    };
    for (std::int64_t block : {1, 3, 8}) {
      for (std::int64_t tile : {1, 4, 8}) {
        check(true, block, tile);
        check(false, block, tile);
      }
    }
  }
}

// Positions at the int64 limits: the intervals saturate instead of wrapping.
TEST(MaskRule, SaturatesAtTheLimitsOfInt64) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  MaskRule rule;
  rule.window_left = kMax;
  rule.window_right = kMax;
  EXPECT_EQ(rule.keys_of(kMax - 1).end, kMax);
  EXPECT_EQ(rule.keys_of(kMin + 1).begin, kMin);
  EXPECT_EQ(rule.keys_of(kMax - 1).begin, 0);  // i - j < window_left = kMax: j > 0 - 1
  EXPECT_TRUE(rule.visible(kMax - 1, 1));
  EXPECT_FALSE(rule.visible(kMax - 1, kMin + 1));  // i - j passes int64: beyond any window
  rule.window_left = 5;
  EXPECT_EQ(rule.keys_of(kMin + 2).begin, kMin);
  EXPECT_EQ(rule.keys_of(kMax - 1).begin, kMax - 5);
  rule.causal = true;
  EXPECT_EQ(rule.keys_of(kMax - 1).end, kMax);
  EXPECT_EQ(rule.queries_of(kMax - 3).end, kMax);
}

// The local rows of a global interval, for blocks anywhere.
TEST(MaskRule, LocalRangeClampsToTheBlock) {
  using detail::local_range;
  EXPECT_EQ(local_range({5, 9}, 0, 20).first, 5);
  EXPECT_EQ(local_range({5, 9}, 0, 20).last, 9);
  EXPECT_TRUE(local_range({5, 9}, 9, 20).empty());
  EXPECT_TRUE(local_range({5, 9}, -10, 15).empty());
  EXPECT_EQ(local_range({detail::kPositionMin, detail::kPositionMax}, -7, 3).first, 0);
  EXPECT_EQ(local_range({detail::kPositionMin, detail::kPositionMax}, -7, 3).last, 3);
  EXPECT_EQ(local_range({-8, -5}, -7, 3).first, 0);
  EXPECT_EQ(local_range({-8, -5}, -7, 3).last, 2);
}

// The checks of the new fields name the field and its value.
TEST(MaskRule, ChecksNameTheFieldAndValue) {
  const AttentionShape s{2, 10, 10, 2, 2, 8, 8};
  const auto check = [&](const Mask& mask) {
    detail::check_mask(mask, s, Memory::host, "test");
  };
  Mask mask;
  mask.window_left = -3;
  EXPECT_TRUE(test::ThrowsNaming([&] { check(mask); }, {"window_left is -3", "expected 0"}));
  mask = {};
  mask.window_right = -1;
  EXPECT_TRUE(test::ThrowsNaming([&] { check(mask); }, {"window_right is -1"}));
  mask = {};
  mask.documents.count = -2;
  EXPECT_TRUE(test::ThrowsNaming([&] { check(mask); }, {"documents.count (C API: num_documents) is -2"}));
  mask = {};
  mask.documents.count = 3;
  EXPECT_TRUE(test::ThrowsNaming([&] { check(mask); }, {"documents.data (C API: document_starts) is a null pointer with count 3"}));
  const std::vector<std::int64_t> starts = {0, 4, 9, 0, 3, 2};
  mask.documents = {starts.data(), 3, -1};
  EXPECT_TRUE(test::ThrowsNaming([&] { check(mask); }, {"documents.batch_stride (C API: document_batch_stride) is -1"}));
  mask.documents = {starts.data(), 3, 3};  // batch row 1: 0, 3, 2 decreases
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { check(mask); }, {"document start 2 of batch row 1 is 2", "below start 1 (3)",
                             "non-decreasing"}));
  mask.documents = {starts.data(), 3, 0};  // one list for both rows: sorted
  EXPECT_NO_THROW(check(mask));
  // Device lists are not read on the host.
  mask.documents = {starts.data(), 3, 3};
  EXPECT_NO_THROW(detail::check_mask(mask, s, Memory::device, "test"));
}

}  // namespace
}  // namespace ringattn
