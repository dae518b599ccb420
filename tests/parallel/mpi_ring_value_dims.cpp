// ringattn-mpi-ranks: 1 2 3 4
// Ring attention on CPU ranks with a value head dim d_v of its own (V, O, dO, dV [.., d_v]; Q, K,
// dQ, dK [.., d_qk]): K and V shards of different widths travel together, and so do their dK|dV
// accumulators. Against the fp64 oracle on the whole sequence, with TESTING.md's ring criterion:
//   f64 inputs: relative error under 1e-12;
//   f32 inputs: relative error under 1e-5, and at most 1.1x the error of the CPU block on the whole
//               problem in one process for O, dQ, dK and dV; the LSE gets sqrt(N - 1) * u / 4 on
//               top (its running value is rounded to fp32 at each merge: the reasoning is in
//               tests/parallel/mpi_ring_attention.cpp).
// Both layouts, causal and not, GQA, batch 2, multi-head latent attention's 192/128 and a d_v
// above d_qk; the C API's ring on such shards (bitwise the C++ ring); and ranks that disagree on
// d_v failing alike on every rank.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
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

namespace ringattn {
namespace {

using test::HostTensor;

// fp32's unit roundoff 2^-24.
constexpr double kUnitRoundoff = 0x1p-24;

struct Outputs {
  std::vector<double> o, lse, dq, dk, dv;
};

constexpr const char* kNames[] = {"O", "LSE", "dQ", "dK", "dV"};
std::vector<double> Outputs::*const kFields[] = {&Outputs::o, &Outputs::lse, &Outputs::dq,
                                                 &Outputs::dk, &Outputs::dv};

// The whole problem, the same on every rank (the shared seed).
template <typename T>
struct Problem {
  AttentionShape s;
  bool causal;
  double scale;
  HostTensor<T> q, k, v, dout;

  Problem(const AttentionShape& shape, bool causal_mask, std::mt19937_64& rng)
      : s(shape),
        causal(causal_mask),
        scale(default_scale(shape.head_dim)),
        q({s.batch, s.q_len, s.q_heads, s.head_dim}),
        k({s.batch, s.k_len, s.kv_heads, s.head_dim}),
        v({s.batch, s.k_len, s.kv_heads, s.v_head_dim}),
        dout({s.batch, s.q_len, s.q_heads, s.v_head_dim}) {
    for (HostTensor<T>* t : {&q, &k, &v, &dout}) test::fill_normal(t->storage, rng);
  }

  Outputs oracle() const {
    HostTensor<double> o({s.batch, s.q_len, s.q_heads, s.v_head_dim}),
        lse({s.batch, s.q_heads, s.q_len}), dq({s.batch, s.q_len, s.q_heads, s.head_dim}),
        dk({s.batch, s.k_len, s.kv_heads, s.head_dim}),
        dv({s.batch, s.k_len, s.kv_heads, s.v_head_dim});
    const Mask mask{causal, 0, 0};
    reference::attention_forward(q.view, k.view, v.view, mask, scale, o.view, lse.view);
    reference::attention_backward(q.view, k.view, v.view, dout.view, mask, scale, dq.view, dk.view,
                                  dv.view);
    return {o.values(), lse.values(), dq.values(), dk.values(), dv.values()};
  }

  // The CPU block on the whole problem in this process.
  Outputs one_process() const {
    HostTensor<T> o({s.batch, s.q_len, s.q_heads, s.v_head_dim}),
        lse({s.batch, s.q_heads, s.q_len}), delta({s.batch, s.q_heads, s.q_len});
    HostTensor<T> dq({s.batch, s.q_len, s.q_heads, s.head_dim}, T(0)),
        dk({s.batch, s.k_len, s.kv_heads, s.head_dim}, T(0)),
        dv({s.batch, s.k_len, s.kv_heads, s.v_head_dim}, T(0));
    const Mask mask{causal, 0, 0};
    cpu::flash_forward({q.view, k.view, v.view, o.view, lse.view, scale, mask, false});
    cpu::flash_backward_prepare(o.view, dout.view, delta.view);
    cpu::flash_backward({q.view, k.view, v.view, dout.view, lse.view, delta.view, dq.view, dk.view,
                         dv.view, scale, mask, false});
    return {o.values(), lse.values(), dq.values(), dk.values(), dv.values()};
  }
};

// Rank 0's outputs on every rank (the oracle and the one-process run are computed once).
Outputs broadcast_from_rank0(const Outputs& mine, const AttentionShape& s) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::int64_t counts[] = {s.batch * s.q_len * s.q_heads * s.v_head_dim,
                                 s.batch * s.q_heads * s.q_len,
                                 s.batch * s.q_len * s.q_heads * s.head_dim,
                                 s.batch * s.k_len * s.kv_heads * s.head_dim,
                                 s.batch * s.k_len * s.kv_heads * s.v_head_dim};
  Outputs out = rank == 0 ? mine : Outputs{};
  for (int i = 0; i < 5; ++i) {
    std::vector<double>& values = out.*kFields[i];
    values.resize(static_cast<std::size_t>(counts[i]));
    EXPECT_EQ(MPI_Bcast(values.data(), static_cast<int>(counts[i]), MPI_DOUBLE, 0, MPI_COMM_WORLD),
              MPI_SUCCESS);
  }
  return out;
}

// Every rank's shard of a contiguous local tensor, gathered and unsharded into the whole tensor.
template <typename T>
std::vector<double> gather_whole(const HostTensor<T>& local, SequenceLayoutKind kind,
                                 const Communicator& comm,
                                 std::initializer_list<std::int64_t> full_shape) {
  const std::size_t count = local.storage.size();
  std::vector<T> all(count * static_cast<std::size_t>(comm.size()));
  comm.host_all_gather(local.storage.data(), count * sizeof(T), all.data());
  HostTensor<T> full(full_shape);
  const std::int64_t total = local.view.rank == 4 ? full.view.shape[1] : full.view.shape[2];
  for (int p = 0; p < comm.size(); ++p) {
    TensorView shard = local.view;
    shard.data = all.data() + p * count;
    SequenceLayout(kind, comm.size(), p, total).unshard(shard, full.view);
  }
  return full.values();
}

// The ring forward and backward on this rank's shards; the whole outputs, gathered. Zigzag shards
// of Q, K and V are strided views of one packed [B, Sl, Hq D + Hkv D + Hkv Dv] buffer.
template <typename T>
Outputs run_ring(RingAttention& ring, const Communicator& comm, const Problem<T>& problem) {
  const AttentionShape& s = problem.s;
  const std::int64_t local = s.q_len / comm.size();
  AttentionShape ls = s;
  ls.q_len = ls.k_len = local;
  const test::Layout memory_layout =
      ring.layout() == SequenceLayoutKind::zigzag ? test::Layout::packed : test::Layout::contiguous;
  test::QkvBuffers<T> qkv(ls, memory_layout, std::numeric_limits<T>::quiet_NaN());
  HostTensor<T> dout({s.batch, local, s.q_heads, s.v_head_dim});
  ring.shard(problem.q.view, qkv.q);
  ring.shard(problem.k.view, qkv.k);
  ring.shard(problem.v.view, qkv.v);
  ring.shard(problem.dout.view, dout.view);

  HostTensor<T> o({s.batch, local, s.q_heads, s.v_head_dim}), lse({s.batch, s.q_heads, local});
  HostTensor<T> dq({s.batch, local, s.q_heads, s.head_dim});
  HostTensor<T> dk({s.batch, local, s.kv_heads, s.head_dim}),
      dv({s.batch, local, s.kv_heads, s.v_head_dim});
  ring.forward({qkv.q, qkv.k, qkv.v, o.view, lse.view, problem.scale, problem.causal, nullptr, {}});
  ring.backward({qkv.q, qkv.k, qkv.v, o.view, lse.view, dout.view, dq.view, dk.view, dv.view,
                 problem.scale, problem.causal, false, nullptr, {}});

  const SequenceLayoutKind kind = ring.layout();
  return {gather_whole(o, kind, comm, {s.batch, s.q_len, s.q_heads, s.v_head_dim}),
          gather_whole(lse, kind, comm, {s.batch, s.q_heads, s.q_len}),
          gather_whole(dq, kind, comm, {s.batch, s.q_len, s.q_heads, s.head_dim}),
          gather_whole(dk, kind, comm, {s.batch, s.k_len, s.kv_heads, s.head_dim}),
          gather_whole(dv, kind, comm, {s.batch, s.k_len, s.kv_heads, s.v_head_dim})};
}

enum class Precision { f64, f32 };

struct Case {
  const char* name;
  AttentionShape s;  // S a multiple of 2N for N = 1, 2, 3, 4
  Precision precision;
  bool causal;
};

void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

class MpiRingValueDims : public testing::TestWithParam<Case> {};

template <typename T>
void check_against_oracle(const Case& c) {
  auto comm = std::shared_ptr<Communicator>(MpiCommunicator::world());
  const int ranks = comm->size();
  std::mt19937_64 rng = test::make_rng(c.causal ? 71 : 70);
  const Problem<T> problem(c.s, c.causal, rng);
  const bool root = comm->rank() == 0;
  const Outputs oracle = broadcast_from_rank0(root ? problem.oracle() : Outputs{}, problem.s);
  const Outputs single =
      std::is_same_v<T, float>
          ? broadcast_from_rank0(root ? problem.one_process() : Outputs{}, problem.s)
          : Outputs{};

  for (SequenceLayoutKind kind : {SequenceLayoutKind::contiguous, SequenceLayoutKind::zigzag}) {
    SCOPED_TRACE(std::string(sequence_layout_name(kind)) + " layout over " + std::to_string(ranks) +
                 " ranks");
    RingAttention ring(comm, kind);
    const Outputs out = run_ring(ring, *comm, problem);
    for (int i = 0; i < 5; ++i) {
      const std::vector<double>& got = out.*kFields[i];
      const std::vector<double>& ref = oracle.*kFields[i];
      const test::Diff ring_error = test::compare(got, ref);
      if constexpr (std::is_same_v<T, double>) {
        EXPECT_TRUE(test::Close(kNames[i], got, ref, 1e-12));
        if (root) {
          std::printf("[ ringattn ] %s %-10s N=%d %-3s ring %.3g\n", c.name,
                      std::string(sequence_layout_name(kind)).c_str(), ranks, kNames[i],
                      ring_error.rel);
        }
      } else {
        EXPECT_TRUE(test::Close(kNames[i], got, ref, 1e-5));
        const test::Diff single_error = test::compare(single.*kFields[i], ref);
        const bool lse = i == 1;
        const double allowance = lse ? std::sqrt(ranks - 1.0) * kUnitRoundoff / 4 : 0.0;
        const double bound = 1.1 * single_error.rel + allowance;
        EXPECT_LE(ring_error.rel, bound)
            << kNames[i] << ": the ring's error against the oracle (" << test::describe(ring_error)
            << ") exceeds " << bound << " = 1.1x the error of one process ("
            << test::describe(single_error) << ")" << (lse ? " + sqrt(N - 1) * u / 4" : "")
            << " [" << test::seed_trace() << "]";
        if (root) {
          std::printf("[ ringattn ] %s %-10s N=%d %-3s ring %.3g one process %.3g ratio %.3f\n",
                      c.name, std::string(sequence_layout_name(kind)).c_str(), ranks, kNames[i],
                      ring_error.rel, single_error.rel, ring_error.rel / single_error.rel);
        }
      }
    }
  }
}

TEST_P(MpiRingValueDims, MatchesOracleOnWholeSequence) {
  SCOPED_TRACE(test::seed_trace());
  if (GetParam().precision == Precision::f64) {
    check_against_oracle<double>(GetParam());
  } else {
    check_against_oracle<float>(GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MpiRingValueDims,
    testing::Values(Case{"Mla192x128_f64_causal", {2, 96, 96, 4, 2, 192, 128}, Precision::f64,
                         true},
                    Case{"Mla192x128_f32_causal", {2, 96, 96, 4, 2, 192, 128}, Precision::f32,
                         true},
                    Case{"D24Dv40_f64_full", {2, 192, 192, 4, 1, 24, 40}, Precision::f64, false},
                    Case{"D24Dv40_f32_full", {2, 192, 192, 4, 1, 24, 40}, Precision::f32, false},
                    Case{"D40Dv24_f32_causal", {1, 384, 384, 4, 2, 40, 24}, Precision::f32, true}),
    [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

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
  ringattn_ring_backward_params_t bp{};
  bp.struct_size = sizeof(bp);
  bp.q = fp.q;
  bp.k = fp.k;
  bp.v = fp.v;
  bp.o = fp.o;
  bp.lse = fp.lse;
  bp.dout = test::describe(g, {B, Sl, Hq, Dv});
  bp.dq = test::describe(dq, {B, Sl, Hq, D});
  bp.dk = test::describe(dk, {B, Sl, Hkv, D});
  bp.dv = test::describe(dv, {B, Sl, Hkv, Dv});
  bp.scale = fp.scale;
  bp.causal = 1;
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
