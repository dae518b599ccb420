// ringattn-mpi-ranks: 1 2 3 4 8
// Ring attention on the CPU backend across real MPI ranks, against the fp64 oracle on the whole
// sequence. Every rank builds the same random problem (the shared seed), shards it with the
// layout, runs the ring forward and backward on its shard, gathers every rank's outputs and
// unshards them, then compares O, LSE, dQ, dK and dV with ringattn::reference on the full
// sequence (TESTING.md, "Ring"):
//   f64 inputs: relative error under 1e-12;
//   f32 inputs: relative error under 1e-5, and at most 1.1x the error of the CPU flash block run
//               on the whole problem in one process (which is the ring over one rank), for O, dQ,
//               dK and dV. The LSE gets, on top of 1.1x, sqrt(N - 1) * u / 4 (u = 2^-24): the
//               block's combine mode keeps the running LSE in fp32 (DESIGN.md) and so rounds it
//               once per merge, whoever does the merging. The one-process LSE is within about half
//               an ulp of the truth (relative error ~3e-8 at |LSE| ~ 6), and 8 sequential combines
//               of the CPU block in one process, no ring involved, already raise it to ~4e-8
//               (1.3x); the ring measures the same. u / 4 per sqrt(merge) is about twice that
//               growth, so a schedule that loses more than rounding still fails.
// Both layouts, causal and not, GQA (4 query heads on 2 K/V heads), batch 2, strided (packed QKV)
// shards for the zigzag layout; also a dp x cp mesh of independent rings.
// A value head dim d_v of its own (V, O, dO, dV [.., d_v]; Q, K, dQ, dK [.., d_qk]): K and V
// shards of different widths travel together, and so do their dK|dV accumulators; the same
// criterion for multi-head latent attention's 192/128 and a d_v above and below d_qk, the C API's
// ring on such shards (bitwise the C++ ring), and ranks that disagree on d_v failing alike on
// every rank.
#include <mpi.h>

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/ringattn.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/random.hpp"
#include "tests/common/ring_testing.hpp"

namespace ringattn {
namespace {

using test::broadcast_from_rank0;
using test::gather_whole;
using test::kFields;
using test::kNames;
using test::Outputs;
using test::OutputTensors;
using test::WholeProblem;

using test::HostTensor;

// fp32's unit roundoff 2^-24: the largest relative error of one rounding to nearest.
constexpr double kUnitRoundoff = 0x1p-24;

// Runs the ring forward and backward on this rank's shards of `problem`, causal or not; returns
// the whole outputs, gathered from all ranks. Zigzag shards of Q, K and V are strided views of one
// packed [B, Sl, Hq D + Hkv D + Hkv Dv] buffer.
template <typename T>
Outputs run_ring(RingAttention& ring, const Communicator& comm, const WholeProblem<T>& problem,
                 bool causal) {
  const AttentionShape& s = problem.s;
  AttentionShape ls = s;
  ls.q_len = ls.k_len = s.q_len / comm.size();
  const test::Layout memory_layout =
      ring.layout() == SequenceLayoutKind::zigzag ? test::Layout::packed : test::Layout::contiguous;
  test::QkvBuffers<T> qkv(ls, memory_layout, std::numeric_limits<T>::quiet_NaN());
  HostTensor<T> dout({s.batch, ls.q_len, s.q_heads, s.value_dim()});
  ring.shard(problem.q.view, qkv.q);
  ring.shard(problem.k.view, qkv.k);
  ring.shard(problem.v.view, qkv.v);
  ring.shard(problem.dout.view, dout.view);

  OutputTensors<T> local(ls);
  ring.forward(
      {qkv.q, qkv.k, qkv.v, local.o.view, local.lse.view, problem.scale, causal, nullptr, {}});
  ring.backward({qkv.q, qkv.k, qkv.v, local.o.view, local.lse.view, dout.view, local.dq.view,
                 local.dk.view, local.dv.view, problem.scale, causal, false, nullptr, {}});

  OutputTensors<T> whole(s);
  for (int i = 0; i < 5; ++i) {
    gather_whole(*local.all()[i], ring.layout(), comm, whole.all()[i]->view);
  }
  return whole.values();
}

enum class Precision { f64, f32 };

struct Case {
  const char* name;
  AttentionShape s;  // S a multiple of 2N for N = 1, 2, 3, 4, 8
  Precision precision;
  bool causal;
  // The most ranks the case runs on. The value-head-dim cases are short (chunks of 12 to 24
  // tokens at 4 ranks): on 8 their one-process error is small enough that the fp32 rounding of the
  // running O at each merge alone reaches the 1.1x bound, which would then measure the size of
  // the case, not the schedule.
  int max_ranks = 8;
};

void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

// S = 384: zigzag chunks of 24 tokens on 8 ranks.
constexpr AttentionShape kShape{2, 384, 384, 4, 2, 32};

const Case kCases[] = {
    {"f64_full", kShape, Precision::f64, false},
    {"f64_causal", kShape, Precision::f64, true},
    {"f32_full", kShape, Precision::f32, false},
    {"f32_causal", kShape, Precision::f32, true},
    // A value head dim of its own: multi-head latent attention's 192/128, d_v above and below d_qk.
    {"Mla192x128_f64_causal", {2, 96, 96, 4, 2, 192, 128}, Precision::f64, true, 4},
    {"Mla192x128_f32_causal", {2, 96, 96, 4, 2, 192, 128}, Precision::f32, true, 4},
    {"D24Dv40_f64_full", {2, 192, 192, 4, 1, 24, 40}, Precision::f64, false, 4},
    {"D24Dv40_f32_full", {2, 192, 192, 4, 1, 24, 40}, Precision::f32, false, 4},
    {"D40Dv24_f32_causal", {1, 384, 384, 4, 2, 40, 24}, Precision::f32, true, 4},
};

class MpiRingAttention : public testing::TestWithParam<Case> {};

template <typename T>
void check_against_oracle(const Case& c) {
  auto comm = std::shared_ptr<Communicator>(MpiCommunicator::world());
  const int ranks = comm->size();
  std::mt19937_64 rng = test::make_rng(c.causal ? 41 : 40);
  const WholeProblem<T> problem(c.s, rng);
  const Mask mask{c.causal, 0, 0};
  const bool root = comm->rank() == 0;
  const Outputs oracle = broadcast_from_rank0(root ? problem.oracle(mask) : Outputs{}, problem.s);
  const Outputs single =
      std::is_same_v<T, float>
          ? broadcast_from_rank0(root ? problem.one_process(mask) : Outputs{}, problem.s)
          : Outputs{};

  for (SequenceLayoutKind kind : {SequenceLayoutKind::contiguous, SequenceLayoutKind::zigzag}) {
    SCOPED_TRACE(std::string(sequence_layout_name(kind)) + " layout over " + std::to_string(ranks) +
                 " ranks");
    RingAttention ring(comm, kind);
    const Outputs out = run_ring(ring, *comm, problem, c.causal);
    // A second call reuses the workspaces and gives bitwise the same outputs.
    const Outputs again = run_ring(ring, *comm, problem, c.causal);

    for (int i = 0; i < 5; ++i) {
      const std::vector<double>& got = out.*kFields[i];
      const std::vector<double>& ref = oracle.*kFields[i];
      EXPECT_EQ(got, again.*kFields[i]) << kNames[i] << " differs between two identical calls";
      const test::Diff ring_error = test::compare(got, ref);
      if constexpr (std::is_same_v<T, double>) {
        EXPECT_TRUE(test::Close(kNames[i], got, ref, 1e-12));
        if (root) {
          std::printf("[ ringattn ] %-21s %-10s N=%d %-3s ring %.3g\n", c.name,
                      std::string(sequence_layout_name(kind)).c_str(), ranks, kNames[i],
                      ring_error.rel);
        }
      } else {
        EXPECT_TRUE(test::Close(kNames[i], got, ref, 1e-5));
        const test::Diff single_error = test::compare(single.*kFields[i], ref);
        // The LSE's allowance for the fp32 rounding of its running value at each merge (above).
        const bool lse = i == 1;
        const double allowance = lse ? std::sqrt(ranks - 1.0) * kUnitRoundoff / 4 : 0.0;
        const double bound = 1.1 * single_error.rel + allowance;
        EXPECT_LE(ring_error.rel, bound)
            << kNames[i] << ": the ring's error against the oracle (" << test::describe(ring_error)
            << ") exceeds " << bound << " = 1.1x the error of one process ("
            << test::describe(single_error) << ")" << (lse ? " + sqrt(N - 1) * u / 4" : "") << " ["
            << test::seed_trace() << "]";
        if (root) {
          std::printf(
              "[ ringattn ] %-21s %-10s N=%d %-3s ring %.3g one process %.3g ratio %.3f\n", c.name,
              std::string(sequence_layout_name(kind)).c_str(), ranks, kNames[i], ring_error.rel,
              single_error.rel, ring_error.rel / single_error.rel);
        }
      }
    }
  }
}

TEST_P(MpiRingAttention, MatchesOracleOnWholeSequence) {
  SCOPED_TRACE(test::seed_trace());
  if (MpiCommunicator::world()->size() > GetParam().max_ranks) {
    GTEST_SKIP() << GetParam().name << " runs on at most " << GetParam().max_ranks << " ranks";
  }
  if (GetParam().precision == Precision::f64) {
    check_against_oracle<double>(GetParam());
  } else {
    check_against_oracle<float>(GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MpiRingAttention, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

// A dp x cp mesh: the world split into groups of cp consecutive ranks, each running its own ring
// on its own problem at once; every group matches the oracle of its problem.
TEST(MpiRingMesh, SplitGroupsRunIndependentRings) {
  SCOPED_TRACE(test::seed_trace());
  auto world = std::shared_ptr<Communicator>(MpiCommunicator::world());
  if (world->size() < 4 || world->size() % 2 != 0) {
    GTEST_SKIP() << "needs an even number of ranks >= 4 for two groups of >= 2, has "
                 << world->size();
  }
  const int cp = world->size() / 2, group = world->rank() / cp;
  std::shared_ptr<Communicator> ring_comm = split_communicator(*world, group, world->rank() % cp);
  ASSERT_EQ(ring_comm->size(), cp);
  ASSERT_EQ(ring_comm->rank(), world->rank() % cp);

  std::mt19937_64 rng = test::make_rng(50 + static_cast<std::uint64_t>(group));
  const WholeProblem<double> problem({1, 16 * cp, 16 * cp, 2, 1, 16}, rng);
  RingAttention ring(ring_comm, SequenceLayoutKind::zigzag);
  const Outputs out = run_ring(ring, *ring_comm, problem, true);
  const Outputs oracle = problem.oracle(Mask{.causal = true});
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(test::Close(kNames[i], out.*kFields[i], oracle.*kFields[i], 1e-12))
        << "group " << group;
  }
}

// The C API's ring (ringattn_ring_forward and ringattn_ring_backward over MPI_COMM_WORLD) on shards
// of d_qk 12 and d_v 20, each tensor described with its own shape: bitwise the C++ ring.
TEST(MpiRingValueDimsCApi, ForwardAndBackwardEqualTheCppRing) {
  SCOPED_TRACE(test::seed_trace());
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::int64_t B = 2, Sl = 12, Hq = 4, Hkv = 2, D = 12, Dv = 20;
  std::mt19937_64 rng = test::make_rng(110 + static_cast<std::uint64_t>(rank));
  auto q = test::normal_vector<double>(B * Sl * Hq * D, rng);
  auto k = test::normal_vector<double>(B * Sl * Hkv * D, rng);
  auto v = test::normal_vector<double>(B * Sl * Hkv * Dv, rng);
  auto g = test::normal_vector<double>(B * Sl * Hq * Dv, rng);
  std::vector<double> o(g.size()), lse(B * Hq * Sl), dq(q.size()), dk(k.size()), dv(v.size());

  ringattn_ring_t ring = nullptr;
  const MPI_Comm world = MPI_COMM_WORLD;
  ASSERT_EQ(ringattn_ring_create(&world, RINGATTN_HOST, RINGATTN_ZIGZAG, &ring), RINGATTN_SUCCESS)
      << ringattn_last_error();
  ringattn_ring_forward_params_t fp{};
  fp.struct_size = sizeof(fp);
  fp.q = test::describe(q, {B, Sl, Hq, D});
  fp.k = test::describe(k, {B, Sl, Hkv, D});
  fp.v = test::describe(v, {B, Sl, Hkv, Dv});
  fp.o = test::describe(o, {B, Sl, Hq, Dv});
  fp.lse = test::describe(lse, {B, Hq, Sl});
  fp.scale = default_scale(D);
  fp.causal = 1;
  ASSERT_EQ(ringattn_ring_forward(ring, &fp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  ringattn_ring_backward_params_t bp = test::ring_backward_params_of(
      fp, test::describe(g, {B, Sl, Hq, Dv}), test::describe(dq, {B, Sl, Hq, D}),
      test::describe(dk, {B, Sl, Hkv, D}), test::describe(dv, {B, Sl, Hkv, Dv}));
  ASSERT_EQ(ringattn_ring_backward(ring, &bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  // o of d_qk: refused, naming both head dims, with the invalid-argument status.
  std::vector<double> o_qk(B * Sl * Hq * D);
  fp.o = test::describe(o_qk, {B, Sl, Hq, D});
  EXPECT_EQ(ringattn_ring_forward(ring, &fp, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error())
                .find("RingAttention::forward: o has head_dim 12 (shape [2, 12, 4, 12]); expected "
                      "20, the head_dim of v (q and k have head_dim 12)"),
            std::string::npos)
      << ringattn_last_error();
  EXPECT_EQ(ringattn_ring_destroy(ring), RINGATTN_SUCCESS);

  auto view = [](std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.data(), DType::f64, shape);
  };
  std::vector<double> o2(o.size()), lse2(lse.size()), dq2(dq.size()), dk2(dk.size()),
      dv2(dv.size());
  RingAttention cpp(mpi_world_communicator(), SequenceLayoutKind::zigzag);
  cpp.forward({view(q, {B, Sl, Hq, D}), view(k, {B, Sl, Hkv, D}), view(v, {B, Sl, Hkv, Dv}),
               view(o2, {B, Sl, Hq, Dv}), view(lse2, {B, Hq, Sl}), fp.scale, true, nullptr, {}});
  cpp.backward({view(q, {B, Sl, Hq, D}), view(k, {B, Sl, Hkv, D}), view(v, {B, Sl, Hkv, Dv}),
                view(o2, {B, Sl, Hq, Dv}), view(lse2, {B, Hq, Sl}), view(g, {B, Sl, Hq, Dv}),
                view(dq2, {B, Sl, Hq, D}), view(dk2, {B, Sl, Hkv, D}), view(dv2, {B, Sl, Hkv, Dv}),
                fp.scale, true, false, nullptr, {}});
  EXPECT_EQ(o, o2);
  EXPECT_EQ(lse, lse2);
  EXPECT_EQ(dq, dq2);
  EXPECT_EQ(dk, dk2);
  EXPECT_EQ(dv, dv2);
}

// One rank with another d_v than the others: every rank throws the same Error naming the
// disagreement, before any transfer (a rank that went on would wait for the others forever).
TEST(MpiRingValueDimsErrors, RanksThatDisagreeOnTheValueHeadDimFailAlike) {
  auto comm = std::shared_ptr<Communicator>(MpiCommunicator::world());
  const int ranks = comm->size(), rank = comm->rank();
  if (ranks == 1) GTEST_SKIP() << "needs two ranks to disagree";
  const int odd = ranks - 1;
  const std::int64_t B = 1, Sl = 8, H = 2, D = 16, Dv = rank == odd ? 12 : 8;
  HostTensor<double> q({B, Sl, H, D}, 0.5), k({B, Sl, H, D}, 0.25), v({B, Sl, H, Dv}, 1.0),
      o({B, Sl, H, Dv}), lse({B, H, Sl});
  RingAttention ring(comm, SequenceLayoutKind::zigzag);
  std::string message = "(no error)";
  try {
    ring.forward({q.view, k.view, v.view, o.view, lse.view, 0.25, true, nullptr, {}});
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("RingAttention::forward: the ranks disagree"), std::string::npos)
      << message;
  for (const std::string& part : {"rank " + std::to_string(odd) + " has v [1, 8, 2, 12] f64",
                                 std::string("v [1, 8, 2, 8] f64")}) {
    EXPECT_NE(message.find(part), std::string::npos) << message;
  }
  const std::vector<std::string> all = all_gather_text(*comm, message);
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(all[r], all[0]) << "rank " << r;
}

}  // namespace
}  // namespace ringattn
