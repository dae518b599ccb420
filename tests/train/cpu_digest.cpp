// The digest ranks compare (train/digest.hpp) is XXH64 with seed 0: the published values of the
// reference implementation for inputs of every path through it (under 4 bytes, 4 to 7, 8 to 31,
// one 32-byte stripe and beyond), and the same value whatever pieces the bytes arrive in.
#include "train/digest.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "tests/common/random.hpp"

namespace ringattn::train {
namespace {

std::uint64_t digest_of(std::string_view text) {
  return Digest().add(text.data(), text.size()).value();
}

// The values of xxHash's reference implementation (XXH64, seed 0), as Zig's standard library
// tests them (lib/std/hash/xxhash.zig).
TEST(Digest, IsXxh64WithSeedZero) {
  EXPECT_EQ(digest_of(""), 0xef46db3751d8e999ull);
  EXPECT_EQ(digest_of("a"), 0xd24ec4f1a98c6e5bull);
  EXPECT_EQ(digest_of("abc"), 0x44bc2cf5ad770999ull);
  EXPECT_EQ(digest_of("message digest"), 0x066ed728fceeb3beull);
  EXPECT_EQ(digest_of("abcdefghijklmnopqrstuvwxyz"), 0xcfe1f278fa89835cull);
  EXPECT_EQ(digest_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"),
            0xaaa46907d3047814ull);
  EXPECT_EQ(digest_of("1234567890123456789012345678901234567890123456789012345678901234567890"
                      "1234567890"),
            0xe04a477f19ee145dull);
  EXPECT_EQ(Digest().add("abc", 3).hex(), "44bc2cf5ad770999");
}

// Random lengths cut at random places (pieces of 0 to 40 bytes, across and within stripes):
// the value of the whole in one piece.
TEST(Digest, PiecesGiveTheValueOfTheWhole) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng();
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<unsigned char> bytes(rng() % 300);
    for (auto& b : bytes) b = static_cast<unsigned char>(rng());
    const std::uint64_t whole = Digest().add(bytes.data(), bytes.size()).value();
    Digest pieces;
    for (std::size_t at = 0; at < bytes.size();) {
      const std::size_t size = std::min<std::size_t>(rng() % 41, bytes.size() - at);
      pieces.add(bytes.data() + at, size);
      at += size;
    }
    ASSERT_EQ(pieces.value(), whole) << bytes.size() << " bytes, trial " << trial;
    // value() reads the state without changing it.
    ASSERT_EQ(pieces.value(), whole);
  }
}

}  // namespace
}  // namespace ringattn::train
