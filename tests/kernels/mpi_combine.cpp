// ringattn-mpi-ranks: 2 4
// The mpi tier's smoke test: every rank builds the same random problem, computes the partial
// (O, LSE) of its own contiguous K/V chunk with the CPU block's combine mode, and rank 0 merges
// the gathered partials (an explicit fp64 log-add-exp merge written here) and compares the result
// with the fp64 oracle on the full sequence.
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::HostTensor;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

TEST(MpiTier, CommSizeMatchesLauncher) {
  const char* expected = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (expected == nullptr) expected = std::getenv("PMI_SIZE");
  if (expected == nullptr) {
    GTEST_SKIP() << "the launcher set neither OMPI_COMM_WORLD_SIZE nor PMI_SIZE";
  }
  EXPECT_EQ(world_size(), std::atoi(expected)) << "MPI_COMM_WORLD does not hold the launched ranks";
}

// Global start of rank r's K/V chunk: uneven lengths that grow with the rank.
std::int64_t chunk_start(std::int64_t k_len, int rank, int ranks) {
  return k_len * rank * (rank + 1) / (static_cast<std::int64_t>(ranks) * (ranks + 1));
}

class MpiCombine : public testing::TestWithParam<bool> {};

TEST_P(MpiCombine, MergedRankPartialsEqualOneShot) {
  SCOPED_TRACE(test::seed_trace());
  const bool causal = GetParam();
  const int rank = world_rank(), ranks = world_size();

  // The same problem on every rank: rank 0 draws the generator's seed and broadcasts it.
  std::uint64_t seed = rank == 0 ? test::make_rng(30)() : 0;
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 rng(seed);
  const AttentionShape s{2, 301, 301, 4, 2, 32};
  const Mask mask{causal, 0, 0};
  const double scale = default_scale(s.head_dim);
  test::QkvBuffers<double> qkv(s, test::Layout::contiguous, 0.0);
  test::fill_normal(qkv.q_storage, rng);
  test::fill_normal(qkv.k_storage, rng);
  test::fill_normal(qkv.v_storage, rng);
  // Every rank holds the same inputs: compare a checksum's extremes over the ranks.
  double checksum = 0.0;
  for (const auto* values : {&qkv.q_storage, &qkv.k_storage, &qkv.v_storage}) {
    for (std::size_t i = 0; i < values->size(); ++i) checksum += (*values)[i] * static_cast<double>(i % 7 + 1);
  }
  double checksum_min = 0.0, checksum_max = 0.0;
  MPI_Allreduce(&checksum, &checksum_min, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&checksum, &checksum_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  ASSERT_EQ(checksum_min, checksum_max) << "ranks built different problems";

  // This rank's partial over keys [first, last) from the running pair O = 0, LSE = -inf, merged
  // block by block as a ring step would: the chunk's second part first, then its first part.
  const std::int64_t first = chunk_start(s.k_len, rank, ranks), last = chunk_start(s.k_len, rank + 1, ranks);
  const std::int64_t middle = first + (last - first) / 3;
  HostTensor<double> o({s.batch, s.q_len, s.q_heads, s.head_dim}, 0.0);
  HostTensor<double> lse({s.batch, s.q_heads, s.q_len}, kNegInf);
  auto block_args = [&](std::int64_t begin, std::int64_t end) {
    ForwardArgs args;
    args.q = qkv.q;
    args.k = qkv.k;
    args.v = qkv.v;
    args.k.data = qkv.k_storage.data() + begin * qkv.k.strides[1];
    args.v.data = qkv.v_storage.data() + begin * qkv.v.strides[1];
    args.k.shape[1] = args.v.shape[1] = end - begin;
    args.o = o.view;
    args.lse = lse.view;
    args.scale = scale;
    args.mask = mask;
    args.mask.k_start = begin;
    args.combine = true;
    return args;
  };
  cpu::flash_forward(block_args(middle, last));
  cpu::flash_forward(block_args(first, middle));
  const ForwardArgs args = block_args(first, last);

  // The partial alone is the oracle on the chunk (rows that see none of it: O = 0, LSE = -inf).
  {
    HostTensor<double> o_chunk({s.batch, s.q_len, s.q_heads, s.head_dim});
    HostTensor<double> lse_chunk({s.batch, s.q_heads, s.q_len});
    reference::attention_forward(args.q, args.k, args.v, args.mask, scale, o_chunk.view, lse_chunk.view);
    EXPECT_TRUE(test::Close("rank partial O", o.values(), o_chunk.values(), 1e-12)) << "rank " << rank;
    EXPECT_TRUE(test::Close("rank partial LSE", lse.values(), lse_chunk.values(), 1e-12)) << "rank " << rank;
  }

  const int o_count = static_cast<int>(o.storage.size()), lse_count = static_cast<int>(lse.storage.size());
  std::vector<double> all_o(rank == 0 ? static_cast<std::size_t>(o_count) * ranks : 0);
  std::vector<double> all_lse(rank == 0 ? static_cast<std::size_t>(lse_count) * ranks : 0);
  ASSERT_EQ(MPI_Gather(o.storage.data(), o_count, MPI_DOUBLE, all_o.data(), o_count, MPI_DOUBLE, 0,
                       MPI_COMM_WORLD),
            MPI_SUCCESS);
  ASSERT_EQ(MPI_Gather(lse.storage.data(), lse_count, MPI_DOUBLE, all_lse.data(), lse_count,
                       MPI_DOUBLE, 0, MPI_COMM_WORLD),
            MPI_SUCCESS);
  if (rank != 0) return;

  // Merge: LSE = log(sum_r exp(LSE_r)), O = sum_r exp(LSE_r - LSE) O_r.
  std::vector<double> merged_o(o_count, 0.0), merged_lse(lse_count, kNegInf);
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t h = 0; h < s.q_heads; ++h) {
      for (std::int64_t i = 0; i < s.q_len; ++i) {
        const std::int64_t row = lse.view.offset(b, h, i);
        double m = kNegInf;
        for (int r = 0; r < ranks; ++r) m = std::max(m, all_lse[r * lse_count + row]);
        if (m == kNegInf) continue;  // no rank saw a key: O = 0, LSE = -inf
        double sum = 0.0;
        for (int r = 0; r < ranks; ++r) sum += std::exp(all_lse[r * lse_count + row] - m);
        const double total = m + std::log(sum);
        merged_lse[row] = total;
        for (int r = 0; r < ranks; ++r) {
          const double weight = std::exp(all_lse[r * lse_count + row] - total);
          for (std::int64_t x = 0; x < s.head_dim; ++x) {
            const std::int64_t e = o.view.offset(b, i, h, x);
            merged_o[e] += weight * all_o[r * o_count + e];
          }
        }
      }
    }
  }
  HostTensor<double> o_ref({s.batch, s.q_len, s.q_heads, s.head_dim});
  HostTensor<double> lse_ref({s.batch, s.q_heads, s.q_len});
  reference::attention_forward(qkv.q, qkv.k, qkv.v, mask, scale, o_ref.view, lse_ref.view);
  EXPECT_TRUE(test::Close("merged O", merged_o, o_ref.values(), 1e-12)) << ranks << " ranks";
  EXPECT_TRUE(test::Close("merged LSE", merged_lse, lse_ref.values(), 1e-12)) << ranks << " ranks";
}

INSTANTIATE_TEST_SUITE_P(Masks, MpiCombine, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "Causal" : "NonCausal");
                         });

}  // namespace
}  // namespace ringattn
