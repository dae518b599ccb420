// The plan of a ring step (visible_pairs) against the mask itself: over all steps, the block calls
// of a rank cover every (query, key) pair its queries see exactly once, a masked call's mask (from
// its starts) is the true one on every pair it holds, and a call without mask arithmetic is fully
// visible. Also the load balance that motivates the zigzag layout: under a causal mask every rank
// sees the same number of pairs at every step, and every step is one block call.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/ring.hpp"

namespace ringattn {
namespace {

constexpr SequenceLayoutKind kKinds[] = {SequenceLayoutKind::contiguous,
                                         SequenceLayoutKind::zigzag};

// The owner of the K/V shard a rank holds at a step: it came from rank - step.
int visiting_rank(int rank, int step, int world) {
  return (rank - step + world) % world;
}

// Visible (query, key) pairs a block call computes, by global positions.
std::int64_t visible_in(const BlockPair& p, const std::vector<std::int64_t>& q_pos,
                        const std::vector<std::int64_t>& k_pos, bool causal) {
  std::int64_t count = 0;
  for (std::int64_t i = p.q_local_start; i < p.q_local_start + p.q_length; ++i) {
    for (std::int64_t j = p.k_local_start; j < p.k_local_start + p.k_length; ++j) {
      count += !causal || k_pos[j] <= q_pos[i];
    }
  }
  return count;
}

TEST(RingSchedule, CallsCoverEveryVisiblePairOnce) {
  for (SequenceLayoutKind kind : kKinds) {
    for (int world : {1, 2, 3, 4, 8}) {
      for (bool causal : {false, true}) {
        const std::int64_t total = 2 * world * 3;
        SCOPED_TRACE(std::string(sequence_layout_name(kind)) + " over " + std::to_string(world) +
                     (causal ? ", causal" : ""));
        for (int rank = 0; rank < world; ++rank) {
          const SequenceLayout mine(kind, world, rank, total);
          const std::vector<std::int64_t> q_pos = mine.global_positions();
          // covered[query position][key position]
          std::vector<std::vector<int>> covered(total, std::vector<int>(total, 0));
          for (int step = 0; step < world; ++step) {
            const SequenceLayout visiting = mine.for_rank(visiting_rank(rank, step, world));
            const std::vector<std::int64_t> k_pos = visiting.global_positions();
            for (const BlockPair& p : visible_pairs(mine, visiting, causal)) {
              ASSERT_GT(p.q_length, 0);
              ASSERT_GT(p.k_length, 0);
              ASSERT_LE(p.q_local_start + p.q_length, mine.local_length());
              ASSERT_LE(p.k_local_start + p.k_length, visiting.local_length());
              ASSERT_TRUE(!p.causal || causal) << "a mask on a call without one";
              if (p.causal) {
                // The block masks key j of the call against query i by the starts it is given.
                for (std::int64_t i = 0; i < p.q_length; ++i) {
                  for (std::int64_t j = 0; j < p.k_length; ++j) {
                    const bool block_sees = p.k_global_start + j <= p.q_global_start + i;
                    const bool visible = k_pos[p.k_local_start + j] <= q_pos[p.q_local_start + i];
                    ASSERT_EQ(block_sees, visible)
                        << "step " << step << ", call rows " << i << ", key " << j;
                  }
                }
              } else {
                EXPECT_EQ(visible_in(p, q_pos, k_pos, causal), p.q_length * p.k_length)
                    << "an unmasked call holds masked pairs (step " << step << ")";
              }
              for (std::int64_t i = p.q_local_start; i < p.q_local_start + p.q_length; ++i) {
                for (std::int64_t j = p.k_local_start; j < p.k_local_start + p.k_length; ++j) {
                  if (!causal || k_pos[j] <= q_pos[i]) ++covered[q_pos[i]][k_pos[j]];
                }
              }
            }
          }
          for (std::int64_t qi : q_pos) {
            for (std::int64_t kj = 0; kj < total; ++kj) {
              ASSERT_EQ(covered[qi][kj], !causal || kj <= qi ? 1 : 0)
                  << "rank " << rank << ": query " << qi << ", key " << kj;
            }
          }
        }
      }
    }
  }
}

TEST(RingSchedule, ZigzagBalancesCausalWork) {
  for (int world : {2, 3, 4, 8}) {
    const std::int64_t total = 2 * world * 4;
    for (int step = 0; step < world; ++step) {
      std::vector<std::int64_t> work;
      for (int rank = 0; rank < world; ++rank) {
        const SequenceLayout mine(SequenceLayoutKind::zigzag, world, rank, total);
        const SequenceLayout visiting = mine.for_rank(visiting_rank(rank, step, world));
        const std::vector<BlockPair> pairs = visible_pairs(mine, visiting, true);
        std::int64_t visible = 0;
        for (const BlockPair& p : pairs) {
          visible += visible_in(p, mine.global_positions(), visiting.global_positions(), true);
        }
        work.push_back(visible);
        // Off the diagonal a step is half a block, in one call; the first step is the rank's own
        // two chunks, one causal call over local positions.
        ASSERT_EQ(pairs.size(), 1u) << world << " ranks, step " << step;
        EXPECT_EQ(pairs[0].causal, step == 0) << world << " ranks, step " << step;
      }
      for (int rank = 1; rank < world; ++rank) {
        EXPECT_EQ(work[rank], work[0]) << world << " ranks, step " << step << ", rank " << rank;
      }
    }
  }
}

TEST(RingSchedule, ContiguousCausalSkipsTheFuture) {
  // Rank 0 under a causal mask sees only its own shard; rank N-1 sees every shard.
  const int world = 4;
  const SequenceLayout first(SequenceLayoutKind::contiguous, world, 0, 32);
  const SequenceLayout last = first.for_rank(world - 1);
  for (int step = 1; step < world; ++step) {
    EXPECT_TRUE(visible_pairs(first, first.for_rank(visiting_rank(0, step, world)), true).empty());
    const std::vector<BlockPair> pairs =
        visible_pairs(last, last.for_rank(visiting_rank(world - 1, step, world)), true);
    ASSERT_EQ(pairs.size(), 1u);
    EXPECT_FALSE(pairs[0].causal);
  }
  const std::vector<BlockPair> own = visible_pairs(first, first, true);
  ASSERT_EQ(own.size(), 1u);
  EXPECT_EQ(own[0], (BlockPair{0, 8, 0, 0, 8, 0, true}));
}

}  // namespace
}  // namespace ringattn
