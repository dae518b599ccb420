// The C API's ring made from an NCCL unique id (ringattn_nccl_unique_id, ringattn_ring_create_nccl),
// as a torch.distributed caller makes it: this test hands the id to the ranks itself (one MPI
// broadcast; the ring makes no MPI call). Alone it is one rank (the ctest
// parallel.c_api_ring_nccl_id); under mpiexec -n 2 on two GPUs (parallel.c_api_ring_nccl_id.np2,
// skipped with fewer) the exchanges and the ranks' agreement go through NCCL.
//   - Forward and deterministic backward, causal with a window and packed documents, bf16 device
//     shards: bitwise the ring over MPI_COMM_WORLD (ringattn_ring_create, RINGATTN_DEVICE) on the
//     same shards, whose results the ring tests check against the fp64 oracle.
//   - A shape that differs between ranks fails on every rank with the same message naming the rank
//     and the shape (one rank: a k shorter than q fails with its message); the ring stays usable.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ringattn/config.h"
#include "ringattn/ringattn.h"
#include "tests/common/bf16_testing.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/gpu.hpp"
#include "tests/common/mpi_environment.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::describe_device_at;
using test::ring_backward_params_of;
using test::world_rank;
using test::world_size;

#if RINGATTN_WITH_CUDA

constexpr std::int64_t kBatch = 1, kTokens = 384, kHeads = 4, kKvHeads = 2, kHeadDim = 64;

// A ring of every rank made from one id: rank 0 makes it, MPI carries it (the caller's own
// channel). Null, with a failure recorded, when the id or the ring cannot be made.
ringattn_ring_t ring_from_shared_id(int32_t layout) {
  std::vector<unsigned char> id(RINGATTN_NCCL_UNIQUE_ID_BYTES);
  if (world_rank() == 0) {
    EXPECT_EQ(ringattn_nccl_unique_id(id.data(), id.size()), RINGATTN_SUCCESS) << ringattn_last_error();
  }
  MPI_Bcast(id.data(), static_cast<int>(id.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  ringattn_ring_t ring = nullptr;
  EXPECT_EQ(ringattn_ring_create_nccl(id.data(), id.size(), world_rank(), world_size(), layout, &ring),
            RINGATTN_SUCCESS)
      << ringattn_last_error();
  return ring;
}

// This rank's shards and outputs on its GPU.
struct Shards {
  cudaStream_t stream = nullptr;
  DeviceBuffer q, k, v, dout, starts;
  DeviceBuffer o{kBatch * kTokens * kHeads * kHeadDim * 2}, lse{kBatch * kHeads * kTokens * 4};
  DeviceBuffer dq{kBatch * kTokens * kHeads * kHeadDim * 4};
  DeviceBuffer dk{kBatch * kTokens * kKvHeads * kHeadDim * 4}, dv{kBatch * kTokens * kKvHeads * kHeadDim * 4};
  std::int64_t documents = 0;

  Shards() {
    std::mt19937_64 rng = test::make_rng(300 + static_cast<unsigned>(world_rank()));
    q = test::to_device(test::random_bf16(kBatch * kTokens * kHeads * kHeadDim, rng), stream);
    k = test::to_device(test::random_bf16(kBatch * kTokens * kKvHeads * kHeadDim, rng, 2.0), stream);
    v = test::to_device(test::random_bf16(kBatch * kTokens * kKvHeads * kHeadDim, rng), stream);
    dout = test::to_device(test::random_bf16(kBatch * kTokens * kHeads * kHeadDim, rng), stream);
    // Documents of the whole sequence (every rank the same): a length of 1, one over half the
    // sequence (longer than a shard on two ranks), and the rest in pieces of 97.
    const std::int64_t whole = kTokens * world_size();
    std::vector<std::int64_t> begin = {0, 1, 1 + whole / 2 + 7};
    for (std::int64_t s = begin.back() + 97; s < whole; s += 97) begin.push_back(s);
    documents = static_cast<std::int64_t>(begin.size());
    starts = test::to_device(begin, stream);
  }

  ringattn_ring_forward_params_t forward() {
    ringattn_ring_forward_params_t p{};
    p.struct_size = sizeof(p);
    p.q = describe_device_at(q.data(), RINGATTN_BF16, {kBatch, kTokens, kHeads, kHeadDim});
    p.k = describe_device_at(k.data(), RINGATTN_BF16, {kBatch, kTokens, kKvHeads, kHeadDim});
    p.v = describe_device_at(v.data(), RINGATTN_BF16, {kBatch, kTokens, kKvHeads, kHeadDim});
    p.o = describe_device_at(o.data(), RINGATTN_BF16, {kBatch, kTokens, kHeads, kHeadDim});
    p.lse = describe_device_at(lse.data(), RINGATTN_F32, {kBatch, kHeads, kTokens});
    p.scale = 0.125;
    p.causal = 1;
    p.window_left = 300;
    p.document_starts = starts.as<std::int64_t>();
    p.num_documents = documents;
    return p;
  }

  ringattn_ring_backward_params_t backward(const ringattn_ring_forward_params_t& f) {
    ringattn_ring_backward_params_t p = ring_backward_params_of(
        f, describe_device_at(dout.data(), RINGATTN_BF16, {kBatch, kTokens, kHeads, kHeadDim}),
        describe_device_at(dq.data(), RINGATTN_F32, {kBatch, kTokens, kHeads, kHeadDim}),
        describe_device_at(dk.data(), RINGATTN_F32, {kBatch, kTokens, kKvHeads, kHeadDim}),
        describe_device_at(dv.data(), RINGATTN_F32, {kBatch, kTokens, kKvHeads, kHeadDim}));
    p.deterministic = 1;
    return p;
  }

  struct Results {
    std::vector<std::uint16_t> o;
    std::vector<float> lse, dq, dk, dv;
  };
  Results run(ringattn_ring_t ring) {
    const ringattn_ring_forward_params_t f = forward();
    EXPECT_EQ(ringattn_ring_forward(ring, &f, stream), RINGATTN_SUCCESS) << ringattn_last_error();
    const ringattn_ring_backward_params_t b = backward(f);
    EXPECT_EQ(ringattn_ring_backward(ring, &b, stream), RINGATTN_SUCCESS) << ringattn_last_error();
    Results r;
    r.o = test::download<std::uint16_t>(o.data(), kBatch * kTokens * kHeads * kHeadDim, stream);
    r.lse = test::download<float>(lse.data(), kBatch * kHeads * kTokens, stream);
    r.dq = test::download<float>(dq.data(), kBatch * kTokens * kHeads * kHeadDim, stream);
    r.dk = test::download<float>(dk.data(), kBatch * kTokens * kKvHeads * kHeadDim, stream);
    r.dv = test::download<float>(dv.data(), kBatch * kTokens * kKvHeads * kHeadDim, stream);
    return r;
  }
};

class RingFromNcclId : public ::testing::Test {
 protected:
  void SetUp() override {
    RINGATTN_REQUIRE_GPUS(world_size());
    // The caller picks each rank's GPU (as torch.cuda.set_device does); the ring over MPI picks
    // the node-local rank's, the same one here.
    ASSERT_EQ(cudaSetDevice(world_rank()), cudaSuccess);
  }
};

TEST_F(RingFromNcclId, EqualsTheRingOverMpi) {
  SCOPED_TRACE(test::seed_trace());
  Shards shards;
  ringattn_ring_t from_id = ring_from_shared_id(RINGATTN_ZIGZAG);
  ASSERT_NE(from_id, nullptr);
  const Shards::Results got = shards.run(from_id);
  EXPECT_EQ(ringattn_ring_destroy(from_id), RINGATTN_SUCCESS);

  const MPI_Comm world = MPI_COMM_WORLD;
  ringattn_ring_t over_mpi = nullptr;
  ASSERT_EQ(ringattn_ring_create(&world, RINGATTN_DEVICE, RINGATTN_ZIGZAG, &over_mpi), RINGATTN_SUCCESS)
      << ringattn_last_error();
  const Shards::Results want = shards.run(over_mpi);
  EXPECT_EQ(ringattn_ring_destroy(over_mpi), RINGATTN_SUCCESS);

  EXPECT_EQ(got.o, want.o);
  EXPECT_TRUE(test::BitwiseEqual("lse", got.lse, want.lse));
  EXPECT_TRUE(test::BitwiseEqual("dq", got.dq, want.dq));
  EXPECT_TRUE(test::BitwiseEqual("dk", got.dk, want.dk));
  EXPECT_TRUE(test::BitwiseEqual("dv", got.dv, want.dv));
  // Not a vacuous equality: most of O is not zero.
  std::size_t nonzero = 0;
  for (std::uint16_t bits : got.o) nonzero += (bits & 0x7fff) != 0;
  EXPECT_GT(nonzero, got.o.size() / 2);
}

TEST_F(RingFromNcclId, ShapeThatDiffersFailsOnEveryRank) {
  Shards shards;
  ringattn_ring_t ring = ring_from_shared_id(RINGATTN_CONTIGUOUS);
  ASSERT_NE(ring, nullptr);
  ringattn_ring_forward_params_t p = shards.forward();
  p.document_starts = nullptr;
  p.num_documents = 0;
  const bool odd_one = world_size() == 1 || world_rank() == 1;
  if (odd_one) p.k.shape[1] = p.v.shape[1] = kTokens - 2;  // a shorter K/V shard on one rank
  EXPECT_EQ(ringattn_ring_forward(ring, &p, shards.stream), RINGATTN_ERROR_INVALID_ARGUMENT);
  const std::string message = ringattn_last_error();
  EXPECT_NE(message.find("RingAttention::forward"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(kTokens - 2)), std::string::npos) << message;
  if (world_size() > 1) {
    EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
  }
  // The same message on every rank.
  const int length = static_cast<int>(message.size());
  int longest = 0;
  MPI_Allreduce(&length, &longest, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  std::vector<char> mine(static_cast<std::size_t>(longest), '\0'), rank0(mine.size());
  std::copy(message.begin(), message.end(), mine.begin());
  rank0 = mine;
  MPI_Bcast(rank0.data(), longest, MPI_CHAR, 0, MPI_COMM_WORLD);
  EXPECT_EQ(mine, rank0);
  // Then a good call on the same ring succeeds.
  const ringattn_ring_forward_params_t good = shards.forward();
  EXPECT_EQ(ringattn_ring_forward(ring, &good, shards.stream), RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_EQ(ringattn_ring_destroy(ring), RINGATTN_SUCCESS);
}

#else

TEST(RingFromNcclId, IsUnsupportedWithoutCuda) {
  std::vector<unsigned char> id(RINGATTN_NCCL_UNIQUE_ID_BYTES);
  EXPECT_EQ(ringattn_nccl_unique_id(id.data(), id.size()), RINGATTN_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(ringattn_last_error()).find("built with CUDA"), std::string::npos);
}

#endif

}  // namespace
}  // namespace ringattn
