// The order in which training reads the sequences of a token dataset, and the data position a
// checkpoint stores.
//
// A dataset of T tokens holds N = (T - 1) / seq_len sequences: sequence i is the seq_len + 1
// tokens from position i * seq_len (inputs and the targets shifted by one; neighbours share one
// token). Data position n (the n-th sequence the job reads, counted over all data-parallel ranks
// and micro-steps) is sequence perm_e(n mod N) of epoch e = n / N, where perm_e is a seeded
// permutation of [0, N): every epoch visits every sequence once, in an order of its own. The
// sampler has no state beyond n, so a run resumes from one integer, under any dp x cp layout.
#pragma once

#include <cstdint>

namespace ringattn::train {

// Where the data stream stands: the number of training sequences read so far, over all ranks.
// For the retrieval task it is the index of the next training sample.
struct DataPosition {
  std::uint64_t sequences = 0;
  friend bool operator==(const DataPosition&, const DataPosition&) = default;
};

class SequenceSampler {
 public:
  // num_sequences >= 1 (throws ringattn::Error otherwise).
  SequenceSampler(std::uint64_t seed, std::int64_t num_sequences);

  std::int64_t num_sequences() const { return count_; }
  // The sequence read at data position n.
  std::int64_t sequence(std::uint64_t n) const;

 private:
  std::uint64_t seed_;
  std::int64_t count_;
  int half_bits_;  // the Feistel network permutes [0, 4^half_bits_) >= [0, count_)
};

}  // namespace ringattn::train
