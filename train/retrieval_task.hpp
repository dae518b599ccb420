// A synthetic long-context task that a model can only solve by attending far back: key-value
// retrieval. Each sample is one sequence of random filler with `pairs` key -> value pairs written
// at random, non-overlapping places anywhere in it (so under context parallelism most pairs sit
// in shards that other ranks hold), followed by `queries` queries, each a marker, the key of one
// of the pairs and then that pair's value: the value tokens of the queries are the answers, and
// the loss counts only them.
//
// Token space (vocab_size V >= 5): token 0 marks a query; the other V - 1 symbols are cut into
// three disjoint alphabets, keys [1, 1 + A), values [1 + A, 1 + 2A) and filler [1 + 2A, V) with
// A = (V - 1) / 4, so a key token appears only in its pair and in its query: the task is pure
// retrieval, not guessing.
//
//   ... filler k1 v1 filler filler k2 v2 filler ... | 0 k2 v2 | 0 k1 v1 | ...
//                                                       ^^ answer (loss here)
//
// Samples are a pure function of (seed, split, index): any rank draws any sample, in any order,
// bit for bit the same; the held-out split comes from its own random stream.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ringattn::train {

// The task's parameters. They mirror config keys, and check_retrieval_spec names those keys.
struct RetrievalSpec {
  int vocab_size = 256;        // model.vocab_size
  std::int64_t seq_len = 256;  // train.seq_len: a sample holds seq_len + 1 tokens
  int pairs = 8;               // data.retrieval.pairs
  int key_tokens = 1;          // data.retrieval.key_tokens
  int value_tokens = 1;        // data.retrieval.value_tokens
  int queries = 8;             // data.retrieval.queries
  std::uint64_t seed = 0;      // train.seed
};

// The problems of a spec, one message each (empty when it is usable): sizes below 1, more queries
// than pairs, more pairs than distinct keys, pairs and queries that do not fit in a sequence.
std::vector<std::string> check_retrieval_spec(const RetrievalSpec& spec);

enum class RetrievalSplit { train, held_out };

struct RetrievalSample {
  std::vector<std::int32_t> tokens;  // seq_len + 1: inputs [0, seq_len), targets [1, seq_len]
  std::vector<float> loss_mask;      // seq_len: 1 where target t (= tokens[t + 1]) is an answer
  std::vector<std::int64_t> answer_targets;  // the target indices t of the answers, query by query
  std::vector<std::int64_t> pair_positions;  // the position of each pair's first key token
  std::vector<int> queried_pairs;            // the pair each query asks for, in query order
};

class RetrievalTask {
 public:
  static constexpr std::int32_t kQueryMarker = 0;

  // Throws ringattn::Error with every problem of check_retrieval_spec.
  explicit RetrievalTask(const RetrievalSpec& spec);

  const RetrievalSpec& spec() const { return spec_; }
  int alphabet_size() const { return alphabet_; }  // A: distinct key (and value) symbols
  std::int32_t first_key_symbol() const { return 1; }
  std::int32_t first_value_symbol() const { return 1 + alphabet_; }
  std::int32_t first_filler_symbol() const { return 1 + 2 * alphabet_; }

  RetrievalSample sample(RetrievalSplit split, std::uint64_t index) const;

 private:
  RetrievalSpec spec_;
  int alphabet_;
};

struct RetrievalScore {
  std::int64_t queries = 0;
  std::int64_t correct = 0;  // queries whose every value token was predicted
  double accuracy() const { return queries == 0 ? 0.0 : double(correct) / double(queries); }
  RetrievalScore& operator+=(const RetrievalScore& other) {
    queries += other.queries;
    correct += other.correct;
    return *this;
  }
};

// Scores the model's predictions for one sample: predicted[i] is the token predicted (argmax) for
// target index sample.answer_targets[i]. A query counts as correct only when all its value tokens
// are right.
RetrievalScore score_answers(const RetrievalSample& sample, int value_tokens,
                             std::span<const std::int32_t> predicted);

}  // namespace ringattn::train
