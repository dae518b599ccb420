// DESIGN.md's performance model of the ring, as functions: when does a step's K/V transfer hide
// behind its attention compute, and how long a sequence fits in a GPU's memory. ringattn-plan
// prints it for a user's cluster; bench/results/ holds the measurements it is checked against.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"

namespace ringattn {

struct RingPlanInput {
  int ranks = 2;                    // N, the context-parallel group
  std::int64_t seq = 131072;        // total tokens
  std::int64_t heads = 16;          // query heads
  std::int64_t kv_heads = 16;       // key/value heads (only these travel)
  std::int64_t head_dim = 128;
  bool causal = true;
  bool zigzag = true;
  // Achieved by the local block, forward + backward on a whole problem: 403 on an H200 at 128k
  // causal, 16 heads of 128 (bench/results/ring-bench-2xh200-2026-11-30.md, 54df0ae).
  double attention_tflops = 400;
  double link_gbytes_per_s = 205;   // one direction, per rank (NVLink pair: ~205 at 64 MiB)
  double memory_gib = 139;          // free device memory per rank
  int element_bytes = 2;            // bf16 / f16
};

struct RingPlan {
  std::int64_t tokens_per_rank = 0;
  // One ring step; zigzag causal steps after the first compute half a block.
  double forward_compute_ms = 0, forward_transfer_ms = 0;
  double backward_compute_ms = 0, backward_transfer_ms = 0;  // K/V plus fp32 dK/dV
  bool forward_hidden = false, backward_hidden = false;
  // The fewest tokens per rank at which each transfer hides: c >= F h_kv / (h B) (x2 zigzag
  // causal, x1.2 backward: three times the bytes over 2.5 times the FLOPs).
  double forward_min_tokens_per_rank = 0, backward_min_tokens_per_rank = 0;
  // Device memory of one attention layer's forward + backward per token held (inputs, outputs,
  // fp32 running O and gradients, LSE, delta, the ring's two K/V buffers and dK/dV accumulators).
  double bytes_per_local_token = 0;
  std::int64_t longest_seq = 0;  // the longest total sequence whose attention fits on N ranks
};

// Throws Error naming the field when an input is out of range.
RingPlan plan_ring(const RingPlanInput& input);

// FlashAttention's count of the FLOPs of one attention forward over a whole sequence of `seq`
// tokens: 4 b h s^2 d, halved under a causal mask. A backward counts kBackwardFlopFactor times
// the forward, so forward + backward counts (1 + kBackwardFlopFactor) times it. GQA changes
// nothing (the count follows the query heads).
inline constexpr double kBackwardFlopFactor = 2.5;
double attention_forward_flops(std::int64_t batch, std::int64_t heads, std::int64_t seq,
                               std::int64_t head_dim, bool causal);

// What a measured ring gets out of its GPUs, against the same local block doing the whole problem
// on one GPU: one_gpu / (ranks x ring), 1 when N GPUs are N times faster. Times in any one unit.
double ring_efficiency(double one_gpu_time, int ranks, double ring_time);
// The share of the transfer time that the ring hides behind its compute, from the ring's time and
// those of its halves run apart (RingWork::compute and RingWork::transfers):
// 1 - (ring - compute alone) / transfers alone, clamped to [0, 1]. NaN when transfers_alone <= 0.
double hidden_share(double ring_time, double compute_alone, double transfers_alone);

// Packed documents for planning, as the global start positions of a sequence of `seq` tokens
// (DocumentStarts' list), from a description:
//   lognormal:MEAN:SEED[:LONG]  document lengths drawn from a log-normal distribution of mean MEAN
//                               tokens and sigma 1 (std::lognormal_distribution seeded with SEED,
//                               at least one token each) until the sequence is full, the last one
//                               cut at its end; with LONG, one document of LONG tokens put among
//                               them at a seeded place where it ends within the sequence (if
//                               LONG <= seq)
//   file:PATH                   the starts themselves, whole numbers separated by blanks, commas or
//                               line ends, non-decreasing
// Throws Error naming the description and what it expects.
std::vector<std::int64_t> document_starts(std::string_view description, std::int64_t seq);

// How a ring under a mask shares its work: the steps it runs (RingAttention runs as many) and
// each rank's visible (query, key) pairs, the work of its local blocks up to their tile edges.
struct RingBalance {
  std::string layout;  // the layout, described (a balanced one with its chunk count)
  int steps = 1;
  std::vector<double> visible_pairs;  // by rank
  double mean = 0, max = 0;
  double imbalance() const { return mean > 0 ? max / mean : 1.0; }  // the most loaded rank / mean
};

// The balance of one batch row: `mask` (causal, window, documents in host memory; q_start and
// k_start unused) over a sequence of `seq` tokens in `layout` over `ranks` ranks. Throws Error
// when seq does not split (see SequenceLayout).
RingBalance ring_balance(SequenceLayoutKind layout, int ranks, std::int64_t seq, const Mask& mask);

}  // namespace ringattn
