// The plan of one ring step: which local-block calls a rank makes with its Q shard against the
// visiting K/V shard. RingAttention (ringattn/ring.hpp) runs the plan; it is separate so that it
// can be checked against the mask on its own.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/sequence_layout.hpp"

namespace ringattn {

// Rows [q_local_start, +q_length) of this rank's Q against rows [k_local_start, +k_length) of the
// visiting K/V shard. `causal` is set for a pair on the diagonal, which needs the mask (given by
// the global starts); every other pair is fully visible and runs without mask arithmetic.
struct BlockPair {
  std::int64_t q_local_start = 0, q_length = 0, q_global_start = 0;
  std::int64_t k_local_start = 0, k_length = 0, k_global_start = 0;
  bool causal = false;

  bool operator==(const BlockPair&) const = default;
};

// The block calls of a step where `queries` holds Q and `keys` is the layout of the rank whose
// K/V visits: every (query chunk, key chunk) pair that some query sees, fully masked pairs
// skipped, fully visible pairs that share their rows or their keys merged into one call (fewer,
// larger calls; fewer merges of the running output). Without a mask: one call, all against all.
std::vector<BlockPair> visible_pairs(const SequenceLayout& queries, const SequenceLayout& keys,
                                     bool causal);

}  // namespace ringattn
