// ringattn-mpi-ranks: 1 2 3 4
// The window and documents of the C API's ring (the fields appended to the ring's parameter
// structs in 0.4), host tensors over MPI_COMM_WORLD, both layouts: bitwise the C++ RingAttention
// given the same window and documents, and against the fp64 oracle on the whole sequence
// (relative error under 1e-12 in f64 for O, LSE, dQ, dK and dV); a struct of 0.3's size with a
// window and documents in the memory past it gives bitwise the call without them.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/ringattn.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/random.hpp"
#include "tests/common/ring_testing.hpp"

namespace {

using ringattn::DType;
using ringattn::TensorView;
using ringattn::test::describe;

constexpr std::int64_t B = 2, S = 96, Hq = 4, Hkv = 2, D = 8;  // S: a multiple of 2N, N <= 4
constexpr double kScale = 0.3;

TensorView view(std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(d.data(), DType::f64, shape);
}

// A mask of the whole sequence: per-batch lists of starts (a start past S, an empty document in
// row 1) and a window.
struct RingMask {
  bool causal;
  std::int64_t window_left, window_right;
  std::vector<std::int64_t> starts;  // [B, count]
  std::int64_t count;

  ringattn::Mask mask() const {
    ringattn::Mask m{causal, 0, 0, window_left, window_right};
    m.documents = {starts.data(), count, count};
    return m;
  }
};

// This rank's outputs of one ring call.
using Shards = ringattn::test::Outputs;

struct Whole {
  std::vector<double> q, k, v, dout;
};

class CApiRingMasks : public ::testing::TestWithParam<int> {};

TEST_P(CApiRingMasks, EqualTheCppRingAndTheOracle) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  const int layout = GetParam();
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::int64_t Sl = S / size;
  std::mt19937_64 rng = ringattn::test::make_rng(300);  // the same problem on every rank
  Whole whole{ringattn::test::normal_vector<double>(B * S * Hq * D, rng),
              ringattn::test::normal_vector<double>(B * S * Hkv * D, rng),
              ringattn::test::normal_vector<double>(B * S * Hkv * D, rng),
              ringattn::test::normal_vector<double>(B * S * Hq * D, rng)};
  ringattn::RingAttention cpp(ringattn::mpi_world_communicator(),
                              static_cast<ringattn::SequenceLayoutKind>(layout));
  std::vector<double> q(B * Sl * Hq * D), k(B * Sl * Hkv * D), v(k.size()), dout(q.size());
  cpp.shard(view(whole.q, {B, S, Hq, D}), view(q, {B, Sl, Hq, D}));
  cpp.shard(view(whole.k, {B, S, Hkv, D}), view(k, {B, Sl, Hkv, D}));
  cpp.shard(view(whole.v, {B, S, Hkv, D}), view(v, {B, Sl, Hkv, D}));
  cpp.shard(view(whole.dout, {B, S, Hq, D}), view(dout, {B, Sl, Hq, D}));

  ringattn_ring_t ring = nullptr;
  const MPI_Comm world = MPI_COMM_WORLD;
  ASSERT_EQ(ringattn_ring_create(&world, RINGATTN_HOST, layout, &ring), RINGATTN_SUCCESS)
      << ringattn_last_error();

  // The ring through the C API with `mask` at struct sizes forward_size and backward_size.
  auto run_c = [&](const RingMask& m, std::size_t forward_size, std::size_t backward_size) {
    Shards out{std::vector<double>(q.size()), std::vector<double>(B * Hq * Sl),
               std::vector<double>(q.size()), std::vector<double>(k.size()),
               std::vector<double>(v.size())};
    ringattn_ring_forward_params_t fp = ringattn::test::ring_forward_params(
        describe(q, {B, Sl, Hq, D}), describe(k, {B, Sl, Hkv, D}), describe(v, {B, Sl, Hkv, D}),
        describe(out.o, {B, Sl, Hq, D}), describe(out.lse, {B, Hq, Sl}), kScale, m.mask());
    fp.struct_size = forward_size;
    EXPECT_EQ(ringattn_ring_forward(ring, &fp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
    ringattn_ring_backward_params_t bp = ringattn::test::ring_backward_params_of(
        fp, describe(dout, {B, Sl, Hq, D}), describe(out.dq, {B, Sl, Hq, D}),
        describe(out.dk, {B, Sl, Hkv, D}), describe(out.dv, {B, Sl, Hkv, D}));
    bp.struct_size = backward_size;
    EXPECT_EQ(ringattn_ring_backward(ring, &bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
    return out;
  };

  const RingMask masks[] = {
      {true, 20, 0, {0, 30, 31, 70, 0, 48, 48, 200}, 4},
      {false, 13, 25, {0, 12, 60, 95, 5, 47, 49, 96}, 4},
  };
  for (const RingMask& m : masks) {
    SCOPED_TRACE(::testing::Message() << "layout " << layout << ", causal " << m.causal
                                      << ", window " << m.window_left << " " << m.window_right);
    const Shards c = run_c(m, sizeof(ringattn_ring_forward_params_t),
                           sizeof(ringattn_ring_backward_params_t));

    // The C++ ring with the same window and documents: bitwise.
    const ringattn::Mask mask = m.mask();
    const ringattn::AttentionShape shard{B, Sl, Sl, Hq, Hkv, D};
    ringattn::test::OutputTensors<double> cpp_out(shard);
    ringattn::test::run_ring(cpp, view(q, {B, Sl, Hq, D}), view(k, {B, Sl, Hkv, D}),
                             view(v, {B, Sl, Hkv, D}), view(dout, {B, Sl, Hq, D}), cpp_out, kScale,
                             mask);
    const ringattn::test::Outputs cc = cpp_out.values();
    EXPECT_EQ(c.o, cc.o);
    EXPECT_EQ(c.lse, cc.lse);
    EXPECT_EQ(c.dq, cc.dq);
    EXPECT_EQ(c.dk, cc.dk);
    EXPECT_EQ(c.dv, cc.dv);

    // The oracle on the whole sequence, sharded like the ring's outputs.
    ringattn::test::Outputs whole_ref = ringattn::test::oracle_outputs(
        {B, S, S, Hq, Hkv, D}, view(whole.q, {B, S, Hq, D}), view(whole.k, {B, S, Hkv, D}),
        view(whole.v, {B, S, Hkv, D}), view(whole.dout, {B, S, Hq, D}), mask, kScale);
    Shards ref{std::vector<double>(q.size()), std::vector<double>(B * Hq * Sl),
               std::vector<double>(q.size()), std::vector<double>(k.size()),
               std::vector<double>(v.size())};
    cpp.shard(view(whole_ref.o, {B, S, Hq, D}), view(ref.o, {B, Sl, Hq, D}));
    cpp.shard(view(whole_ref.lse, {B, Hq, S}), view(ref.lse, {B, Hq, Sl}));
    cpp.shard(view(whole_ref.dq, {B, S, Hq, D}), view(ref.dq, {B, Sl, Hq, D}));
    cpp.shard(view(whole_ref.dk, {B, S, Hkv, D}), view(ref.dk, {B, Sl, Hkv, D}));
    cpp.shard(view(whole_ref.dv, {B, S, Hkv, D}), view(ref.dv, {B, Sl, Hkv, D}));
    EXPECT_TRUE(ringattn::test::Close("O", c.o, ref.o, 1e-12));
    EXPECT_TRUE(ringattn::test::Close("LSE", c.lse, ref.lse, 1e-12));
    EXPECT_TRUE(ringattn::test::Close("dQ", c.dq, ref.dq, 1e-12));
    EXPECT_TRUE(ringattn::test::Close("dK", c.dk, ref.dk, 1e-12));
    EXPECT_TRUE(ringattn::test::Close("dV", c.dv, ref.dv, 1e-12));
  }

  // 0.3's structs end before the window and documents: those in memory past them are not read.
  const RingMask none{true, 0, 0, {}, 0};
  const Shards plain = run_c(none, sizeof(ringattn_ring_forward_params_t),
                             sizeof(ringattn_ring_backward_params_t));
  const Shards older = run_c(masks[0], offsetof(ringattn_ring_forward_params_t, window_left),
                             offsetof(ringattn_ring_backward_params_t, window_left));
  EXPECT_EQ(older.o, plain.o);
  EXPECT_EQ(older.lse, plain.lse);
  EXPECT_EQ(older.dq, plain.dq);
  EXPECT_EQ(older.dk, plain.dk);
  EXPECT_EQ(older.dv, plain.dv);
  EXPECT_EQ(ringattn_ring_destroy(ring), RINGATTN_SUCCESS);
}

INSTANTIATE_TEST_SUITE_P(Layouts, CApiRingMasks, ::testing::Values(RINGATTN_CONTIGUOUS, RINGATTN_ZIGZAG),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == RINGATTN_ZIGZAG ? "zigzag" : "contiguous");
                         });

// A struct_size past this library's ring struct, or inside a field, is refused on every rank,
// naming the sizes taken.
TEST(CApiRingMasks, OtherStructSizesAreRefused) {
  const MPI_Comm world = MPI_COMM_WORLD;
  ringattn_ring_t ring = nullptr;
  ASSERT_EQ(ringattn_ring_create(&world, RINGATTN_HOST, RINGATTN_ZIGZAG, &ring), RINGATTN_SUCCESS)
      << ringattn_last_error();
  using F = ringattn_ring_forward_params_t;
  using Bw = ringattn_ring_backward_params_t;
  ringattn_ring_forward_params_t fp{};
  fp.struct_size = sizeof(F) + 8;
  EXPECT_EQ(ringattn_ring_forward(ring, &fp, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(ringattn_last_error()),
            "ringattn_ring_forward: params->struct_size is " + std::to_string(sizeof(F) + 8) +
                "; expected sizeof = " + std::to_string(sizeof(F)) +
                " (set it to sizeof(the struct)), or the size of an older version: " +
                std::to_string(offsetof(F, window_left)) + " (0.1 to 0.3)");
  ringattn_ring_backward_params_t bp{};
  bp.struct_size = offsetof(Bw, window_right) + 4;
  EXPECT_EQ(ringattn_ring_backward(ring, &bp, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(ringattn_last_error()),
            "ringattn_ring_backward: params->struct_size is " +
                std::to_string(offsetof(Bw, window_right) + 4) + "; expected sizeof = " +
                std::to_string(sizeof(Bw)) +
                " (set it to sizeof(the struct)), or the size of an older version: " +
                std::to_string(offsetof(Bw, window_left)) + " (0.1 to 0.3)");
  EXPECT_EQ(ringattn_ring_destroy(ring), RINGATTN_SUCCESS);
}

}  // namespace
