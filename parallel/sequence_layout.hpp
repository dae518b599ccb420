// SequenceLayout: which tokens of a sequence of S tokens rank r of N holds, in what order.
//
//   contiguous  one chunk: tokens [r * S/N, (r + 1) * S/N)                     (S % N == 0)
//   zigzag      2N chunks of c = S/(2N) tokens; rank r holds chunk r, then    (S % 2N == 0)
//               chunk 2N-1-r, so under a causal mask every rank does the same work at every ring
//               step (DESIGN.md, "Causal load balance")
//   balanced    an explicit list of chunks a rank, in the order of their positions, made from a
//               call's mask by balanced_layout (parallel/ring_attention.hpp)
//
// Local rows are the rank's chunks one after the other. The layout gives the global position of
// every local token (for RoPE and for the mask) and copies whole sequences to and from shards.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ringattn/ring.hpp"
#include "ringattn/tensor.hpp"

namespace ringattn {

// A run of tokens that are consecutive both locally and in the sequence.
struct SequenceChunk {
  std::int64_t local_start = 0;   // first local row
  std::int64_t global_start = 0;  // its position in the sequence
  std::int64_t length = 0;

  bool operator==(const SequenceChunk&) const = default;
};

class SequenceLayout {
 public:
  // Every rank's chunks, [rank][i], of a balanced layout.
  using Assignment = std::vector<std::vector<SequenceChunk>>;

  // Throws Error naming S, N and what S must be a multiple of, or the rank out of range; for
  // the balanced kind, which needs its chunks (the constructor below).
  SequenceLayout(SequenceLayoutKind kind, int world, int rank, std::int64_t total_length);
  // A balanced layout of these chunks: every rank S/N tokens, the chunks of all ranks covering
  // [0, S) once, each rank's in increasing positions and local rows. Throws Error otherwise.
  SequenceLayout(int rank, std::int64_t total_length, std::shared_ptr<const Assignment> chunks);

  SequenceLayoutKind kind() const { return kind_; }
  int world() const { return world_; }
  int rank() const { return rank_; }
  std::int64_t total_length() const { return total_length_; }
  std::int64_t local_length() const { return total_length_ / world_; }

  // The same layout seen from another rank (e.g. the owner of a visiting K/V shard).
  SequenceLayout for_rank(int rank) const;
  // In local order: one chunk (contiguous), two (zigzag) or the assignment's (balanced).
  std::vector<SequenceChunk> chunks() const;
  // positions[i] = the global position of local token i.
  std::vector<std::int64_t> global_positions() const;

  // Copy this rank's tokens between a whole sequence and a shard, on host tensors of any dtype
  // and strides (both views of one dtype). Rank 4: [batch, S, heads, head_dim] and
  // [batch, S/N, heads, head_dim]; rank 3: row statistics such as LSE, [batch, heads, S] and
  // [batch, heads, S/N]. unshard writes only this rank's rows of `full`.
  void shard(const TensorView& full, const TensorView& local) const;
  void unshard(const TensorView& local, const TensorView& full) const;

  std::string describe() const;  // "zigzag layout of 1024 tokens over 4 ranks, rank 1"

 private:
  SequenceLayoutKind kind_;
  int world_;
  int rank_;
  std::int64_t total_length_;
  std::shared_ptr<const Assignment> assignment_;  // balanced only
};

}  // namespace ringattn
