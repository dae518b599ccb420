// ringattn-mpi-ranks: 2 3 4
// Ring attention over the balanced layout (SequenceLayoutKind::balanced), on the CPU backend
// across real MPI ranks, against the fp64 oracle on the whole sequence with the same Mask, by
// the criteria of mpi_ring_masks.cpp (TESTING.md, "Ring"):
//   f64 inputs: relative error under 1e-12 for O, LSE, dQ, dK and dV;
//   f32 inputs: relative error under 1e-5, and at most 1.2x (zigzag's factor there) the error of
//               the CPU flash block run on the whole problem in one process with the same mask,
//               the LSE with sqrt(N - 1) * u / 4 on top for its fp32 rounding at each merge.
// Every rank shards the whole Q, K, V and dO with ring.shard(full, local, mask), runs the forward
// and the backward, and the outputs are put together from every rank's shard at the positions its
// ring.global_positions(S, mask, batch) gives (its own O also through ring.unshard).
// Masks, all causal, GQA (4 query heads on one K/V head): random packed documents (log-normal
// lengths, one-token documents, an empty one, a document of 1.5 shards), per-batch documents
// (batch 2, another list a row), and a causal window (which the layout leaves in the contiguous
// split, even under it). The sequences are long enough for the
// layout to cut a rank's share into more than two chunks (but for f32 on 4 ranks), and the
// document case draws its documents until it does, so that it tests more than zigzag's shape. A
// second f64 call gives bitwise the first (the layout kept for the same mask), and one ring
// called with masks that change (and back) follows each.
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "parallel/performance_model.hpp"
#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"
#include "tests/common/ring_testing.hpp"

namespace ringattn {
namespace {

using test::broadcast_from_rank0;
using test::HostTensor;
using test::kFields;
using test::kNames;
using test::Outputs;
using test::OutputTensors;
using test::WholeProblem;

constexpr double kUnitRoundoff = 0x1p-24;  // fp32
constexpr double kErrorFactor = 1.2;       // mpi_ring_masks.cpp's zigzag factor (see there)

// f64: S = 3072, room for up to 8 chunks a rank of at least 128 tokens on 2 and 3 ranks, 4 on 4
// ranks. f32: S = 1536 (head_dim 32, for a one-process error well above the merges' rounding),
// more than two chunks a rank on 2 and 3 ranks.
constexpr AttentionShape kF64Shape{1, 3072, 3072, 4, 1, 8};
constexpr AttentionShape kF32Shape{1, 1536, 1536, 4, 1, 32};

enum class DocumentKind { none, packed, per_batch };

struct MaskCase {
  const char* name;
  std::int64_t window_left;
  DocumentKind documents;
};

void PrintTo(const MaskCase& c, std::ostream* out) {
  *out << c.name;
}

const MaskCase kCases[] = {
    {"Documents", 0, DocumentKind::packed},
    {"PerBatchDocuments", 0, DocumentKind::per_batch},
    {"CausalWindow", 300, DocumentKind::none},
};

using Lists = std::vector<std::vector<std::int64_t>>;

// Log-normal documents of mean S/24 tokens (document_starts, `seed`), with, when `long_length`
// > 0, one of that length among them; plus one-token documents (two starts one apart: at the
// start, across a shard edge and at the end), an empty one (a repeated start) and a start past
// the end.
std::vector<std::int64_t> random_documents(std::int64_t total, int ranks, std::uint64_t seed,
                                           std::int64_t long_length) {
  std::string description = "lognormal:" + std::to_string(total / 24) + ":" + std::to_string(seed);
  if (long_length > 0) description.append(":").append(std::to_string(long_length));
  std::vector<std::int64_t> starts = document_starts(description, total);
  const std::int64_t shard = total / ranks;
  for (std::int64_t p : {std::int64_t{0}, shard - 1, shard + 40, total - 1}) {
    starts.push_back(p);
    starts.push_back(p + 1);
  }
  starts.push_back(total / 3);
  starts.push_back(total / 3);
  starts.push_back(total + 7);
  std::sort(starts.begin(), starts.end());
  return starts;
}

// The gcd of every chunk's start and length over all ranks: below S/(2N) when the layout cut a
// rank's share into more than two chunks.
std::int64_t finest_chunk(const SequenceLayout::Assignment& a, std::int64_t total) {
  std::int64_t grain = total;
  for (const auto& chunks : a) {
    for (const SequenceChunk& c : chunks)
      grain = std::gcd(grain, std::gcd(c.global_start, c.length));
  }
  return grain;
}

// Whether S/(2N) is long enough for the layout to cut it in two chunks of at least 128 tokens.
bool finer_chunks_fit(std::int64_t total, int ranks) {
  return total / (2 * ranks) >= 2 * 128;
}

// The document lists of a case (empty: none), the same on every rank (rank 0's seed). The packed
// case draws until the layout takes more than two chunks a rank where they fit (about 2 draws in
// 3 do on two ranks, 199 in 200 on three and four), so that it tests more than zigzag's shape.
Lists case_documents(const MaskCase& c, std::int64_t total, int ranks, std::mt19937_64& rng) {
  const std::int64_t long_length = 3 * total / (2 * ranks);  // 1.5 shards
  switch (c.documents) {
    case DocumentKind::none:
      return {};
    case DocumentKind::packed: {
      std::vector<std::int64_t> starts;
      for (int draw = 0; draw < 64; ++draw) {
        starts = random_documents(total, ranks, rng() % 1000000, long_length);
        if (!finer_chunks_fit(total, ranks)) break;
        const Mask mask{.causal = true, .documents = {starts.data(), std::ssize(starts), 0}};
        if (finest_chunk(*balanced_assignment(ranks, total, RingMask{mask, 1}), total) <
            total / (2 * ranks)) {
          break;
        }
      }
      return {starts};
    }
    case DocumentKind::per_batch: {
      const std::uint64_t seed = rng() % 1000000;
      // Row 0 short documents only, row 1 with the long one; equal counts (the shorter list
      // padded with its last start, past the end).
      Lists lists = {random_documents(total, ranks, seed, 0),
                     random_documents(total, ranks, seed + 1, long_length)};
      const std::size_t count = std::max(lists[0].size(), lists[1].size());
      for (auto& list : lists) list.resize(count, list.back());
      return lists;
    }
  }
  return {};
}

// Document lists packed as DocumentStarts reads them, and the call's Mask.
struct Documents {
  Lists lists;
  std::vector<std::int64_t> packed;
  DocumentStarts starts;

  explicit Documents(Lists l) : lists(std::move(l)) {
    for (const auto& list : lists) packed.insert(packed.end(), list.begin(), list.end());
    if (!lists.empty()) {
      const auto count = static_cast<std::int64_t>(lists[0].size());
      starts = {packed.data(), count, lists.size() > 1 ? count : 0};
    }
  }
  Documents(const Documents&) = delete;
  Documents& operator=(const Documents&) = delete;

  Mask mask(std::int64_t window_left) const {
    Mask m;
    m.causal = true;
    m.window_left = window_left;
    m.documents = starts;
    return m;
  }
};

// Every rank's local values (logical order) placed at the positions that rank's ring gave:
// [B, Sl, H, D] into [B, S, H, D] (`lse` false) or [B, H, Sl] into [B, H, S]. NaN where no rank
// wrote.
std::vector<double> gather_by_positions(const Communicator& comm, const std::vector<double>& local,
                                        const std::vector<std::int64_t>& positions,
                                        const std::vector<std::int64_t>& shape, bool lse) {
  const int ranks = comm.size();
  const std::int64_t local_length = std::ssize(positions);
  std::vector<double> values(local.size() * ranks);
  comm.host_all_gather(local.data(), local.size() * sizeof(double), values.data());
  std::vector<std::int64_t> all_positions(positions.size() * ranks);
  comm.host_all_gather(positions.data(), positions.size() * sizeof(std::int64_t),
                       all_positions.data());
  std::int64_t whole_count = 1;
  for (std::int64_t extent : shape) whole_count *= extent;
  std::vector<double> whole(static_cast<std::size_t>(whole_count),
                            std::numeric_limits<double>::quiet_NaN());
  const std::int64_t B = shape[0], S = lse ? shape[2] : shape[1];
  const std::int64_t rows = lse ? shape[1] : 1;              // heads before the sequence
  const std::int64_t inner = lse ? 1 : shape[2] * shape[3];  // elements a token
  for (int p = 0; p < ranks; ++p) {
    const double* mine = values.data() + p * local.size();
    const std::int64_t* where = all_positions.data() + p * positions.size();
    for (std::int64_t b = 0; b < B * rows; ++b) {
      for (std::int64_t i = 0; i < local_length; ++i) {
        for (std::int64_t x = 0; x < inner; ++x) {
          whole[(b * S + where[i]) * inner + x] = mine[(b * local_length + i) * inner + x];
        }
      }
    }
  }
  return whole;
}

// The ring forward and backward on this rank's shards of `problem` under `mask`; the whole
// outputs, put together from every rank's.
template <typename T>
Outputs run_ring(RingAttention& ring, const Communicator& comm, const WholeProblem<T>& problem,
                 const Mask& mask) {
  const AttentionShape& s = problem.s;
  AttentionShape ls = s;
  ls.q_len = ls.k_len = s.q_len / comm.size();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  HostTensor<T> q({s.batch, ls.q_len, s.q_heads, s.head_dim}),
      k({s.batch, ls.k_len, s.kv_heads, s.head_dim}),
      v({s.batch, ls.k_len, s.kv_heads, s.head_dim}),
      dout({s.batch, ls.q_len, s.q_heads, s.head_dim});
  ring.shard(problem.q.view, q.view, mask);
  ring.shard(problem.k.view, k.view, mask);
  ring.shard(problem.v.view, v.view, mask);
  ring.shard(problem.dout.view, dout.view, mask);

  OutputTensors<T> local(ls, nan);
  test::run_ring(ring, q.view, k.view, v.view, dout.view, local, problem.scale, mask);

  const std::vector<std::int64_t> positions = ring.global_positions(s.q_len, mask, s.batch);
  const std::vector<std::int64_t> value_shape = {s.batch, s.q_len, s.q_heads, s.head_dim},
                                  lse_shape = {s.batch, s.q_heads, s.q_len},
                                  key_shape = {s.batch, s.k_len, s.kv_heads, s.head_dim};
  Outputs whole;
  whole.o = gather_by_positions(comm, local.o.values(), positions, value_shape, false);
  whole.lse = gather_by_positions(comm, local.lse.values(), positions, lse_shape, true);
  whole.dq = gather_by_positions(comm, local.dq.values(), positions, value_shape, false);
  whole.dk = gather_by_positions(comm, local.dk.values(), positions, key_shape, false);
  whole.dv = gather_by_positions(comm, local.dv.values(), positions, key_shape, false);

  // unshard writes this rank's O where the positions say, and nothing else.
  HostTensor<T> unsharded({s.batch, s.q_len, s.q_heads, s.head_dim});
  ring.unshard(local.o.view, unsharded.view, mask);
  const std::vector<double> mine = unsharded.values();
  std::vector<bool> own(static_cast<std::size_t>(s.q_len), false);
  for (std::int64_t p : positions) own[p] = true;
  const std::int64_t inner = s.q_heads * s.head_dim;
  std::int64_t wrong = 0;
  for (std::size_t e = 0; e < mine.size(); ++e) {
    const auto position = static_cast<std::size_t>(static_cast<std::int64_t>(e) / inner % s.q_len);
    if (own[position] ? mine[e] != whole.o[e] : !std::isnan(mine[e])) ++wrong;
  }
  EXPECT_EQ(wrong, 0) << "rank " << comm.rank()
                      << ": ring.unshard of O disagrees with its global_positions";
  return whole;
}

// The ring's outputs against the oracle (and for f32 the one-process error, printed by rank 0
// with the ring's); `where` names the case in the messages.
template <typename T>
void expect_matches(const Outputs& out, const Outputs& oracle, const Outputs& single,
                    const Communicator& comm, const std::string& where) {
  const int ranks = comm.size();
  const bool root = comm.rank() == 0;
  for (int i = 0; i < 5; ++i) {
    const std::vector<double>& got = out.*kFields[i];
    const std::vector<double>& ref = oracle.*kFields[i];
    if constexpr (std::is_same_v<T, double>) {
      EXPECT_TRUE(test::Close(kNames[i], got, ref, 1e-12)) << where;
    } else {
      EXPECT_TRUE(test::Close(kNames[i], got, ref, 1e-5)) << where;
      const test::Diff ring_error = test::compare(got, ref);
      const test::Diff single_error = test::compare(single.*kFields[i], ref);
      const bool lse = i == 1;
      const double allowance = lse ? std::sqrt(ranks - 1.0) * kUnitRoundoff / 4 : 0.0;
      const double bound = kErrorFactor * single_error.rel + allowance;
      EXPECT_LE(ring_error.rel, bound)
          << where << ", " << kNames[i] << ": the ring's error against the oracle ("
          << test::describe(ring_error) << ") exceeds " << bound << " = " << kErrorFactor
          << "x the error of one process (" << test::describe(single_error) << ")"
          << (lse ? " + sqrt(N - 1) * u / 4" : "") << " [" << test::seed_trace() << "]";
      if (root) {
        std::printf("[ ringattn ] %-40s %-3s ring %.3g one process %.3g ratio %.3f\n",
                    where.c_str(), kNames[i], ring_error.rel, single_error.rel,
                    ring_error.rel / single_error.rel);
      }
    }
  }
}

template <typename T>
void check_against_oracle(const MaskCase& c) {
  auto comm = std::shared_ptr<Communicator>(MpiCommunicator::world());
  const int ranks = comm->size();
  std::mt19937_64 rng = test::make_rng(80);
  const WholeProblem<T> problem(std::is_same_v<T, double> ? kF64Shape : kF32Shape, rng);
  const AttentionShape s = problem.s;
  const Documents documents(case_documents(c, s.q_len, ranks, rng));
  // Per-batch documents need batch rows of their own.
  const WholeProblem<T> batched(
      AttentionShape{2, s.q_len, s.k_len, s.q_heads, s.kv_heads, s.head_dim}, rng);
  const WholeProblem<T>& p = c.documents == DocumentKind::per_batch ? batched : problem;
  const Mask mask = documents.mask(c.window_left);
  const std::string where = std::string(c.name) + " over " + std::to_string(ranks) +
                            " ranks, S = " + std::to_string(p.s.q_len) + ", batch " +
                            std::to_string(p.s.batch);

  if (c.documents == DocumentKind::packed && finer_chunks_fit(p.s.q_len, ranks)) {
    const auto a = balanced_assignment(ranks, p.s.q_len, RingMask{mask, p.s.batch});
    EXPECT_LT(finest_chunk(*a, p.s.q_len), p.s.q_len / (2 * ranks))
        << where << ": the layout kept two chunks a rank in 64 draws of documents";
  }

  // The references once, on rank 0, not by each of 4 ranks sharing 2 cores.
  const bool root = comm->rank() == 0;
  const Outputs oracle = broadcast_from_rank0(root ? p.oracle(mask) : Outputs{}, p.s);
  const Outputs single = std::is_same_v<T, float>
                             ? broadcast_from_rank0(root ? p.one_process(mask) : Outputs{}, p.s)
                             : Outputs{};
  RingAttention ring(comm, SequenceLayoutKind::balanced);
  const Outputs out = run_ring(ring, *comm, p, mask);
  expect_matches<T>(out, oracle, single, *comm, where);
  if constexpr (std::is_same_v<T, double>) {
    const Outputs again = run_ring(ring, *comm, p, mask);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(out.*kFields[i], again.*kFields[i])
          << where << ": " << kNames[i] << " differs between two identical calls";
    }
  }
}

class MpiRingBalanced : public testing::TestWithParam<MaskCase> {};

TEST_P(MpiRingBalanced, F64MatchesOracle) {
  SCOPED_TRACE(test::seed_trace());
  check_against_oracle<double>(GetParam());
}

TEST_P(MpiRingBalanced, F32WithinTheOneProcessError) {
  SCOPED_TRACE(test::seed_trace());
  check_against_oracle<float>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Masks, MpiRingBalanced, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<MaskCase>& info) {
                           return std::string(info.param.name);
                         });

// One ring, calls under masks that change and change back: each call lays its shards out by its
// own mask (the layout the ring keeps is only for the same mask).
TEST(MpiRingBalancedCalls, FollowTheMaskOfEachCall) {
  SCOPED_TRACE(test::seed_trace());
  auto comm = std::shared_ptr<Communicator>(MpiCommunicator::world());
  const int ranks = comm->size();
  std::mt19937_64 rng = test::make_rng(81);
  const WholeProblem<double> problem(AttentionShape{1, 1536, 1536, 4, 1, 8}, rng);
  const std::int64_t total = problem.s.q_len;
  const auto layout_of = [&](const Lists& lists) {
    const Documents documents(lists);
    return *balanced_assignment(ranks, total, RingMask{documents.mask(0), 1});
  };
  const Lists first_lists = case_documents(kCases[0], total, ranks, rng);
  // Another draw whose layout differs (nearly every one does).
  Lists second_lists;
  for (int draw = 0; draw < 64; ++draw) {
    second_lists = case_documents(kCases[0], total, ranks, rng);
    if (layout_of(second_lists) != layout_of(first_lists)) break;
  }
  ASSERT_NE(layout_of(first_lists), layout_of(second_lists))
      << "64 draws of documents gave the first's layout; the test needs two";
  const Documents first(first_lists), second(second_lists);
  const Mask masks[] = {first.mask(0),   second.mask(0),       first.mask(0),
                        first.mask(200), Mask{.causal = true}, first.mask(0)};
  const char* names[] = {"documents A",       "documents B",
                         "documents A again", "documents A with a window",
                         "causal alone",      "documents A once more"};
  const bool root = comm->rank() == 0;
  RingAttention ring(comm, SequenceLayoutKind::balanced);
  for (std::size_t m = 0; m < std::size(masks); ++m) {
    const Outputs oracle =
        broadcast_from_rank0(root ? problem.oracle(masks[m]) : Outputs{}, problem.s);
    const Outputs out = run_ring(ring, *comm, problem, masks[m]);
    expect_matches<double>(out, oracle, Outputs{}, *comm,
                           std::string(names[m]) + " over " + std::to_string(ranks) + " ranks");
  }
}

}  // namespace
}  // namespace ringattn
