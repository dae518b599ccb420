#include "train/retrieval_task.hpp"

#include <algorithm>
#include <numeric>
#include <unordered_set>

#include "ringattn/error.hpp"
#include "train/counter_rng.hpp"

namespace ringattn::train {
namespace {

constexpr int kMinVocab = 5;  // the query marker and at least one symbol per alphabet

int alphabet_size_of(int vocab_size) {
  return (vocab_size - 1) / 4;
}

// min(base^exponent, cap) without overflow.
std::uint64_t saturating_power(std::uint64_t base, int exponent, std::uint64_t cap) {
  std::uint64_t value = 1;
  for (int i = 0; i < exponent && value < cap; ++i) {
    value = base != 0 && value > cap / base ? cap : value * base;
  }
  return std::min(value, cap);
}

constexpr std::uint64_t kKeySpaceCap = std::uint64_t{1} << 62;

std::int64_t tokens_needed(const RetrievalSpec& spec) {
  const std::int64_t pair_len = std::int64_t{spec.key_tokens} + spec.value_tokens;
  return spec.pairs * pair_len + spec.queries * (1 + pair_len);
}

}  // namespace

std::vector<std::string> check_retrieval_spec(const RetrievalSpec& spec) {
  std::vector<std::string> problems;
  auto at_least_one = [&](const char* key, std::int64_t value) {
    if (value < 1) problems.push_back(detail::concat(key, " is ", value, "; expected at least 1"));
  };
  at_least_one("data.retrieval.pairs", spec.pairs);
  at_least_one("data.retrieval.key_tokens", spec.key_tokens);
  at_least_one("data.retrieval.value_tokens", spec.value_tokens);
  at_least_one("data.retrieval.queries", spec.queries);
  at_least_one("train.seq_len", spec.seq_len);
  if (spec.vocab_size < kMinVocab) {
    problems.push_back(detail::concat("model.vocab_size (", spec.vocab_size,
                                      ") is too small for the retrieval task: it needs at "
                                      "least ",
                                      kMinVocab,
                                      " (a query marker, key, value and filler symbols)"));
  }
  if (!problems.empty()) return problems;

  if (spec.queries > spec.pairs) {
    problems.push_back(detail::concat("data.retrieval.queries (", spec.queries,
                                      ") is more than data.retrieval.pairs (", spec.pairs,
                                      "); each query asks for a different pair"));
  }
  const int alphabet = alphabet_size_of(spec.vocab_size);
  const std::uint64_t keys = saturating_power(alphabet, spec.key_tokens, kKeySpaceCap);
  if (static_cast<std::uint64_t>(spec.pairs) > keys) {
    problems.push_back(detail::concat(
        "data.retrieval.pairs (", spec.pairs, ") is more than the ", keys,
        " distinct keys of data.retrieval.key_tokens = ", spec.key_tokens, " from ", alphabet,
        " key symbols (model.vocab_size ", spec.vocab_size, "); raise key_tokens"));
  }
  if (tokens_needed(spec) > spec.seq_len + 1) {
    problems.push_back(detail::concat(
        "the retrieval task's ", spec.pairs, " pairs of ", spec.key_tokens + spec.value_tokens,
        " tokens and ", spec.queries, " queries of ", 1 + spec.key_tokens + spec.value_tokens,
        " tokens need ", tokens_needed(spec), " tokens; a sample of train.seq_len + 1 = ",
        spec.seq_len + 1, " has fewer (lower data.retrieval.pairs or queries)"));
  }
  return problems;
}

RetrievalTask::RetrievalTask(const RetrievalSpec& spec)
    : spec_(spec), alphabet_(alphabet_size_of(spec.vocab_size)) {
  const std::vector<std::string> problems = check_retrieval_spec(spec);
  if (!problems.empty()) {
    std::string text = problems.front();
    for (std::size_t i = 1; i < problems.size(); ++i) text += "; " + problems[i];
    detail::fail("RetrievalTask", text);
  }
}

RetrievalSample RetrievalTask::sample(RetrievalSplit split, std::uint64_t index) const {
  CounterRng rng(
      spec_.seed,
      split == RetrievalSplit::train ? RngStream::retrieval_train : RngStream::retrieval_held_out,
      index);
  const int pairs = spec_.pairs, queries = spec_.queries;
  const int key_len = spec_.key_tokens, value_len = spec_.value_tokens;
  const std::int64_t pair_len = key_len + value_len, query_len = 1 + pair_len;
  const std::int64_t total = spec_.seq_len + 1;
  const std::int64_t body = total - queries * query_len;  // filler and pairs; queries follow

  // Distinct keys: Floyd's sampling of `pairs` numbers from [0, key_space), each then written as
  // key_len digits base A.
  const std::uint64_t key_space = saturating_power(alphabet_, key_len, kKeySpaceCap);
  std::vector<std::uint64_t> key_ids;
  std::unordered_set<std::uint64_t> chosen;
  for (std::uint64_t j = key_space - pairs; j < key_space; ++j) {
    const std::uint64_t candidate = rng.below(j + 1);
    const std::uint64_t id = chosen.contains(candidate) ? j : candidate;
    chosen.insert(id);
    key_ids.push_back(id);
  }
  std::vector<std::int32_t> keys(static_cast<std::size_t>(pairs) * key_len);
  std::vector<std::int32_t> values(static_cast<std::size_t>(pairs) * value_len);
  for (int p = 0; p < pairs; ++p) {
    std::uint64_t id = key_ids[p];
    for (int i = 0; i < key_len; ++i, id /= alphabet_) {
      keys[p * key_len + i] = first_key_symbol() + static_cast<std::int32_t>(id % alphabet_);
    }
    for (int i = 0; i < value_len; ++i) {
      values[p * value_len + i] =
          first_value_symbol() + static_cast<std::int32_t>(rng.below(alphabet_));
    }
  }

  // Places: sorted uniform offsets into the free room give non-overlapping slots spread over the
  // whole body; a random permutation decides which pair takes which slot.
  const std::int64_t room = body - pairs * pair_len;
  std::vector<std::int64_t> offsets(pairs);
  for (auto& offset : offsets) offset = static_cast<std::int64_t>(rng.below(room + 1));
  std::sort(offsets.begin(), offsets.end());
  std::vector<int> slot_pair(pairs);
  std::iota(slot_pair.begin(), slot_pair.end(), 0);
  for (int i = pairs - 1; i > 0; --i) std::swap(slot_pair[i], slot_pair[rng.below(i + 1)]);

  RetrievalSample s;
  s.tokens.resize(total);
  s.loss_mask.assign(spec_.seq_len, 0.0f);
  s.pair_positions.resize(pairs);
  const int filler_size = spec_.vocab_size - first_filler_symbol();
  for (std::int64_t i = 0; i < body; ++i) {
    s.tokens[i] = first_filler_symbol() + static_cast<std::int32_t>(rng.below(filler_size));
  }
  auto write_pair = [&](int pair, std::int64_t at) {
    std::copy_n(keys.begin() + pair * key_len, key_len, s.tokens.begin() + at);
    std::copy_n(values.begin() + pair * value_len, value_len, s.tokens.begin() + at + key_len);
  };
  for (int slot = 0; slot < pairs; ++slot) {
    const int pair = slot_pair[slot];
    s.pair_positions[pair] = offsets[slot] + slot * pair_len;
    write_pair(pair, s.pair_positions[pair]);
  }

  // Queries: distinct pairs (a partial Fisher-Yates shuffle), each as marker, key, value.
  std::vector<int> order(pairs);
  std::iota(order.begin(), order.end(), 0);
  for (int q = 0; q < queries; ++q) {
    std::swap(order[q], order[q + rng.below(pairs - q)]);
    const int pair = order[q];
    const std::int64_t at = body + q * query_len;
    s.tokens[at] = kQueryMarker;
    write_pair(pair, at + 1);
    s.queried_pairs.push_back(pair);
    for (int i = 0; i < value_len; ++i) {
      // The value token at position v is the target of input position v - 1.
      const std::int64_t target = at + 1 + key_len + i - 1;
      s.loss_mask[target] = 1.0f;
      s.answer_targets.push_back(target);
    }
  }
  return s;
}

RetrievalScore score_answers(const RetrievalSample& sample, int value_tokens,
                             std::span<const std::int32_t> predicted) {
  if (predicted.size() != sample.answer_targets.size()) {
    detail::fail("score_answers", "predicted has ", predicted.size(),
                 " tokens; expected one per answer target (", sample.answer_targets.size(), ")");
  }
  if (value_tokens < 1 || sample.answer_targets.size() % value_tokens != 0) {
    detail::fail("score_answers", "value_tokens is ", value_tokens, "; expected a divisor >= 1 of ",
                 "the sample's ", sample.answer_targets.size(), " answer tokens");
  }
  RetrievalScore score;
  for (std::size_t q = 0; q < sample.answer_targets.size(); q += value_tokens) {
    bool right = true;
    for (int i = 0; i < value_tokens; ++i) {
      right = right && predicted[q + i] == sample.tokens[sample.answer_targets[q + i] + 1];
    }
    ++score.queries;
    score.correct += right ? 1 : 0;
  }
  return score;
}

}  // namespace ringattn::train
