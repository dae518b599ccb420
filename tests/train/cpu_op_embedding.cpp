// The CPU token embedding (train/op_embedding): the gather exactly, the scatter-add against an fp64
// sum with repeated tokens in both write modes, fp64 central differences, bitwise determinism
// across thread counts, and the argument checks.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"
#include "train/op_embedding.hpp"

namespace ringattn::train {
namespace {

using cpu::EmbeddingShape;

// Ids drawn from a vocabulary smaller than the token count, so ids repeat.
std::vector<std::int32_t> random_tokens(const EmbeddingShape& s, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(s.vocab - 1));
  std::vector<std::int32_t> tokens(s.tokens);
  for (auto& t : tokens) t = id(rng);
  return tokens;
}

template <typename T>
void check(const EmbeddingShape& s) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(s.tokens * 7919 + s.vocab * 31 + s.dim);
  const std::vector<std::int32_t> tokens = random_tokens(s, rng);
  const auto table = test::rounded<T>(test::normal_vector<double>(s.vocab * s.dim, rng));
  const auto dout = test::rounded<T>(test::normal_vector<double>(s.tokens * s.dim, rng));

  std::vector<T> out = test::nan_vector<T>(s.tokens * s.dim);
  cpu::embedding_forward<T>(out, tokens, table, s);
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    for (std::int64_t c = 0; c < s.dim; ++c) {
      ASSERT_EQ(out[t * s.dim + c], table[tokens[t] * s.dim + c]) << "token " << t << " dim " << c;
    }
  }

  std::vector<double> scatter(s.vocab * s.dim, 0.0);
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    for (std::int64_t c = 0; c < s.dim; ++c) scatter[tokens[t] * s.dim + c] += dout[t * s.dim + c];
  }
  std::vector<T> dtable = test::nan_vector<T>(s.vocab * s.dim);  // rows no token uses become 0
  cpu::embedding_backward<T>(dtable, tokens, dout, s);
  EXPECT_TRUE(test::Close("dtable", test::widened(dtable), scatter, test::kTolerance<T>));

  const auto before = test::rounded<T>(test::normal_vector<double>(s.vocab * s.dim, rng));
  std::vector<double> accumulated = test::widened(before);
  for (std::size_t i = 0; i < accumulated.size(); ++i) accumulated[i] += scatter[i];
  dtable = before;
  cpu::embedding_backward<T>(dtable, tokens, dout, s, Write::add);
  EXPECT_TRUE(test::Close("dtable (add)", test::widened(dtable), accumulated, test::kTolerance<T>));
}

TEST(Embedding, F32MatchesFp64Reference) {
  check<float>({.tokens = 1, .vocab = 1, .dim = 1});
  check<float>({.tokens = 37, .vocab = 5, .dim = 70});
  check<float>({.tokens = 500, .vocab = 256, .dim = 130});
}

TEST(Embedding, F64MatchesFp64Reference) {
  check<double>({.tokens = 1, .vocab = 1, .dim = 1});
  check<double>({.tokens = 37, .vocab = 5, .dim = 70});
  check<double>({.tokens = 500, .vocab = 256, .dim = 130});
}

TEST(Embedding, GradientMatchesFiniteDifferences) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const EmbeddingShape s{.tokens = 9, .vocab = 4, .dim = 5};
  const std::vector<std::int32_t> tokens = random_tokens(s, rng);
  const auto table = test::normal_vector<double>(s.vocab * s.dim, rng);
  const auto r = test::normal_vector<double>(s.tokens * s.dim, rng);  // L = <r, out>
  std::vector<double> dtable(table.size());
  cpu::embedding_backward<double>(dtable, tokens, r, s);
  EXPECT_TRUE(test::GradientMatches(
      "table",
      [&](const std::vector<double>& v) {
        std::vector<double> out(s.tokens * s.dim);
        cpu::embedding_forward<double>(out, tokens, v, s);
        return test::dot(r, out);
      },
      table, dtable, rng));
}

TEST(Embedding, BackwardBitwiseEqualAcrossThreadCounts) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(2);
  const EmbeddingShape s{.tokens = 3000, .vocab = 10, .dim = 300};  // ~300 hits per row
  const std::vector<std::int32_t> tokens = random_tokens(s, rng);
  const auto dout = test::normal_vector<float>(s.tokens * s.dim, rng);
  const auto run = [&](int threads) {
    test::ThreadCountGuard guard;
    ringattn::cpu::set_num_threads(threads);
    std::vector<float> dtable(s.vocab * s.dim);
    cpu::embedding_backward<float>(dtable, tokens, dout, s);
    return dtable;
  };
  const auto one = run(1);
  EXPECT_TRUE(one == run(1)) << "two runs differ";
  EXPECT_TRUE(one == run(3)) << "1 and 3 threads differ";
}

TEST(Embedding, RejectsBadArguments) {
  const EmbeddingShape s{.tokens = 4, .vocab = 8, .dim = 2};
  std::vector<float> out(8), table(16);
  const std::vector<std::int32_t> tokens{1, 2, 8, 0};
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::embedding_forward<float>(out, tokens, table, s); },
      {"train::cpu::embedding_forward", "tokens[2] is 8", "expected an id in [0, 8)"}));
  const std::vector<std::int32_t> good{1, 2, 3, 0};
  std::vector<float> dtable(15);
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::embedding_backward<float>(dtable, good, out, s); },
      {"train::cpu::embedding_backward", "dtable has 15 elements", "vocab * dim = 16"}));
}

}  // namespace
}  // namespace ringattn::train
