// The plan of one ring step: which local-block calls a rank makes with its Q shard against the
// visiting K/V shard. RingAttention (ringattn/ring.hpp) runs the plan; it is separate so that it
// can be checked against the mask on its own. Also the two halves of the schedule, runnable apart,
// for measuring how much of the communication hides behind the compute.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/sequence_layout.hpp"
#include "ringattn/ring.hpp"

namespace ringattn {

// Rows [q_local_start, +q_length) of this rank's Q against rows [k_local_start, +k_length) of the
// visiting K/V shard. `causal` (named after the first mask that needed it) is set for a pair that
// needs mask arithmetic: the block gets the call's whole mask with q_global_start and
// k_global_start as its q_start and k_start (for a rank's own shard under a causal mask alone the
// starts are 0 and the positions local indices, which order the same way); every other pair is
// fully visible and runs without a mask.
struct BlockPair {
  std::int64_t q_local_start = 0, q_length = 0, q_global_start = 0;
  std::int64_t k_local_start = 0, k_length = 0, k_global_start = 0;
  bool causal = false;

  bool operator==(const BlockPair&) const = default;
};

// The mask of a ring call as the planner reads it: Mask's causal, window and documents (q_start
// and k_start unused), the document starts in host memory, and the batch rows to plan for: a
// pair runs when any batch row has visible work in it, and runs without mask arithmetic only
// when every batch row sees all of it. With one list for every batch row (batch_stride 0) the
// batch does not matter.
struct RingMask {
  Mask mask{};
  std::int64_t batch = 1;
};

// The balanced layout (SequenceLayoutKind::balanced) of a sequence of `total_length` tokens over
// `world` ranks for calls under `mask` (document starts in host memory): every rank's chunks,
// made the same on every rank from the same mask (parallel/balanced_layout.cpp says how). Throws
// Error unless S % 2N == 0.
std::shared_ptr<const SequenceLayout::Assignment> balanced_assignment(int world,
                                                                      std::int64_t total_length,
                                                                      const RingMask& mask);
SequenceLayout balanced_layout(int world, int rank, std::int64_t total_length,
                               const RingMask& mask);
// The layout of a call: `kind`'s, or for balanced the one `mask` gives.
SequenceLayout call_layout(SequenceLayoutKind kind, int world, int rank,
                           std::int64_t total_length, const RingMask& mask);

// The block calls of a step where `queries` holds Q and `keys` is the layout of the rank whose
// K/V visits: every (query chunk, key chunk) pair with visible work, the others skipped, fully
// visible pairs that share their rows or their keys merged into one call (fewer, larger calls;
// fewer merges of the running output). Without a mask: one call, all against all; under a causal
// mask alone, a rank's own shard is one masked call too.
std::vector<BlockPair> visible_pairs(const SequenceLayout& queries, const SequenceLayout& keys,
                                     const RingMask& mask);
std::vector<BlockPair> visible_pairs(const SequenceLayout& queries, const SequenceLayout& keys,
                                     bool causal);

// Whether the Q of `queries` sees any key of the K/V of `keys` (some block call runs).
bool shard_needed(const SequenceLayout& queries, const SequenceLayout& keys, const RingMask& mask);

// The steps a ring call runs, 1 to N: one more than the farthest hop (rank - owner, modulo N) at
// which some rank's Q sees a shard, over every rank of `layout`'s world. It follows from the
// layout and the mask alone, so every rank that agrees on those counts the same. K/V make
// steps - 1 hops.
int ring_steps(const SequenceLayout& layout, const RingMask& mask);

// The workspace bytes a ring call of `ranks` ranks takes from its scratch when the scratch is one
// region that holds all of it: the larger of the forward's (the running output and two K|V
// buffers) and the backward's (two travelling dK|dV accumulators, from three ranks on a step
// buffer, two K|V buffers, and delta = rowsum(dO * O)), each buffer 256-byte aligned, for local
// shards [batch, local_len, heads, dim] of `dtype` (the accumulators in its accumulator dtype).
// One rank takes only delta. It counts the buffers of the longest plan (a mask may need fewer
// steps, and then fewer buffers): a region of this size holds any call of that shape, so the ring
// owns nothing. In double: an account of a shape too large to allocate stays finite.
struct RingWorkspaceShape {
  int ranks = 1;
  std::int64_t batch = 1, local_len = 0, q_heads = 1, kv_heads = 1, head_dim = 0, v_head_dim = 0;
  DType dtype = DType::bf16;
};
double ring_workspace_bytes(const RingWorkspaceShape& shape);

// Which work of a ring call runs. `all` is the ring (RingAttention::forward and backward). The
// other two are its halves, for benchmarks (ringattn-bench ring): `transfers` makes exactly the
// ring's exchanges (same order, same sizes, same buffers, the same waits between them) and
// nothing else; `compute` makes everything else (every step's block calls with the same pairs and
// masks, and the fills, copies and additions around them) against this rank's own K/V, and no
// exchange. Both validate their arguments and grow the workspaces like the ring, and both leave
// meaningless values in the outputs.
enum class RingWork { all, transfers, compute };
void ring_forward(RingAttention& ring, const RingForwardArgs& args, RingWork work);
void ring_backward(RingAttention& ring, const RingBackwardArgs& args, RingWork work);

}  // namespace ringattn
