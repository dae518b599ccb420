// The balanced layout (SequenceLayoutKind::balanced, parallel/balanced_layout.cpp) against
// definitions and counts written out here, not from MaskRule:
//   - under a causal mask alone it gives zigzag's chunks (adjacent ones joined), N = 1 to 8;
//   - every position is held once, every rank holds S/N tokens in equal chunks of S/(cN)
//     (c = 1, the contiguous split, or 2, 4, ..., 64, chunks of at least 128 tokens beyond
//     c = 2), in increasing positions with consecutive local rows and adjacent chunks joined,
//     for packed documents (log-normal mixes, a long document, empty and one-token documents,
//     per-batch lists, windows);
//   - each rank's visible (query, key) pairs, counted here from the document starts, come within
//     1.1x of the mean over log-normal document mixes, a document longer than a shard, and
//     causal windows, at S = 128k and 1M over 2, 4 and 8 ranks; where the contiguous split is
//     already within 1.05x (by the same count), as under a narrow window, it is the layout;
//   - two calls give the same chunks; balanced_layout and call_layout give the assignment's;
//   - the errors name what is wrong (S not a multiple of 2N, the kind-only constructor, an
//     assignment that overlaps or holds the wrong count, no mask for RingAttention's copies).
// RingAttention's global_positions, shard and unshard with a mask are checked over a
// communicator that only answers its rank and size (they move nothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/performance_model.hpp"
#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using Assignment = SequenceLayout::Assignment;
using test::HostTensor;
using test::ThrowsNaming;

constexpr double kMostImbalance = 1.1;  // the most loaded rank's visible pairs / the mean

// A mask over one batch row, or per-batch rows when `starts` holds several lists (equal counts).
using Lists = std::vector<std::vector<std::int64_t>>;
struct Documents {
  std::vector<std::vector<std::int64_t>> starts;  // [batch row][i]; empty: no documents
  std::vector<std::int64_t> packed;

  explicit Documents(Lists lists) : starts(std::move(lists)) {
    for (const auto& list : starts) packed.insert(packed.end(), list.begin(), list.end());
  }
  Documents(const Documents&) = delete;
  Documents& operator=(const Documents&) = delete;

  std::int64_t batch() const { return std::max<std::int64_t>(1, std::ssize(starts)); }
  Mask mask(bool causal, std::int64_t window_left = 0) const {
    Mask m;
    m.causal = causal;
    m.window_left = window_left;
    if (!starts.empty()) {
      const auto count = static_cast<std::int64_t>(starts[0].size());
      m.documents = {packed.data(), count, starts.size() > 1 ? count : 0};
    }
    return m;
  }
  RingMask ring_mask(bool causal, std::int64_t window_left = 0) const {
    return {mask(causal, window_left), batch()};
  }
};

// Every chunk of every rank well formed, checked from the chunks alone: [0, S) held once, S/N
// tokens a rank, each rank's chunks in increasing positions, separated (adjacent ones joined),
// local rows one after the other, and all of them made of equal chunks of S/(cN) tokens for a c
// the layout may choose (1, the contiguous split, or 2, 4, ..., 64).
testing::AssertionResult well_formed(const Assignment& a, int world, std::int64_t total) {
  if (std::ssize(a) != world) {
    return testing::AssertionFailure() << a.size() << " ranks' chunks, expected " << world;
  }
  std::vector<int> held(static_cast<std::size_t>(total), 0);
  std::int64_t grain = total;  // gcd of every start and length
  for (int r = 0; r < world; ++r) {
    std::int64_t local = 0, previous_end = -1;
    for (const SequenceChunk& c : a[r]) {
      if (c.local_start != local) {
        return testing::AssertionFailure() << "rank " << r << ": a chunk at local row "
                                           << c.local_start << ", expected " << local;
      }
      if (c.length < 1 || c.global_start < 0 || c.global_start + c.length > total) {
        return testing::AssertionFailure() << "rank " << r << ": chunk [" << c.global_start << ", +"
                                           << c.length << ") is not inside [0, " << total << ")";
      }
      if (c.global_start <= previous_end) {
        return testing::AssertionFailure()
               << "rank " << r << ": chunk at " << c.global_start << " does not come after the "
               << "previous chunk's end " << previous_end << " (or touches it unjoined)";
      }
      for (std::int64_t p = c.global_start; p < c.global_start + c.length; ++p) ++held[p];
      grain = std::gcd(grain, std::gcd(c.global_start, c.length));
      local += c.length;
      previous_end = c.global_start + c.length;
    }
    if (local != total / world) {
      return testing::AssertionFailure()
             << "rank " << r << " holds " << local << " tokens, expected " << total / world;
    }
  }
  for (std::int64_t p = 0; p < total; ++p) {
    if (held[p] != 1) {
      return testing::AssertionFailure() << "position " << p << " is held " << held[p] << " times";
    }
  }
  if (grain % (total / world) == 0) return testing::AssertionSuccess();  // the contiguous split
  for (std::int64_t c = 2; c <= 64; c *= 2) {
    if (total % (c * world) != 0) break;
    const std::int64_t chunk = total / (c * world);
    if (c > 2 && chunk < 128) break;
    if (grain % chunk == 0) return testing::AssertionSuccess();
  }
  return testing::AssertionFailure() << "the chunks' starts and lengths share only " << grain
                                     << " tokens: not equal chunks of S/(cN)";
}

// Each rank's visible (query, key) pairs under a causal mask with `window_left` (0: none) and
// `documents` (summed over its batch rows), from the definitions: the query at i sees the keys
// j <= i with i - j < window_left in its document, which begins at the last start <= i (0 if
// none).
std::vector<double> rank_pairs(const Assignment& a, std::int64_t total, const Documents& documents,
                               std::int64_t window_left) {
  std::vector<double> prefix(static_cast<std::size_t>(total) + 1, 0.0);
  const std::vector<std::vector<std::int64_t>> rows =
      documents.starts.empty() ? std::vector<std::vector<std::int64_t>>{{}} : documents.starts;
  for (const std::vector<std::int64_t>& starts : rows) {
    std::size_t next = 0;
    std::int64_t begin = 0;
    double sum = 0.0;
    for (std::int64_t i = 0; i < total; ++i) {
      while (next < starts.size() && starts[next] <= i) begin = starts[next++];
      std::int64_t keys = i - begin + 1;
      if (window_left > 0) keys = std::min(keys, window_left);
      sum += static_cast<double>(keys);
      prefix[static_cast<std::size_t>(i) + 1] += sum;
    }
  }
  std::vector<double> pairs;
  for (const std::vector<SequenceChunk>& chunks : a) {
    double mine = 0.0;
    for (const SequenceChunk& c : chunks)
      mine += prefix[c.global_start + c.length] - prefix[c.global_start];
    pairs.push_back(mine);
  }
  return pairs;
}

double imbalance(const std::vector<double>& pairs) {
  const double mean = std::accumulate(pairs.begin(), pairs.end(), 0.0) / std::ssize(pairs);
  return *std::max_element(pairs.begin(), pairs.end()) / mean;
}

// The contiguous split as an assignment.
Assignment contiguous(int world, std::int64_t total) {
  Assignment a(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) a[r].push_back({0, r * (total / world), total / world});
  return a;
}

// Where the contiguous split is even (its most loaded rank at most 1.05x the mean, the layout's
// threshold, by the count here) the layout is that split. Cases within 1e-9 of the threshold
// are left out (the count's rounding may differ from the layout's).
testing::AssertionResult contiguous_where_even(const Assignment& a, int world, std::int64_t total,
                                               const Documents& documents,
                                               std::int64_t window_left) {
  constexpr double kEnough = 1.05;
  const Assignment split = contiguous(world, total);
  const double split_imbalance = imbalance(rank_pairs(split, total, documents, window_left));
  if (split_imbalance < kEnough - 1e-9 && a != split) {
    return testing::AssertionFailure() << "the contiguous split carries " << split_imbalance
                                       << "x the mean, at most 1.05x, but the layout is another";
  }
  return testing::AssertionSuccess();
}

// Zigzag's chunks of rank r, adjacent ones joined (rank N-1's two chunks are one run).
std::vector<SequenceChunk> joined_zigzag(int world, int rank, std::int64_t total) {
  std::vector<SequenceChunk> out;
  for (const SequenceChunk& c :
       SequenceLayout(SequenceLayoutKind::zigzag, world, rank, total).chunks()) {
    if (!out.empty() && out.back().global_start + out.back().length == c.global_start) {
      out.back().length += c.length;
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// The largest multiple of 2N * 64 not above `total`: every chunk count of the layout divides it.
std::int64_t fitting_length(std::int64_t total, int world) {
  const std::int64_t step = 2 * std::int64_t{world} * 64;
  return total / step * step;
}

// "lognormal:MEAN:SEED[:LONG]" (performance_model.hpp) for a sequence of `total` tokens.
std::vector<std::int64_t> lognormal(std::int64_t mean, std::uint64_t seed, std::int64_t total,
                                    std::int64_t long_length = 0) {
  std::string description = "lognormal:" + std::to_string(mean) + ":" + std::to_string(seed);
  if (long_length > 0) description += ":" + std::to_string(long_length);
  return document_starts(description, total);
}

TEST(BalancedLayout, CausalAloneGivesZigzagChunks) {
  for (int world = 1; world <= 8; ++world) {
    const Documents none(Lists{});
    const Documents whole(Lists{{0}});  // one document over everything: the same work
    for (std::int64_t total :
         {2 * std::int64_t{world}, 2 * world * std::int64_t{3}, 2 * world * std::int64_t{64},
          2 * world * std::int64_t{1000}, fitting_length(131072, world)}) {
      for (const Documents* documents : {&none, &whole}) {
        for (std::int64_t batch : {1, 3}) {
          const std::string where =
              "N = " + std::to_string(world) + ", S = " + std::to_string(total) + ", batch " +
              std::to_string(batch) + (documents == &whole ? ", documents {0}" : "");
          RingMask mask = documents->ring_mask(true);
          mask.batch = batch;
          const std::shared_ptr<const Assignment> a = balanced_assignment(world, total, mask);
          ASSERT_EQ(std::ssize(*a), world) << where;
          for (int r = 0; r < world; ++r) {
            EXPECT_EQ((*a)[r], joined_zigzag(world, r, total)) << where << ", rank " << r;
            EXPECT_EQ(
                SequenceLayout(r, total, a).global_positions(),
                SequenceLayout(SequenceLayoutKind::zigzag, world, r, total).global_positions())
                << where << ", rank " << r;
          }
        }
      }
    }
  }
}

// Document mixes over S = 128k (the largest multiple of 2N * 64 below it for N = 3): fixed
// seeds and one of this run, one-token and empty documents, per-batch lists and windows.
TEST(BalancedLayout, EveryPositionOnceInEqualChunksInOrder) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(71);
  const std::uint64_t fresh = rng() % 1000000;
  for (int world : {2, 3, 4, 8}) {
    const std::int64_t total = fitting_length(131072, world), shard = total / world;
    for (std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{2}, fresh}) {
      std::vector<std::vector<std::int64_t>> mixes = {lognormal(2048, seed, total),
                                                      lognormal(8192, seed, total),
                                                      lognormal(8192, seed, total, 3 * shard / 2)};
      // One-token documents (two starts one apart), an empty one (a repeated start) and a start
      // past the end, among the 2k mix.
      std::vector<std::int64_t> odd = mixes[0];
      for (std::int64_t p : {std::int64_t{0}, shard - 1, shard, total / 2 + 17, total - 1}) {
        odd.push_back(p);
        odd.push_back(p + 1);
      }
      odd.push_back(total / 3);
      odd.push_back(total / 3);
      odd.push_back(total + 9);
      std::sort(odd.begin(), odd.end());
      mixes.push_back(odd);
      for (std::size_t m = 0; m < mixes.size(); ++m) {
        const std::string where = "N = " + std::to_string(world) +
                                  ", S = " + std::to_string(total) + ", seed " +
                                  std::to_string(seed) + ", mix " + std::to_string(m);
        const Documents documents(Lists{mixes[m]});
        for (std::int64_t window : {std::int64_t{0}, std::int64_t{3000}}) {
          const std::shared_ptr<const Assignment> a =
              balanced_assignment(world, total, documents.ring_mask(true, window));
          EXPECT_TRUE(well_formed(*a, world, total)) << where << ", window " << window;
        }
        const std::shared_ptr<const Assignment> non_causal =
            balanced_assignment(world, total, documents.ring_mask(false));
        EXPECT_TRUE(well_formed(*non_causal, world, total)) << where << ", not causal";
      }
      // Per-batch lists of equal counts: the 2k and 8k mixes cut to the shorter count.
      std::vector<std::int64_t> first = mixes[0], second = mixes[1];
      const std::size_t count = std::min(first.size(), second.size());
      first.resize(count);
      second.resize(count);
      const Documents per_batch(Lists{first, second});
      const std::shared_ptr<const Assignment> a =
          balanced_assignment(world, total, per_batch.ring_mask(true));
      EXPECT_TRUE(well_formed(*a, world, total))
          << "N = " << world << ", seed " << seed << ", per-batch documents";
    }
    // Only two chunks a rank fit (S / 2N odd), and chunks of one token.
    for (std::int64_t small : {2 * std::int64_t{world} * 257, 2 * std::int64_t{world}}) {
      const Documents documents(Lists{lognormal(std::max<std::int64_t>(small / 8, 1), 5, small)});
      const std::shared_ptr<const Assignment> a =
          balanced_assignment(world, small, documents.ring_mask(true));
      EXPECT_TRUE(well_formed(*a, world, small)) << "N = " << world << ", S = " << small;
    }
  }
}

TEST(BalancedLayout, VisiblePairsWithinATenthOfTheMean) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(72);
  const std::uint64_t fresh = rng() % 1000000;
  for (std::int64_t total : {std::int64_t{131072}, std::int64_t{1048576}}) {
    for (int world : {2, 4, 8}) {
      for (std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{2}, std::uint64_t{3}, fresh}) {
        const std::int64_t long_length = 3 * total / (2 * world);  // 1.5 shards
        const std::vector<std::pair<std::string, std::vector<std::int64_t>>> mixes = {
            {"lognormal:2048", lognormal(2048, seed, total)},
            {"lognormal:8192", lognormal(8192, seed, total)},
            {"lognormal:32768", lognormal(32768, seed, total)},
            {"lognormal:8192 with a document of 1.5 shards",
             lognormal(8192, seed, total, long_length)}};
        for (const auto& [name, starts] : mixes) {
          const Documents documents(Lists{starts});
          const std::shared_ptr<const Assignment> a =
              balanced_assignment(world, total, documents.ring_mask(true));
          const double most = imbalance(rank_pairs(*a, total, documents, 0));
          EXPECT_LE(most, kMostImbalance)
              << name << " seed " << seed << ", S = " << total << ", N = " << world
              << ": the most loaded rank has " << most << "x the mean visible pairs";
          EXPECT_TRUE(contiguous_where_even(*a, world, total, documents, 0))
              << name << " seed " << seed << ", S = " << total << ", N = " << world;
        }
      }
    }
  }
}

// Windows from one token to several shards, alone and with documents. A causal window of w
// tokens alone leaves the contiguous split's first rank w^2/2 pairs short of the others'
// S/N * w: its most loaded rank carries 1 / (1 - w/(2S)) x the mean, at most 1.016x for the
// windows up to 4096 here, so the layout is that split.
TEST(BalancedLayout, CausalWindowWithinATenthOfTheMean) {
  const std::int64_t total = 131072;
  for (int world : {2, 4, 8}) {
    const std::int64_t shard = total / world;
    const Documents none(Lists{});
    const Documents mixed(Lists{lognormal(8192, 4, total, 3 * shard / 2)});
    for (std::int64_t window : {std::int64_t{1}, std::int64_t{128}, std::int64_t{4096},
                                shard / 2 + 1, shard + 3, 3 * shard}) {
      for (const Documents* documents : {&none, &mixed}) {
        const std::string where = "causal window " + std::to_string(window) +
                                  (documents == &mixed ? " with documents" : "") +
                                  ", S = " + std::to_string(total) +
                                  ", N = " + std::to_string(world);
        const std::shared_ptr<const Assignment> a =
            balanced_assignment(world, total, documents->ring_mask(true, window));
        EXPECT_TRUE(well_formed(*a, world, total)) << where;
        const double most = imbalance(rank_pairs(*a, total, *documents, window));
        EXPECT_LE(most, kMostImbalance)
            << where << ": the most loaded rank has " << most << "x the mean visible pairs";
        EXPECT_TRUE(contiguous_where_even(*a, world, total, *documents, window)) << where;
        if (documents == &none && window <= 4096) {
          EXPECT_EQ(*a, contiguous(world, total)) << where << ": not the contiguous split";
        }
      }
    }
  }
}

TEST(BalancedLayout, DeterministicAndTheSameThroughEveryEntry) {
  const std::int64_t total = 131072;
  const Documents documents(Lists{lognormal(8192, 9, total, 40000)});
  for (int world : {2, 4, 8}) {
    const RingMask mask = documents.ring_mask(true, 5000);
    const std::shared_ptr<const Assignment> first = balanced_assignment(world, total, mask);
    const std::shared_ptr<const Assignment> second = balanced_assignment(world, total, mask);
    EXPECT_EQ(*first, *second) << "N = " << world << ": two calls differ";
    for (int r = 0; r < world; ++r) {
      const SequenceLayout layout = balanced_layout(world, r, total, mask);
      EXPECT_EQ(layout.kind(), SequenceLayoutKind::balanced);
      EXPECT_EQ(layout.world(), world);
      EXPECT_EQ(layout.rank(), r);
      EXPECT_EQ(layout.local_length(), total / world);
      EXPECT_EQ(layout.chunks(), (*first)[r]) << "N = " << world << ", rank " << r;
      EXPECT_EQ(layout.for_rank((r + 1) % world).chunks(), (*first)[(r + 1) % world]);
      EXPECT_EQ(call_layout(SequenceLayoutKind::balanced, world, r, total, mask).chunks(),
                (*first)[r]);
      EXPECT_EQ(call_layout(SequenceLayoutKind::zigzag, world, r, total, mask).chunks(),
                SequenceLayout(SequenceLayoutKind::zigzag, world, r, total).chunks());
    }
  }
}

TEST(BalancedLayout, ErrorsNameWhatIsWrong) {
  const RingMask causal{Mask{.causal = true}, 1};
  EXPECT_TRUE(ThrowsNaming([&] { balanced_assignment(4, 1004, causal); }, {"S = 1004", "2N = 8"}));
  EXPECT_TRUE(ThrowsNaming([&] { balanced_layout(3, 0, 1003, causal); }, {"S = 1003", "2N = 6"}));
  EXPECT_TRUE(ThrowsNaming([&] { balanced_assignment(2, 0, causal); }, {"S = 0"}));
  EXPECT_TRUE(ThrowsNaming([&] { balanced_assignment(0, 16, causal); }, {"N = 0"}));
  EXPECT_TRUE(ThrowsNaming([] { SequenceLayout(SequenceLayoutKind::balanced, 2, 0, 16); },
                           {"SequenceLayout", "balanced", "balanced_layout"}));
  EXPECT_TRUE(ThrowsNaming([&] { balanced_layout(2, 2, 16, causal); }, {"rank 2", "N = 2"}));

  // S = 8 over 2 ranks: rank 1's chunk overlaps rank 0's.
  const auto overlapping = std::make_shared<const Assignment>(Assignment{{{0, 0, 4}}, {{0, 2, 4}}});
  EXPECT_TRUE(ThrowsNaming([&] { SequenceLayout(0, 8, overlapping); },
                           {"positions [2, 4) are held twice"}));
  // Every position once, but rank 0 holds 3 tokens and rank 1 five.
  const auto uneven = std::make_shared<const Assignment>(Assignment{{{0, 0, 3}}, {{0, 3, 5}}});
  EXPECT_TRUE(
      ThrowsNaming([&] { SequenceLayout(1, 8, uneven); }, {"rank 0 holds 3 tokens", "S/N = 4"}));
  // Chunks out of order within a rank.
  const auto backwards =
      std::make_shared<const Assignment>(Assignment{{{0, 6, 2}, {2, 0, 2}}, {{0, 2, 4}}});
  EXPECT_TRUE(ThrowsNaming([&] { SequenceLayout(0, 8, backwards); }, {"rank 0's chunk"}));
  EXPECT_TRUE(ThrowsNaming([&] { SequenceLayout(0, 8, nullptr); }, {"no ranks' chunks"}));
  const auto good = std::make_shared<const Assignment>(Assignment{{{0, 0, 4}}, {{0, 4, 4}}});
  EXPECT_TRUE(ThrowsNaming([&] { SequenceLayout(2, 8, good); }, {"rank 2 is out of range"}));
  EXPECT_NO_THROW(SequenceLayout(1, 8, good));
}

// A communicator that answers its rank and size and moves nothing: enough for RingAttention's
// copies, which never communicate.
class FixedRankCommunicator final : public Communicator {
 public:
  FixedRankCommunicator(int rank, int size) : rank_(rank), size_(size) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::host; }
  std::string transport() const override { return "none"; }
  void exchange_start(const void*, std::size_t, void*, std::size_t, void*) override { refuse(); }
  void exchange_wait(void*) override { refuse(); }
  void all_reduce_sum(void*, std::size_t, DType, void*) override { refuse(); }
  void barrier() override { refuse(); }
  std::unique_ptr<Communicator> split(int, int) const override { refuse(); }
  void host_all_gather(const void*, std::size_t, void*) const override { refuse(); }

 private:
  [[noreturn]] static void refuse() {
    throw Error("FixedRankCommunicator", "the test's communicator moves nothing");
  }
  int rank_, size_;
};

TEST(BalancedLayout, RingCopiesNeedTheMask) {
  RingAttention ring(std::make_shared<FixedRankCommunicator>(0, 1), SequenceLayoutKind::balanced);
  HostTensor<double> full({1, 16, 2, 4}, 1.0), local({1, 16, 2, 4});
  EXPECT_TRUE(ThrowsNaming([&] { ring.global_positions(16); },
                           {"RingAttention::global_positions", "balanced", "mask"}));
  EXPECT_TRUE(ThrowsNaming([&] { ring.shard(full.view, local.view); },
                           {"RingAttention::shard", "balanced"}));
  EXPECT_TRUE(ThrowsNaming([&] { ring.unshard(local.view, full.view); },
                           {"RingAttention::unshard", "balanced"}));
  std::vector<std::int64_t> in_order(16);
  std::iota(in_order.begin(), in_order.end(), 0);
  EXPECT_EQ(ring.global_positions(16, Mask{.causal = true}), in_order);
  const std::vector<std::int64_t> starts = {0, 5, 6, 11};
  Mask documents{.causal = true};
  documents.documents = {starts.data(), 4, 0};
  EXPECT_EQ(ring.global_positions(16, documents), in_order);
  ring.shard(full.view, local.view, documents);
  EXPECT_EQ(test::view_bytes(local.view), test::view_bytes(full.view));
  // Starts that are not there.
  Mask missing{.causal = true};
  missing.documents = {nullptr, 3, 0};
  EXPECT_TRUE(ThrowsNaming([&] { ring.global_positions(16, missing); },
                           {"RingAttention::global_positions", "3 document starts", "null"}));
  // The other layouts ignore the mask.
  RingAttention zigzag(std::make_shared<FixedRankCommunicator>(1, 4), SequenceLayoutKind::zigzag);
  EXPECT_EQ(zigzag.global_positions(16, documents), zigzag.global_positions(16));
}

// Over 4 ranks with per-batch documents: every rank's global_positions are the layout's, its
// shard holds the rows of those positions (values and LSE), and the shards unshard into the whole.
TEST(BalancedLayout, RingCopiesFollowTheMaskOverFourRanks) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(73);
  constexpr int kRanks = 4;
  const std::int64_t B = 2, S = 8192, H = 3, D = 5, local_length = S / kRanks;
  // Row 0: many short documents; row 1: one long document across shards; equal counts.
  std::vector<std::int64_t> row0 = lognormal(256, 11, S), row1(row0.size(), S);
  row1[0] = 100;
  row1[1] = 100 + 3 * local_length / 2;
  const Documents documents(Lists{row0, row1});
  const Mask mask = documents.mask(true, 700);
  const RingMask ring_mask{mask, B};

  HostTensor<double> full({B, S, H, D}), rebuilt({B, S, H, D});
  HostTensor<float> lse_full({B, H, S}), lse_rebuilt({B, H, S});
  test::fill_normal(full.storage, rng);
  test::fill_normal(lse_full.storage, rng);
  bool differs_from_one_row = false;
  for (int r = 0; r < kRanks; ++r) {
    RingAttention ring(std::make_shared<FixedRankCommunicator>(r, kRanks),
                       SequenceLayoutKind::balanced);
    const std::vector<std::int64_t> positions = ring.global_positions(S, mask, B);
    EXPECT_EQ(positions, balanced_layout(kRanks, r, S, ring_mask).global_positions())
        << "rank " << r;
    differs_from_one_row |= positions != ring.global_positions(S, mask, 1);
    HostTensor<double> shard({B, local_length, H, D});
    HostTensor<float> lse_shard({B, H, local_length});
    ring.shard(full.view, shard.view, mask);
    ring.shard(lse_full.view, lse_shard.view, mask);
    ASSERT_EQ(std::ssize(positions), local_length);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t i = 0; i < local_length; ++i) {
        for (std::int64_t h = 0; h < H; ++h) {
          for (std::int64_t x = 0; x < D; ++x) {
            ASSERT_EQ(shard.storage[shard.view.offset(b, i, h, x)],
                      full.storage[full.view.offset(b, positions[i], h, x)])
                << "rank " << r << ", local row " << i;
          }
          ASSERT_EQ(lse_shard.storage[lse_shard.view.offset(b, h, i)],
                    lse_full.storage[lse_full.view.offset(b, h, positions[i])])
              << "rank " << r << ", local row " << i;
        }
      }
    }
    ring.unshard(shard.view, rebuilt.view, mask);
    ring.unshard(lse_shard.view, lse_rebuilt.view, mask);
  }
  EXPECT_EQ(test::view_bytes(rebuilt.view), test::view_bytes(full.view));
  EXPECT_EQ(test::view_bytes(lse_rebuilt.view), test::view_bytes(lse_full.view));
  // Not a requirement of the layout, but of this case: it is only a test of the batch argument
  // if the second row changes the layout.
  EXPECT_TRUE(differs_from_one_row) << "the second batch row did not change the layout";
}

}  // namespace
}  // namespace ringattn
