// A finished ring call leaves no hold on the memory it used: the ring's own workspace and the
// scratch lent to its calls go back to the GPU when freed, however many rings ran before. Under
// mpiexec -n 2 on two GPUs (the ctest parallel.ring_memory.np2, RINGATTN_EXCHANGE=copy) each rank
// writes into its neighbour's receive buffers through CUDA IPC mappings, which must be closed
// before the call returns (a mapping kept open holds the neighbour's freed memory); alone, the
// ring is one rank over NCCL. The reference is the GPU's free memory before the rings ran
// (cudaMemGetInfo, after one ring of the same shape has warmed the libraries up), allowing 16 MiB;
// a ring's workspace is 192 MiB at its largest. The outputs of every ring, with and without scratch, are
// bitwise those of the first (the forward and the deterministic backward are reproducible).
// Persistent scratch keeps its mappings between calls until release_scratch, and then goes back
// the same way. MPI (tests/common/mpi_environment.hpp, singleton mode when run alone) bootstraps
// NCCL.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/device_communicator.hpp"
#include "ringattn/config.h"
#include "ringattn/ring.hpp"
#include "tests/common/gpu.hpp"
#include "tests/common/mpi_environment.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/device_buffer.hpp"
#endif

namespace ringattn {
namespace {

using test::world_size;

#if RINGATTN_WITH_CUDA

// One rank's shard: 8192 tokens, 8 heads of 128 (K/V too), bf16. The ring's workspace on two
// ranks: forward K|V twice (32 MiB each) and the fp32 running output (32 MiB); backward K|V twice
// and the travelling fp32 dK|dV twice (64 MiB each): 192 MiB, all of it in the 320 MiB lent.
constexpr std::int64_t kTokens = 8192, kHeads = 8, kHeadDim = 128;
constexpr std::size_t kElements = kTokens * kHeads * kHeadDim;
constexpr std::size_t kSlackBytes = std::size_t{16} << 20;

struct Problem {
  DeviceBuffer q{kElements * 2}, k{kElements * 2}, v{kElements * 2}, dout{kElements * 2};
  DeviceBuffer o{kElements * 2}, lse{kTokens * kHeads * 4};
  DeviceBuffer dq{kElements * 4}, dk{kElements * 4}, dv{kElements * 4};  // f32 gradients

  explicit Problem(int rank) {
    std::mt19937 rng(1234 + static_cast<unsigned>(rank));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::uint16_t> host(kElements);
    for (DeviceBuffer* b : {&q, &k, &v, &dout}) {
      for (std::uint16_t& x : host) {
        const float value = normal(rng);
        std::uint32_t bits = 0;
        std::memcpy(&bits, &value, sizeof bits);
        x = static_cast<std::uint16_t>(bits >> 16);  // bf16 by truncation
      }
      RINGATTN_CUDA_CHECK(cudaMemcpy(b->data(), host.data(), b->bytes(), cudaMemcpyHostToDevice));
    }
  }
  TensorView view(const DeviceBuffer& b, DType dtype = DType::bf16) const {
    return TensorView::contiguous(b.data(), dtype, {1, kTokens, kHeads, kHeadDim}, Memory::device);
  }
  TensorView lse_view() const {
    return TensorView::contiguous(lse.data(), DType::f32, {1, kHeads, kTokens}, Memory::device);
  }
};

// The outputs of one ring, as bytes.
struct Outputs {
  std::vector<unsigned char> o, dq, dk, dv;
};

std::vector<unsigned char> download(const DeviceBuffer& b) {
  std::vector<unsigned char> bytes(b.bytes());
  RINGATTN_CUDA_CHECK(cudaMemcpy(bytes.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost));
  return bytes;
}

// A fresh ring's forward and backward, its workspace in its own buffers or in a lent scratch
// buffer; the ring and the scratch are freed before this returns.
Outputs run_ring(const std::shared_ptr<Communicator>& comm, Problem& p, bool lend_scratch) {
  RingAttention ring(comm, SequenceLayoutKind::zigzag);
  DeviceBuffer scratch(lend_scratch ? std::size_t{320} << 20 : 0);
  std::vector<ScratchRegion> regions;
  if (lend_scratch) regions.push_back({scratch.data(), scratch.bytes()});
  const double scale = 0.08838834764831845;  // 1 / sqrt(128)
  ring.forward({p.view(p.q), p.view(p.k), p.view(p.v), p.view(p.o), p.lse_view(), scale, true,
                nullptr, regions});
  ring.backward({p.view(p.q), p.view(p.k), p.view(p.v), p.view(p.o), p.lse_view(), p.view(p.dout),
                 p.view(p.dq, DType::f32), p.view(p.dk, DType::f32), p.view(p.dv, DType::f32), scale,
                 true, true, nullptr, regions});
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  if (lend_scratch) {
    EXPECT_EQ(ring.owned_workspace_bytes(), 0u) << "the scratch holds all of the workspace";
  }
  return {download(p.o), download(p.dq), download(p.dk), download(p.dv)};
}

std::size_t free_device_bytes(Communicator& comm) {
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  comm.barrier();  // every rank's rings are gone, and with them its mappings of this rank
  std::size_t free = 0, total = 0;
  RINGATTN_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

// NCCL over every rank, or over this one alone; and how a failure names it.
std::shared_ptr<Communicator> test_communicator() {
  return world_size() == 1 ? nccl_communicator_over(MPI_COMM_SELF) : nccl_world_communicator();
}
std::string describe(const Communicator& comm) {
  return "rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
         ", exchanges by " + comm.transport();
}

// Each test starts from the communicator, this rank's problem, a first ring's outputs (that ring
// also loads kernels and libraries) and the free device memory after it.
class RingMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    RINGATTN_REQUIRE_GPUS(world_size());
    comm = test_communicator();
    problem.emplace(comm->rank());
    first = run_ring(comm, *problem, false);
    before = free_device_bytes(*comm);
  }

  std::shared_ptr<Communicator> comm;
  std::optional<Problem> problem;
  Outputs first;
  std::size_t before = 0;
};

void expect_memory_back(std::size_t before, std::size_t after, const char* what) {
  EXPECT_GE(after + kSlackBytes, before)
      << "free device memory went from " << (before >> 20) << " MiB before " << what << " to "
      << (after >> 20) << " MiB after";
}

TEST_F(RingMemory, FreedRingBuffersGoBackToTheGpu) {
  SCOPED_TRACE(describe(*comm));
  Problem& p = *problem;

  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("ring " + std::to_string(round + 2) + (round % 2 ? ", scratch" : ", own buffers"));
    const Outputs again = run_ring(comm, p, round % 2 == 1);
    EXPECT_TRUE(again.o == first.o && again.dq == first.dq && again.dk == first.dk &&
                again.dv == first.dv)
        << "the outputs differ from the first ring's";
  }
  expect_memory_back(before, free_device_bytes(*comm), "the rings");
}

// Persistent scratch: one ring and one scratch buffer over three calls (the previous rank keeps
// its mapping of the buffer between them, where the copy engines carry the exchanges), outputs
// bitwise the first ring's; after release_scratch, freeing the scratch gives its memory back.
TEST_F(RingMemory, PersistentScratchGoesBackAfterRelease) {
  SCOPED_TRACE(describe(*comm));
  Problem& p = *problem;
  {
    RingAttention ring(comm, SequenceLayoutKind::zigzag);
    DeviceBuffer scratch(std::size_t{320} << 20);
    const std::vector<ScratchRegion> regions{{scratch.data(), scratch.bytes(), true}};
    const double scale = 0.08838834764831845;  // 1 / sqrt(128)
    for (int call = 0; call < 3; ++call) {
      SCOPED_TRACE("call " + std::to_string(call + 1) + " with the same persistent scratch");
      RINGATTN_CUDA_CHECK(cudaMemset(p.o.data(), 0xff, p.o.bytes()));
      RINGATTN_CUDA_CHECK(cudaMemset(p.dk.data(), 0xff, p.dk.bytes()));
      ring.forward({p.view(p.q), p.view(p.k), p.view(p.v), p.view(p.o), p.lse_view(), scale, true,
                    nullptr, regions});
      ring.backward({p.view(p.q), p.view(p.k), p.view(p.v), p.view(p.o), p.lse_view(),
                     p.view(p.dout), p.view(p.dq, DType::f32), p.view(p.dk, DType::f32),
                     p.view(p.dv, DType::f32), scale, true, true, nullptr, regions});
      RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(ring.owned_workspace_bytes(), 0u) << "the scratch holds all of the workspace";
      EXPECT_TRUE(download(p.o) == first.o && download(p.dq) == first.dq &&
                  download(p.dk) == first.dk && download(p.dv) == first.dv)
          << "the outputs differ from the first ring's";
    }
    ring.release_scratch();
  }
  expect_memory_back(before, free_device_bytes(*comm),
                     "the ring (its persistent scratch released and freed)");
}

#else

TEST(RingMemory, FreedRingBuffersGoBackToTheGpu) {
  RINGATTN_REQUIRE_GPUS(world_size());
}
TEST(RingMemory, PersistentScratchGoesBackAfterRelease) {
  RINGATTN_REQUIRE_GPUS(world_size());
}

#endif

}  // namespace
}  // namespace ringattn
