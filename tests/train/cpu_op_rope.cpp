// The CPU rotary embedding (train/op_rope): against a long-double rotation at small and large
// (1e5+) global positions, in place inside a packed QKV row (v and the other heads untouched),
// the backward as the inverse and by fp64 central differences, a token's result depending only on
// its global position (zigzag shards, permutations), and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"
#include "train/op_rope.hpp"

namespace ringattn::train {
namespace {

using cpu::RopeShape;

constexpr double kTheta = 10000.0;

// The half-split rotation of every (t, h) vector, in long double.
std::vector<double> reference(const std::vector<double>& x, const std::vector<std::int64_t>& pos,
                              const RopeShape& s, double theta) {
  std::vector<double> y = x;
  const std::int64_t half = s.head_dim / 2;
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const std::int64_t base = t * s.token_stride + h * s.head_dim;
      for (std::int64_t i = 0; i < half; ++i) {
        const long double angle =
            (long double)pos[t] *
            std::pow((long double)theta, -2.0L * (long double)i / (long double)s.head_dim);
        const long double c = std::cos(angle), sn = std::sin(angle);
        const long double a = x[base + i], b = x[base + i + half];
        y[base + i] = static_cast<double>(a * c - b * sn);
        y[base + i + half] = static_cast<double>(a * sn + b * c);
      }
    }
  }
  return y;
}

std::vector<std::int64_t> random_positions(std::int64_t tokens, std::int64_t max,
                                           std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> position(0, max);
  std::vector<std::int64_t> pos(tokens);
  for (auto& p : pos) p = position(rng);
  return pos;
}

template <typename T>
void check(const RopeShape& s, std::int64_t max_position) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(s.tokens * 131 + s.heads * 17 + s.head_dim + max_position);
  const std::int64_t extent = (s.tokens - 1) * s.token_stride + s.heads * s.head_dim;
  const std::vector<std::int64_t> pos = random_positions(s.tokens, max_position, rng);
  const auto x = test::rounded<T>(test::normal_vector<double>(extent, rng));
  const std::vector<double> ref = reference(test::widened(x), pos, s, kTheta);

  // The op forms angles in double: an angle of size p carries ~p * 2^-53 absolute error, which
  // for f64 at positions past ~1000 exceeds the 1e-12 bound. The conditioning, not the op.
  const double tolerance = std::max(
      test::kTolerance<T>, 4.0 * double(max_position) * std::numeric_limits<double>::epsilon());
  std::vector<T> y = x;
  cpu::rope_forward<T>(y, pos, s, kTheta);
  EXPECT_TRUE(test::Close("rope(x)", test::widened(y), ref, tolerance));

  // The backward applies the inverse rotation: it brings y back to x.
  cpu::rope_backward<T>(y, pos, s, kTheta);
  EXPECT_TRUE(test::Close("rope_backward(rope(x))", test::widened(y), test::widened(x), tolerance));
}

TEST(Rope, F32MatchesReference) {
  check<float>({.tokens = 1, .heads = 1, .head_dim = 2, .token_stride = 2}, 0);
  check<float>({.tokens = 17, .heads = 3, .head_dim = 8, .token_stride = 24}, 100);
  check<float>({.tokens = 64, .heads = 4, .head_dim = 128, .token_stride = 512}, 4096);
  // Positions of a 256k context: a float angle would be off by ~1e-2 rad here.
  check<float>({.tokens = 50, .heads = 2, .head_dim = 64, .token_stride = 128}, 262144);
}

TEST(Rope, F64MatchesReference) {
  check<double>({.tokens = 1, .heads = 1, .head_dim = 2, .token_stride = 2}, 0);
  check<double>({.tokens = 17, .heads = 3, .head_dim = 8, .token_stride = 24}, 100);
  check<double>({.tokens = 64, .heads = 4, .head_dim = 128, .token_stride = 512}, 4096);
  check<double>({.tokens = 50, .heads = 2, .head_dim = 64, .token_stride = 128}, 262144);
}

// q and k rotated where they sit in a packed [tokens, (Hq + 2 Hkv) * hd] QKV buffer: each view
// matches the reference, and v is untouched.
TEST(Rope, RotatesInsidePackedQkv) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  const std::int64_t tokens = 13, q_heads = 4, kv_heads = 2, head_dim = 16;
  const std::int64_t row = (q_heads + 2 * kv_heads) * head_dim;
  const std::vector<std::int64_t> pos = random_positions(tokens, 1000, rng);
  const auto qkv = test::normal_vector<float>(tokens * row, rng);
  std::vector<float> out = qkv;
  const RopeShape q_shape{
      .tokens = tokens, .heads = q_heads, .head_dim = head_dim, .token_stride = row};
  const RopeShape k_shape{
      .tokens = tokens, .heads = kv_heads, .head_dim = head_dim, .token_stride = row};
  const std::span<float> all(out);
  const std::int64_t k_offset = q_heads * head_dim, v_offset = (q_heads + kv_heads) * head_dim;
  cpu::rope_forward<float>(all.subspan(0, (tokens - 1) * row + k_offset), pos, q_shape, kTheta);
  cpu::rope_forward<float>(all.subspan(k_offset, (tokens - 1) * row + kv_heads * head_dim), pos,
                           k_shape, kTheta);

  const std::vector<double> q_ref = reference(test::widened(qkv), pos, q_shape, kTheta);
  const std::vector<double> k_ref =
      reference(std::vector<double>(qkv.begin() + k_offset, qkv.end()), pos, k_shape, kTheta);
  std::vector<double> q_out, q_want, k_out, k_want;
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t c = 0; c < row; ++c) {
      const std::int64_t i = t * row + c;
      if (c < k_offset) {
        q_out.push_back(out[i]);
        q_want.push_back(q_ref[i]);
      } else if (c < v_offset) {
        k_out.push_back(out[i]);
        k_want.push_back(k_ref[i - k_offset]);
      } else {
        ASSERT_EQ(out[i], qkv[i]) << "v changed at token " << t << " column " << c;
      }
    }
  }
  EXPECT_TRUE(test::Close("q", q_out, q_want, 1e-5));
  EXPECT_TRUE(test::Close("k", k_out, k_want, 1e-5));
}

// A token's rotation depends only on its global position: the same vector placed at global
// position p gives bitwise the same result whatever its local index, in a zigzag shard (rank 1
// of 4: chunks 1 and 6 of 8) and under any permutation of the local tokens.
TEST(Rope, DependsOnlyOnGlobalPosition) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(2);
  const std::int64_t chunk = 5, heads = 2, head_dim = 32;
  std::vector<std::int64_t> pos;
  for (std::int64_t c : {1, 6}) {
    for (std::int64_t i = 0; i < chunk; ++i) pos.push_back(c * chunk + i);
  }
  const auto tokens = static_cast<std::int64_t>(pos.size());
  const RopeShape s{
      .tokens = tokens, .heads = heads, .head_dim = head_dim, .token_stride = heads * head_dim};
  const std::int64_t width = heads * head_dim;
  const auto vector = test::normal_vector<float>(width, rng);

  // The same vector at every token of the shard.
  std::vector<float> shard(tokens * width);
  for (std::int64_t t = 0; t < tokens; ++t)
    std::copy(vector.begin(), vector.end(), shard.begin() + t * width);
  cpu::rope_forward<float>(shard, pos, s, kTheta);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<float> alone = vector;
    const std::vector<std::int64_t> one{pos[t]};
    cpu::rope_forward<float>(
        alone, one, {.tokens = 1, .heads = heads, .head_dim = head_dim, .token_stride = width},
        kTheta);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), shard.begin() + t * width))
        << "local index " << t << ", global position " << pos[t];
  }

  // Permuting the tokens together with their positions permutes the result.
  const auto x = test::normal_vector<float>(tokens * width, rng);
  std::vector<std::int64_t> order(tokens);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<float> permuted(x.size());
  std::vector<std::int64_t> permuted_pos(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::copy_n(x.begin() + order[t] * width, width, permuted.begin() + t * width);
    permuted_pos[t] = pos[order[t]];
  }
  std::vector<float> y = x;
  cpu::rope_forward<float>(y, pos, s, kTheta);
  cpu::rope_forward<float>(permuted, permuted_pos, s, kTheta);
  for (std::int64_t t = 0; t < tokens; ++t) {
    EXPECT_TRUE(std::equal(permuted.begin() + t * width, permuted.begin() + (t + 1) * width,
                           y.begin() + order[t] * width))
        << "token at local index " << order[t] << " moved to " << t;
  }
}

TEST(Rope, GradientMatchesFiniteDifferences) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(3);
  const RopeShape s{.tokens = 5, .heads = 2, .head_dim = 6, .token_stride = 14};
  const std::int64_t extent = (s.tokens - 1) * s.token_stride + s.heads * s.head_dim;
  const std::vector<std::int64_t> pos = random_positions(s.tokens, 50, rng);
  const auto x = test::normal_vector<double>(extent, rng);
  // L = <r, rope(x)> over the view's elements; the gaps between tokens pass through unchanged.
  const auto r = test::normal_vector<double>(extent, rng);
  std::vector<double> dx = r;
  cpu::rope_backward<double>(dx, pos, s, kTheta);
  EXPECT_TRUE(test::GradientMatches(
      "x",
      [&](const std::vector<double>& v) {
        std::vector<double> y = v;
        cpu::rope_forward<double>(y, pos, s, kTheta);
        return test::dot(r, y);
      },
      x, dx, rng));
}

TEST(Rope, RejectsBadArguments) {
  std::vector<float> x(64);
  const std::vector<std::int64_t> pos{0, 1, -1, 3};
  EXPECT_TRUE(test::ThrowsNaming(
      [&] {
        cpu::rope_forward<float>(
            x, pos, {.tokens = 4, .heads = 2, .head_dim = 7, .token_stride = 14}, kTheta);
      },
      {"train::cpu::rope_forward", "shape.head_dim is 7", "even"}));
  EXPECT_TRUE(test::ThrowsNaming(
      [&] {
        cpu::rope_backward<float>(
            x, pos, {.tokens = 4, .heads = 2, .head_dim = 8, .token_stride = 16}, kTheta);
      },
      {"train::cpu::rope_backward", "positions[2] is -1", "expected >= 0"}));
  const std::vector<std::int64_t> good{0, 1, 2, 3};
  EXPECT_TRUE(test::ThrowsNaming(
      [&] {
        cpu::rope_forward<float>(
            x, good, {.tokens = 4, .heads = 2, .head_dim = 8, .token_stride = 20}, kTheta);
      },
      {"x has 64 elements", "(tokens - 1) * token_stride + heads * head_dim = 76"}));
}

}  // namespace
}  // namespace ringattn::train
