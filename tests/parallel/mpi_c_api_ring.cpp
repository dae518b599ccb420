// ringattn-mpi-ranks: 1 2 3
// The ring through the C API on MPI_COMM_WORLD (host tensors): bitwise the C++ RingAttention on
// the same shards, and its status codes and messages.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>
#include <vector>

#include "ringattn/ring.hpp"
#include "ringattn/ringattn.h"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/random.hpp"

namespace {

using ringattn::test::describe;

TEST(CApiRing, ForwardAndBackwardEqualTheCppRing) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  int size = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::int64_t B = 2, Sl = 16, Hq = 4, Hkv = 2, D = 8;
  std::mt19937_64 rng = ringattn::test::make_rng(100 + rank);
  auto q = ringattn::test::normal_vector<double>(B * Sl * Hq * D, rng);
  auto k = ringattn::test::normal_vector<double>(B * Sl * Hkv * D, rng);
  auto v = ringattn::test::normal_vector<double>(B * Sl * Hkv * D, rng);
  auto g = ringattn::test::normal_vector<double>(B * Sl * Hq * D, rng);
  std::vector<double> o(q.size()), lse(B * Hq * Sl), dq(q.size()), dk(k.size()), dv(v.size());

  ringattn_ring_t ring = nullptr;
  const MPI_Comm world = MPI_COMM_WORLD;
  ASSERT_EQ(ringattn_ring_create(&world, RINGATTN_HOST, RINGATTN_ZIGZAG, &ring), RINGATTN_SUCCESS)
      << ringattn_last_error();
  ringattn_ring_forward_params_t fp{};
  fp.struct_size = sizeof(fp);
  fp.q = describe(q, {B, Sl, Hq, D});
  fp.k = describe(k, {B, Sl, Hkv, D});
  fp.v = describe(v, {B, Sl, Hkv, D});
  fp.o = describe(o, {B, Sl, Hq, D});
  fp.lse = describe(lse, {B, Hq, Sl});
  fp.scale = 0.3;
  fp.causal = 1;
  ASSERT_EQ(ringattn_ring_forward(ring, &fp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  ringattn_ring_backward_params_t bp = ringattn::test::ring_backward_params_of(
      fp, describe(g, {B, Sl, Hq, D}), describe(dq, {B, Sl, Hq, D}), describe(dk, {B, Sl, Hkv, D}),
      describe(dv, {B, Sl, Hkv, D}));
  ASSERT_EQ(ringattn_ring_backward(ring, &bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_EQ(ringattn_ring_destroy(ring), RINGATTN_SUCCESS);

  using ringattn::DType;
  using ringattn::TensorView;
  auto view = [](std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.data(), DType::f64, shape);
  };
  std::vector<double> o2(o.size()), lse2(lse.size()), dq2(dq.size()), dk2(dk.size()), dv2(dv.size());
  ringattn::RingAttention cpp(ringattn::mpi_world_communicator(), ringattn::SequenceLayoutKind::zigzag);
  cpp.forward({view(q, {B, Sl, Hq, D}), view(k, {B, Sl, Hkv, D}), view(v, {B, Sl, Hkv, D}),
               view(o2, {B, Sl, Hq, D}), view(lse2, {B, Hq, Sl}), 0.3, true, nullptr, {}});
  cpp.backward({view(q, {B, Sl, Hq, D}), view(k, {B, Sl, Hkv, D}), view(v, {B, Sl, Hkv, D}),
                view(o2, {B, Sl, Hq, D}), view(lse2, {B, Hq, Sl}), view(g, {B, Sl, Hq, D}),
                view(dq2, {B, Sl, Hq, D}), view(dk2, {B, Sl, Hkv, D}), view(dv2, {B, Sl, Hkv, D}), 0.3, true,
                false, nullptr, {}});
  EXPECT_EQ(o, o2);
  EXPECT_EQ(lse, lse2);
  EXPECT_EQ(dq, dq2);
  EXPECT_EQ(dk, dk2);
  EXPECT_EQ(dv, dv2);
}

TEST(CApiRing, BadCallsReturnAStatusAndAMessage) {
  const MPI_Comm world = MPI_COMM_WORLD;
  ringattn_ring_t ring = nullptr;
  EXPECT_EQ(ringattn_ring_create(nullptr, RINGATTN_HOST, RINGATTN_ZIGZAG, &ring), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("mpi_comm is a null pointer"), std::string::npos);
  EXPECT_EQ(ringattn_ring_create(&world, RINGATTN_HOST, 7, &ring), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("layout is 7"), std::string::npos);
  EXPECT_EQ(ring, nullptr);
  ringattn_ring_forward_params_t fp{};
  fp.struct_size = sizeof(fp);
  EXPECT_EQ(ringattn_ring_forward(nullptr, &fp, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("ring is a null handle"), std::string::npos);
}

}  // namespace
