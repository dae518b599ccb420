// SequenceLayout: the tokens each rank holds (chunks and global positions, checked against the
// definitions written out here), shard / unshard of whole tensors (round trips over all ranks, any
// dtype, strided views, LSE-shaped rank-3 views), and the messages of every error.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel/sequence_layout.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::HostTensor;
using test::ThrowsNaming;

constexpr SequenceLayoutKind kKinds[] = {SequenceLayoutKind::contiguous,
                                         SequenceLayoutKind::zigzag};

// The owner of global position p and its local index there, from the definitions in the header.
std::pair<int, std::int64_t> owner_of(SequenceLayoutKind kind, int world, std::int64_t total,
                                      std::int64_t p) {
  if (kind == SequenceLayoutKind::contiguous) {
    const std::int64_t local = total / world;
    return {static_cast<int>(p / local), p % local};
  }
  const std::int64_t c = total / (2 * world), chunk = p / c;
  if (chunk < world) return {static_cast<int>(chunk), p % c};
  return {static_cast<int>(2 * world - 1 - chunk), c + p % c};
}

TEST(SequenceLayout, PositionsFollowTheDefinitionAndCoverTheSequenceOnce) {
  for (SequenceLayoutKind kind : kKinds) {
    for (int world : {1, 2, 3, 4, 8}) {
      const std::int64_t total = 2 * world * 5;
      std::vector<int> seen(total, 0);
      for (int rank = 0; rank < world; ++rank) {
        const SequenceLayout layout(kind, world, rank, total);
        SCOPED_TRACE(layout.describe());
        EXPECT_EQ(layout.local_length(), total / world);
        const std::vector<std::int64_t> positions = layout.global_positions();
        ASSERT_EQ(static_cast<std::int64_t>(positions.size()), total / world);
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(positions.size()); ++i) {
          ASSERT_GE(positions[i], 0);
          ASSERT_LT(positions[i], total);
          ++seen[positions[i]];
          EXPECT_EQ(owner_of(kind, world, total, positions[i]), std::make_pair(rank, i));
        }
      }
      for (std::int64_t p = 0; p < total; ++p) EXPECT_EQ(seen[p], 1) << "position " << p;
    }
  }
}

TEST(SequenceLayout, ChunkLists) {
  // S = 16 over 4 ranks: contiguous blocks of 4; zigzag chunks of 2, rank r holds r and 7 - r.
  EXPECT_EQ(SequenceLayout(SequenceLayoutKind::contiguous, 4, 1, 16).chunks(),
            (std::vector<SequenceChunk>{{0, 4, 4}}));
  EXPECT_EQ(SequenceLayout(SequenceLayoutKind::zigzag, 4, 0, 16).chunks(),
            (std::vector<SequenceChunk>{{0, 0, 2}, {2, 14, 2}}));
  EXPECT_EQ(SequenceLayout(SequenceLayoutKind::zigzag, 4, 3, 16).chunks(),
            (std::vector<SequenceChunk>{{0, 6, 2}, {2, 8, 2}}));
  EXPECT_EQ(SequenceLayout(SequenceLayoutKind::zigzag, 4, 1, 16).global_positions(),
            (std::vector<std::int64_t>{2, 3, 12, 13}));
  // One rank: the whole sequence, in order, for both layouts.
  EXPECT_EQ(SequenceLayout(SequenceLayoutKind::zigzag, 1, 0, 6).global_positions(),
            (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(SequenceLayout(SequenceLayoutKind::zigzag, 4, 1, 16).for_rank(2).chunks(),
            SequenceLayout(SequenceLayoutKind::zigzag, 4, 2, 16).chunks());
}

// Shards of every rank, unsharded into a NaN-poisoned whole, give back the whole bit for bit; each
// shard holds exactly the rows of its positions.
template <typename T>
void check_round_trip(SequenceLayoutKind kind, int world) {
  SCOPED_TRACE(std::string(sequence_layout_name(kind)) + " over " + std::to_string(world));
  std::mt19937_64 rng = test::make_rng(70);
  const std::int64_t B = 2, S = 2 * world * 3, H = 3, D = 5, local = S / world;
  // The whole tensor as a strided view: heads outermost after batch ([B, H, S, D] storage).
  std::vector<T> storage = test::normal_vector<T>(B * H * S * D, rng);
  const TensorView full = test::strided_view(storage, 0, {B, S, H, D}, {H * S * D, D, S * D, 1});
  HostTensor<T> rebuilt({B, S, H, D});
  HostTensor<T> lse_full({B, H, S}), lse_rebuilt({B, H, S});
  test::fill_normal(lse_full.storage, rng);
  for (int rank = 0; rank < world; ++rank) {
    const SequenceLayout layout(kind, world, rank, S);
    HostTensor<T> shard({B, local, H, D}), lse_shard({B, H, local});
    layout.shard(full, shard.view);
    layout.shard(lse_full.view, lse_shard.view);
    const std::vector<std::int64_t> positions = layout.global_positions();
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t i = 0; i < local; ++i) {
        for (std::int64_t h = 0; h < H; ++h) {
          for (std::int64_t x = 0; x < D; ++x) {
            ASSERT_EQ(shard.storage[shard.view.offset(b, i, h, x)],
                      storage[full.offset(b, positions[i], h, x)]);
          }
          ASSERT_EQ(lse_shard.storage[lse_shard.view.offset(b, h, i)],
                    lse_full.storage[lse_full.view.offset(b, h, positions[i])]);
        }
      }
    }
    layout.unshard(shard.view, rebuilt.view);
    layout.unshard(lse_shard.view, lse_rebuilt.view);
  }
  EXPECT_EQ(test::view_bytes(rebuilt.view), test::view_bytes(full));
  EXPECT_EQ(test::view_bytes(lse_rebuilt.view), test::view_bytes(lse_full.view));
}

TEST(SequenceLayout, ShardUnshardRoundTrip) {
  for (SequenceLayoutKind kind : kKinds) {
    for (int world : {1, 2, 3, 4, 8}) {
      check_round_trip<float>(kind, world);
      check_round_trip<double>(kind, world);
    }
  }
}

TEST(SequenceLayout, ShardsSixteenBitTensors) {
  const SequenceLayout layout(SequenceLayoutKind::zigzag, 2, 1, 8);
  std::vector<std::uint16_t> full(8), local(4, 0xFFFF);
  for (std::uint16_t i = 0; i < 8; ++i) full[i] = static_cast<std::uint16_t>(100 + i);
  layout.shard(TensorView::contiguous(full.data(), DType::bf16, {1, 8, 1, 1}),
               TensorView::contiguous(local.data(), DType::bf16, {1, 4, 1, 1}));
  EXPECT_EQ(local, (std::vector<std::uint16_t>{102, 103, 104, 105}));
}

TEST(SequenceLayout, ErrorsNameTheLengthTheRanksAndTheDivisor) {
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::zigzag, 4, 0, 1002); },
                           {"SequenceLayout", "zigzag", "S = 1002", "2N = 8", "N = 4"}));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::contiguous, 4, 0, 1002); },
                           {"contiguous", "S = 1002", "not a multiple of N = 4"}));
  // 1004 splits over 4 ranks in one chunk each, not into 8 equal chunks.
  EXPECT_NO_THROW(SequenceLayout(SequenceLayoutKind::contiguous, 4, 0, 1004));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::zigzag, 4, 0, 1004); },
                           {"S = 1004", "2N = 8"}));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::zigzag, 4, 4, 1024); },
                           {"rank 4 is out of range", "N = 4", "0 to 3"}));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::zigzag, 4, -1, 1024); },
                           {"rank -1 is out of range"}));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::contiguous, 0, 0, 16); },
                           {"world size N = 0", ">= 1"}));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::contiguous, 2, 0, 0); },
                           {"total length S = 0", ">= 1"}));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(static_cast<SequenceLayoutKind>(7), 2, 0, 16); },
                           {"layout kind 7"}));
  EXPECT_TRUE(ThrowsNaming([] { parse_sequence_layout("diagonal"); },
                           {"'diagonal'", "contiguous, zigzag or balanced"}));
  EXPECT_EQ(parse_sequence_layout("zigzag"), SequenceLayoutKind::zigzag);
  EXPECT_EQ(parse_sequence_layout(sequence_layout_name(SequenceLayoutKind::contiguous)),
            SequenceLayoutKind::contiguous);
}

TEST(SequenceLayout, ShardErrorsNameTheTensor) {
  const SequenceLayout layout(SequenceLayoutKind::zigzag, 2, 0, 8);
  HostTensor<float> full({1, 8, 2, 4}), local({1, 4, 2, 4}), short_full({1, 6, 2, 4});
  HostTensor<float> wrong_heads({1, 4, 3, 4});
  HostTensor<double> local_f64({1, 4, 2, 4});
  EXPECT_TRUE(ThrowsNaming([&] { layout.shard(short_full.view, local.view); },
                           {"SequenceLayout::shard", "full has 6 tokens", "S = 8"}));
  EXPECT_TRUE(ThrowsNaming([&] { layout.shard(full.view, wrong_heads.view); },
                           {"local has shape", "4 = S/N tokens"}));
  EXPECT_TRUE(ThrowsNaming([&] { layout.unshard(local_f64.view, full.view); },
                           {"SequenceLayout::unshard", "local has dtype f64", "expected f32"}));
  EXPECT_TRUE(ThrowsNaming([&] { layout.shard(full.view, TensorView{}); },
                           {"full has rank 4 but local has rank 0"}));
  TensorView on_device = local.view;
  on_device.memory = Memory::device;
  EXPECT_TRUE(ThrowsNaming([&] { layout.shard(full.view, on_device); },
                           {"local is in device memory; expected host memory"}));
}

}  // namespace
}  // namespace ringattn
