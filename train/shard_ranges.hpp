// Which tokens of a sequence a context-parallel rank holds, as ranges of global positions.
//
// This is the data side's own copy of the rule of parallel/sequence_layout.hpp (the data code
// must not depend on the ring); the two must agree, and tests/train/cpu_shard_ranges.cpp pins
// the rule down:
//   contiguous: cp equal chunks, rank r holds chunk r;
//   zigzag:     2 cp equal chunks, rank r holds chunks r and 2 cp - 1 - r, in that order, so that
//               under a causal mask every rank does the same work;
//   balanced:   follows each batch's mask (ringattn::balanced_assignment): the trainer lays out
//               every micro-batch itself, and shard_ranges refuses it.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace ringattn::train {

// The same values as ringattn::SequenceLayoutKind (include/ringattn/ring.hpp), which the trainer
// passes to the ring.
enum class ShardLayout : int { contiguous = 0, zigzag = 1, balanced = 2 };

std::string_view layout_name(ShardLayout layout);

// Global positions [begin, end) of a sequence.
struct TokenRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t size() const { return end - begin; }
  friend bool operator==(const TokenRange&, const TokenRange&) = default;
};

// The ranges rank `cp_rank` of `cp_size` holds of a sequence of `seq_len` tokens, in the order
// the rank stores them (its local tokens are the ranges concatenated). Throws ringattn::Error
// unless seq_len is a multiple of the layout's chunk count (cp for contiguous, 2 cp for zigzag)
// and 0 <= cp_rank < cp_size.
std::vector<TokenRange> shard_ranges(std::int64_t seq_len, int cp_size, int cp_rank,
                                     ShardLayout layout);

// What seq_len must be a multiple of: cp (contiguous) or 2 cp (zigzag, balanced).
int chunk_count(int cp_size, ShardLayout layout);

// The tokens, targets and loss weights one rank feeds the model for one sequence. `inputs[i]`
// sits at the global position of local index i; `targets[i]` is the token that follows it;
// `loss_mask[i]` is 1 where the target counts in the loss, 0 where it does not.
// `document_starts`: the positions of the sequence (0 < s < seq_len, increasing) where a packed
// document begins (train/documents.hpp), the whole sequence's on every rank; empty: one document.
struct TokenShard {
  std::vector<std::int32_t> inputs;
  std::vector<std::int32_t> targets;
  std::vector<float> loss_mask;
  std::vector<std::int64_t> document_starts;
};

// The shard of a whole sample: `tokens` holds seq_len + 1 tokens (inputs tokens[0, seq_len),
// targets tokens[1, seq_len]), `loss_mask` one weight per target (seq_len of them).
TokenShard take_shard(std::span<const std::int32_t> tokens, std::span<const float> loss_mask,
                      std::span<const TokenRange> ranges);

}  // namespace ringattn::train
