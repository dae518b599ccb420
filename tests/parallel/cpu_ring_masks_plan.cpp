// The ring's plan under windows and packed documents against a brute-force count of the visible
// (query, key) pairs, written here from the mask's definition (not from MaskRule):
//   - over all N steps, the block calls of a rank cover every pair its queries see (in some batch
//     row) exactly once and no pair twice; a call without mask arithmetic holds only pairs that
//     every batch row sees; a masked call's mask, evaluated at the starts it is given, is the true
//     one on every pair it holds;
//   - ring_steps is one more than the farthest hop at which some rank sees a visiting shard, and
//     no rank has a call at a later step;
// for every rank count 1 to 8, both layouts, causal and not, windows of 1, chunk - 1, chunk,
// chunk + 1 and several chunks (left, right, both), documents with boundaries at chunk edges, one
// long document across several shards, empty documents (a repeated start, starts past the end),
// per-batch lists, and documents with a window. Also the step counts the design promises, and the
// planner's balance (ring_balance: each rank's visible pairs, the same brute-force count) and
// document descriptions (document_starts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "ringattn/error.hpp"

#include "parallel/performance_model.hpp"
#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"

namespace ringattn {
namespace {

constexpr SequenceLayoutKind kKinds[] = {SequenceLayoutKind::contiguous,
                                         SequenceLayoutKind::zigzag};

// The call throws Error whose message holds every part.
template <typename F>
testing::AssertionResult test_throws_naming(F&& call, std::initializer_list<std::string> parts) {
  try {
    call();
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        return testing::AssertionFailure() << "\"" << message << "\" lacks \"" << part << "\"";
      }
    }
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure() << "no Error";
}

// One mask of the sweep; starts: one list (shared) or one per batch row.
struct MaskCase {
  std::string name;
  bool causal = false;
  std::int64_t window_left = 0, window_right = 0;
  std::vector<std::vector<std::int64_t>> starts;  // [batch row][i]; empty: no documents
};

// The query at i sees the key at j in batch row `row`, by the definition (attention.hpp).
bool sees(const MaskCase& m, std::size_t row, std::int64_t i, std::int64_t j) {
  if (m.causal && j > i) return false;
  if (m.window_left > 0 && i - j >= m.window_left) return false;
  if (m.window_right > 0 && j - i >= m.window_right) return false;
  if (!m.starts.empty()) {
    const std::vector<std::int64_t>& list = m.starts[std::min(row, m.starts.size() - 1)];
    const auto document = [&](std::int64_t p) {
      return std::count_if(list.begin(), list.end(), [&](std::int64_t s) { return s <= p; });
    };
    if (document(i) != document(j)) return false;
  }
  return true;
}

// The RingMask of a case: the lists packed one after the other (equal counts).
struct PlannedMask {
  std::vector<std::int64_t> packed;
  RingMask mask;
};

PlannedMask planned(const MaskCase& m) {
  PlannedMask p;
  p.mask.mask.causal = m.causal;
  p.mask.mask.window_left = m.window_left;
  p.mask.mask.window_right = m.window_right;
  p.mask.batch = std::max<std::int64_t>(1, static_cast<std::int64_t>(m.starts.size()));
  if (!m.starts.empty()) {
    for (const auto& list : m.starts) p.packed.insert(p.packed.end(), list.begin(), list.end());
    const auto count = static_cast<std::int64_t>(m.starts[0].size());
    p.mask.mask.documents = {p.packed.data(), count, m.starts.size() > 1 ? count : 0};
  }
  return p;
}

// The masks of the sweep for a sequence of `total` tokens in chunks of `chunk` (the zigzag chunk;
// a contiguous shard is two of them).
std::vector<MaskCase> mask_cases(std::int64_t total, std::int64_t chunk) {
  std::vector<MaskCase> cases;
  for (bool causal : {true, false}) {
    const std::string c = causal ? "causal " : "";
    for (std::int64_t w : {std::int64_t{1}, chunk - 1, chunk, chunk + 1, 3 * chunk + 2}) {
      if (w < 1) continue;
      cases.push_back({c + "left " + std::to_string(w), causal, w, 0, {}});
      cases.push_back({c + "right " + std::to_string(w), causal, 0, w, {}});
      cases.push_back({c + "left and right " + std::to_string(w), causal, w, w / 2 + 1, {}});
    }
    // Boundaries exactly at chunk edges (and so at shard edges of both layouts).
    std::vector<std::int64_t> edges;
    for (std::int64_t s = 0; s < total; s += chunk) edges.push_back(s);
    cases.push_back({c + "documents at chunk edges", causal, 0, 0, {edges}});
    // One long document across several shards, short ones around it, an empty one (a repeated
    // start) and starts past the end (empty documents of padding).
    cases.push_back({c + "long document",
                     causal,
                     0,
                     0,
                     {{1, 3, 3, total / 8 + 1, total - 2, total, total + 5}}});
    // Per-batch lists of equal counts: another split in each row.
    cases.push_back(
        {c + "per-batch documents",
         causal,
         0,
         0,
         {{0, chunk, chunk + 1, total / 2, total}, {2, 2, total - chunk, total, total}}});
    cases.push_back(
        {c + "documents and a window", causal, chunk + 1, 3, {{chunk / 2, 2 * chunk + 1}}});
  }
  // Starts are non-decreasing (short sequences bring total / 8 below 3, total / 2 below chunk + 1).
  for (MaskCase& m : cases) {
    for (auto& list : m.starts) std::sort(list.begin(), list.end());
  }
  return cases;
}

TEST(RingMasks, CallsCoverEveryVisiblePairOnceAndStepsReachTheFarthest) {
  for (SequenceLayoutKind kind : kKinds) {
    for (int world = 1; world <= 8; ++world) {
      for (std::int64_t chunk : {std::int64_t{3}, std::int64_t{4}}) {
        const std::int64_t total = 2 * world * chunk;
        for (const MaskCase& m : mask_cases(total, chunk)) {
          SCOPED_TRACE(std::string(sequence_layout_name(kind)) + " over " + std::to_string(world) +
                       ", chunk " + std::to_string(chunk) + ", " + m.name);
          const PlannedMask plan = planned(m);
          const std::size_t rows = std::max<std::size_t>(1, m.starts.size());
          const auto seen_by_any = [&](std::int64_t i, std::int64_t j) {
            for (std::size_t b = 0; b < rows; ++b) {
              if (sees(m, b, i, j)) return true;
            }
            return false;
          };
          const SequenceLayout layout(kind, world, 0, total);
          int farthest = 0;  // brute force: the farthest hop with a visible pair
          for (int rank = 0; rank < world; ++rank) {
            const SequenceLayout mine = layout.for_rank(rank);
            const std::vector<std::int64_t> q_pos = mine.global_positions();
            std::vector<std::vector<int>> covered(total, std::vector<int>(total, 0));
            for (int hop = 0; hop < world; ++hop) {
              const SequenceLayout visiting = layout.for_rank((rank - hop + world) % world);
              const std::vector<std::int64_t> k_pos = visiting.global_positions();
              std::int64_t visible = 0;
              for (std::int64_t qi : q_pos) {
                for (std::int64_t kj : k_pos) visible += seen_by_any(qi, kj);
              }
              if (visible > 0) farthest = std::max(farthest, hop);
              const std::vector<BlockPair> pairs = visible_pairs(mine, visiting, plan.mask);
              EXPECT_EQ(visible > 0, !pairs.empty()) << "rank " << rank << ", hop " << hop;
              EXPECT_EQ(visible > 0, shard_needed(mine, visiting, plan.mask));
              for (const BlockPair& p : pairs) {
                ASSERT_GT(p.q_length, 0);
                ASSERT_GT(p.k_length, 0);
                ASSERT_LE(p.q_local_start + p.q_length, mine.local_length());
                ASSERT_LE(p.k_local_start + p.k_length, visiting.local_length());
                for (std::int64_t i = 0; i < p.q_length; ++i) {
                  for (std::int64_t j = 0; j < p.k_length; ++j) {
                    const std::int64_t qi = q_pos[p.q_local_start + i];
                    const std::int64_t kj = k_pos[p.k_local_start + j];
                    ++covered[qi][kj];
                    for (std::size_t b = 0; b < rows; ++b) {
                      // What the block computes for this pair in batch row b.
                      const bool block_sees =
                          !p.causal || sees(m, b, p.q_global_start + i, p.k_global_start + j);
                      ASSERT_EQ(block_sees, sees(m, b, qi, kj))
                          << "hop " << hop << ", query " << qi << ", key " << kj << ", row " << b
                          << (p.causal ? " (masked call)" : " (call without mask)");
                    }
                  }
                }
              }
            }
            for (std::int64_t qi : q_pos) {
              for (std::int64_t kj = 0; kj < total; ++kj) {
                ASSERT_LE(covered[qi][kj], 1)
                    << "rank " << rank << ": query " << qi << ", key " << kj << " in two calls";
                if (seen_by_any(qi, kj)) {
                  ASSERT_EQ(covered[qi][kj], 1) << "rank " << rank << ": visible query " << qi
                                                << ", key " << kj << " in no call";
                }
              }
            }
          }
          ASSERT_EQ(ring_steps(layout, plan.mask), farthest + 1);
          for (int rank = 0; rank < world; ++rank) {
            EXPECT_EQ(ring_steps(layout.for_rank(rank), plan.mask), farthest + 1)
                << "rank " << rank << " counts other steps";
          }
        }
      }
    }
  }
}

// The step counts the design promises, by hand: a causal window within the previous contiguous
// shard moves K/V one hop, one reaching a shard further needs one step more, documents that end
// at shard edges need no transfer, and under zigzag the second chunk's neighbour lies on the next
// rank, so any window wider than 1 needs every step.
TEST(RingMasks, StepCountsByHand) {
  const int world = 4;
  const std::int64_t shard = 16, total = world * shard;
  const SequenceLayout contiguous(SequenceLayoutKind::contiguous, world, 0, total);
  const SequenceLayout zigzag(SequenceLayoutKind::zigzag, world, 0, total);
  const auto window = [](std::int64_t left, std::int64_t right, bool causal) {
    RingMask m;
    m.mask.causal = causal;
    m.mask.window_left = left;
    m.mask.window_right = right;
    return m;
  };
  EXPECT_EQ(ring_steps(contiguous, window(0, 0, true)), world);
  EXPECT_EQ(ring_steps(contiguous, window(1, 0, true)), 1);
  EXPECT_EQ(ring_steps(contiguous, window(shard, 0, true)), 2);
  EXPECT_EQ(ring_steps(contiguous, window(shard + 1, 0, true)), 2);
  EXPECT_EQ(ring_steps(contiguous, window(shard + 2, 0, true)), 3);
  // Non-causal: the next shard is N - 1 hops away.
  EXPECT_EQ(ring_steps(contiguous, window(shard, 2, false)), world);
  EXPECT_EQ(ring_steps(contiguous, window(shard, 1, false)), 2);
  EXPECT_EQ(ring_steps(zigzag, window(1, 0, true)), 1);
  EXPECT_EQ(ring_steps(zigzag, window(2, 0, true)), world);

  std::vector<std::int64_t> edges = {0, shard, 2 * shard, 3 * shard};
  RingMask documents;
  documents.mask.causal = true;
  documents.mask.documents = {edges.data(), 4, 0};
  EXPECT_EQ(ring_steps(contiguous, documents), 1);
  documents.mask.causal = false;
  EXPECT_EQ(ring_steps(contiguous, documents), 1);
  // One start moved into the previous shard: its document's keys now lie one hop back.
  edges[2] = 2 * shard - 1;
  EXPECT_EQ(ring_steps(contiguous, documents), world);  // non-causal: one hop forward too
  documents.mask.causal = true;
  EXPECT_EQ(ring_steps(contiguous, documents), 2);
}

// ring_balance counts each rank's visible pairs and the steps as the brute force does.
TEST(RingMasks, BalanceCountsVisiblePairsByRank) {
  for (SequenceLayoutKind kind : kKinds) {
    for (int world : {1, 2, 3, 4}) {
      const std::int64_t chunk = 5, total = 2 * world * chunk;
      for (const MaskCase& m : mask_cases(total, chunk)) {
        if (m.starts.size() > 1) continue;  // one batch row
        SCOPED_TRACE(std::string(sequence_layout_name(kind)) + " over " + std::to_string(world) +
                     ", " + m.name);
        const PlannedMask plan = planned(m);
        const RingBalance balance = ring_balance(kind, world, total, plan.mask.mask);
        ASSERT_EQ(balance.visible_pairs.size(), static_cast<std::size_t>(world));
        double sum = 0, most = 0;
        for (int rank = 0; rank < world; ++rank) {
          double pairs = 0;
          for (std::int64_t qi : SequenceLayout(kind, world, rank, total).global_positions()) {
            for (std::int64_t kj = 0; kj < total; ++kj) pairs += sees(m, 0, qi, kj);
          }
          EXPECT_EQ(balance.visible_pairs[rank], pairs) << "rank " << rank;
          sum += pairs;
          most = std::max(most, pairs);
        }
        EXPECT_DOUBLE_EQ(balance.imbalance(), most / (sum / world));
        EXPECT_EQ(balance.steps, ring_steps(SequenceLayout(kind, world, 0, total), plan.mask));
      }
    }
  }
}

// lognormal:MEAN:SEED covers the sequence from 0 with non-decreasing starts of about MEAN tokens
// apart; :LONG adds a whole document of exactly LONG tokens (even one nearly as long as the
// sequence); file:PATH reads the starts; bad
// descriptions are named.
TEST(RingMasks, DocumentDescriptions) {
  const std::int64_t seq = 1 << 20;
  const std::vector<std::int64_t> starts = document_starts("lognormal:8192:3", seq);
  ASSERT_FALSE(starts.empty());
  EXPECT_EQ(starts[0], 0);
  EXPECT_TRUE(std::is_sorted(starts.begin(), starts.end()));
  EXPECT_LT(starts.back(), seq);
  const double mean_length = static_cast<double>(seq) / static_cast<double>(starts.size());
  EXPECT_GT(mean_length, 8192 * 0.7);  // 128 draws of sigma 1: the mean within about 20%
  EXPECT_LT(mean_length, 8192 * 1.3);
  EXPECT_EQ(document_starts("lognormal:8192:3", seq), starts) << "the same seed, other starts";
  for (int seed = 0; seed < 20; ++seed) {
    const std::vector<std::int64_t> with_long =
        document_starts("lognormal:8192:" + std::to_string(seed) + ":900000", seq);
    bool found = false;
    for (std::size_t i = 0; i + 1 < with_long.size(); ++i) {
      found = found || with_long[i + 1] - with_long[i] == 900000;
    }
    EXPECT_TRUE(found) << "seed " << seed << ": no whole document of 900000 tokens";
  }

  const std::string path = testing::TempDir() + "ringattn_starts.txt";
  std::ofstream(path) << "0, 17 17\n40\n";
  EXPECT_EQ(document_starts("file:" + path, 64), (std::vector<std::int64_t>{0, 17, 17, 40}));
  std::ofstream(path) << "5 9 3\n";
  EXPECT_TRUE(test_throws_naming([&] { document_starts("file:" + path, 64); },
                                 {"start 2 is 3", "non-decreasing"}));
  std::remove(path.c_str());
  EXPECT_TRUE(test_throws_naming([&] { document_starts("lognormal:0:1", 64); },
                                 {"lognormal:0:1", "MEAN is '0'", ">= 1"}));
  EXPECT_TRUE(test_throws_naming([&] { document_starts("uniform:5", 64); },
                                 {"'uniform:5'", "expected lognormal:MEAN:SEED"}));
}

}  // namespace
}  // namespace ringattn
