// ringattn-mpi-ranks: 1 2 3 4
// A ring on device memory refuses a head dim the CUDA block has no kernels for (16, 48, 80, 160, 320)
// on every rank, with the same message, before its first transfer or any CUDA call: nothing hangs,
// nothing is launched. The ring's checks run on CPU ranks here through a communicator over MPI
// that reports device memory and fails the test if the ring moves data through it; the tensors
// hold addresses that nothing may read. Through the C API on a real device ring (NCCL) where each
// rank has a GPU.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/ringattn.h"
#include "ringattn/runtime.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/head_dims.hpp"

namespace ringattn {
namespace {

using test::built_cuda_head_dims_text;
constexpr const auto& kUnsupportedHeadDims = test::kNoCudaHeadDims;

// MPI underneath, device memory as far as the ring can tell: the ring runs every check of a device
// ring (they are host code), and any data it tried to move would fail the test.
class DeviceMemoryCommunicator final : public Communicator {
 public:
  explicit DeviceMemoryCommunicator(std::shared_ptr<Communicator> host) : host_(std::move(host)) {}
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  Memory memory() const override { return Memory::device; }
  std::string transport() const override { return "MPI, reporting device memory"; }
  void exchange_start(const void*, std::size_t, void*, std::size_t, void*) override { moved(); }
  void exchange_wait(void*) override { moved(); }
  void all_reduce_sum(void*, std::size_t, DType, void*) override { moved(); }
  void barrier() override { host_->barrier(); }
  std::unique_ptr<Communicator> split(int, int) const override { return nullptr; }
  void host_all_gather(const void* send, std::size_t bytes, void* recv) const override {
    host_->host_all_gather(send, bytes, recv);
  }

 private:
  [[noreturn]] static void moved() {
    ADD_FAILURE() << "the ring moved data before its checks refused the call";
    detail::fail("DeviceMemoryCommunicator", "moved data");
  }
  std::shared_ptr<Communicator> host_;
};

// A contiguous device view of `shape` at a made-up, 256-byte aligned address of its own.
TensorView device_view(DType dtype, std::initializer_list<std::int64_t> shape, int index) {
  void* data = reinterpret_cast<void*>(std::uintptr_t{0x7f0000000000} +
                                       (static_cast<std::uintptr_t>(index) << 30));
  return TensorView::contiguous(data, dtype, shape, Memory::device);
}

// One rank's shards: Sl tokens, 4 query heads on 2 K/V heads, batch 2, `dtype` inputs, fp32
// statistics and gradients; V, O, dO and dV of Dv elements a head (0: D).
struct DeviceShards {
  static constexpr std::int64_t B = 2, Sl = 16, Hq = 4, Hkv = 2;
  DType dtype;
  std::int64_t D;
  std::int64_t Dv = 0;

  std::int64_t value_dim() const { return Dv > 0 ? Dv : D; }
  TensorView queries(int index, DType as) const { return device_view(as, {B, Sl, Hq, D}, index); }
  TensorView keys(int index, DType as) const { return device_view(as, {B, Sl, Hkv, D}, index); }
  TensorView outputs(int index, DType as) const {
    return device_view(as, {B, Sl, Hq, value_dim()}, index);
  }
  TensorView values(int index, DType as) const {
    return device_view(as, {B, Sl, Hkv, value_dim()}, index);
  }

  RingForwardArgs forward() const {
    return {queries(0, dtype),
            keys(1, dtype),
            values(2, dtype),
            outputs(3, dtype),
            device_view(DType::f32, {B, Hq, Sl}, 4),
            0.125,
            true,
            nullptr,
            {}};
  }
  RingBackwardArgs backward() const {
    const RingForwardArgs f = forward();
    return {f.q,
            f.k,
            f.v,
            f.o,
            f.lse,
            outputs(5, dtype),
            queries(6, DType::f32),
            keys(7, DType::f32),
            values(8, DType::f32),
            0.125,
            true,
            false,
            nullptr,
            {}};
  }
};

class RingHeadDims : public testing::Test {
 protected:
  void SetUp() override {
    host_ = mpi_world_communicator();
    ranks_ = host_->size();
    rank_ = host_->rank();
    device_ = std::make_shared<DeviceMemoryCommunicator>(host_);
  }

  // The message of what `call` threw (of kind `kind`), checked for every part and to be the same
  // on every rank.
  template <typename F>
  void expect_same_error_everywhere(F&& call, std::initializer_list<std::string> parts,
                                    ErrorKind kind) {
    std::string message = "(no error)";
    try {
      call();
    } catch (const Error& error) {
      message = error.what();
      EXPECT_EQ(error.kind(), kind) << message;
    }
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "the message \"" << message << "\" does not contain \"" << part << "\"";
    }
    const std::vector<std::string> all = all_gather_text(*host_, message);
    for (int r = 0; r < ranks_; ++r) {
      EXPECT_EQ(all[r], all[0]) << "rank " << r << " threw another message than rank 0";
    }
  }

  std::shared_ptr<Communicator> host_, device_;
  int ranks_ = 1, rank_ = 0;
};

std::string refusal(std::int64_t head_dim) {
  return "head_dim " + std::to_string(head_dim) +
         " is not supported; the CUDA block takes " + built_cuda_head_dims_text();
}

TEST_F(RingHeadDims, EveryRankRefusesAnUnsupportedHeadDim) {
  for (const SequenceLayoutKind layout :
       {SequenceLayoutKind::zigzag, SequenceLayoutKind::contiguous}) {
    RingAttention ring(device_, layout);
    for (const DType dtype : {DType::bf16, DType::f16}) {
      for (const std::int64_t head_dim : kUnsupportedHeadDims) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + ", head_dim " + std::to_string(head_dim));
        const DeviceShards shards{dtype, head_dim};
        expect_same_error_everywhere([&] { ring.forward(shards.forward()); },
                                     {"RingAttention::forward: " + refusal(head_dim)},
                                     ErrorKind::unsupported);
        expect_same_error_everywhere([&] { ring.backward(shards.backward()); },
                                     {"RingAttention::backward: " + refusal(head_dim)},
                                     ErrorKind::unsupported);
      }
    }
    EXPECT_EQ(ring.owned_workspace_bytes(), 0u) << "the refused calls allocated a workspace";
  }
}

// A V of its own head dim without kernels (d_v != d_qk other than 192/128, each alone a head dim
// of kernels or not; 128/192 is that pair the other way round): refused on every rank alike,
// naming both head dims, before any transfer.
TEST_F(RingHeadDims, EveryRankRefusesAValueHeadDimOfItsOwn) {
  const std::pair<std::int64_t, std::int64_t> dims[] = {{128, 192}, {128, 64}, {64, 32}};
  for (const SequenceLayoutKind layout :
       {SequenceLayoutKind::zigzag, SequenceLayoutKind::contiguous}) {
    RingAttention ring(device_, layout);
    for (const auto& [d, dv] : dims) {
      SCOPED_TRACE("head_dim " + std::to_string(d) + ", v_head_dim " + std::to_string(dv));
      const DeviceShards shards{DType::bf16, d, dv};
      const std::string named = "v has head_dim " + std::to_string(dv) + " but q and k have " +
                                std::to_string(d) +
                                "; the CUDA block takes one head_dim for q, k and v (" +
                                built_cuda_head_dims_text() + ")";
      expect_same_error_everywhere([&] { ring.forward(shards.forward()); },
                                   {"RingAttention::forward: " + named}, ErrorKind::unsupported);
      expect_same_error_everywhere([&] { ring.backward(shards.backward()); },
                                   {"RingAttention::backward: " + named}, ErrorKind::unsupported);
    }
    EXPECT_EQ(ring.owned_workspace_bytes(), 0u) << "the refused calls allocated a workspace";
  }
}

// One rank with head_dim 80 among ranks with 64: every rank fails alike, naming the disagreement
// (each rank's own check would refuse only on that rank, and the others would wait for it).
TEST_F(RingHeadDims, OneRankWithAnUnsupportedHeadDim) {
  if (ranks_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  const int odd = ranks_ - 1;
  RingAttention ring(device_, SequenceLayoutKind::zigzag);
  const DeviceShards shards{DType::bf16, rank_ == odd ? 80 : 64};
  expect_same_error_everywhere([&] { ring.forward(shards.forward()); },
                               {"RingAttention::forward: the ranks disagree",
                                "rank " + std::to_string(odd) + " has q [2, 16, 4, 80] bf16"},
                               ErrorKind::invalid_argument);
}

// The C API's ring calls on a device ring over NCCL: status RINGATTN_ERROR_UNSUPPORTED and the
// message on every rank. Needs a GPU for each rank of the node (skipped alike on every rank
// otherwise).
TEST_F(RingHeadDims, CApiDeviceRingRefusesAnUnsupportedHeadDim) {
  int devices = cuda_device_count();
  MPI_Allreduce(MPI_IN_PLACE, &devices, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (devices < ranks_) {
    GTEST_SKIP() << "a device ring needs a GPU for each of the " << ranks_ << " ranks; " << devices
                 << " visible";
  }
  const MPI_Comm world = MPI_COMM_WORLD;
  ringattn_ring_t ring = nullptr;
  ASSERT_EQ(ringattn_ring_create(&world, RINGATTN_DEVICE, RINGATTN_ZIGZAG, &ring), RINGATTN_SUCCESS)
      << ringattn_last_error();
  const auto describe = [](const TensorView& t) {
    ringattn_tensor_t d{};
    d.data = t.data;
    d.dtype = t.dtype == DType::bf16  ? RINGATTN_BF16
              : t.dtype == DType::f16 ? RINGATTN_F16
                                      : RINGATTN_F32;
    d.memory = RINGATTN_DEVICE;
    d.rank = t.rank;
    for (int i = 0; i < t.rank; ++i) {
      d.shape[i] = t.shape[i];
      d.strides[i] = t.strides[i];
    }
    return d;
  };
  for (const std::int64_t head_dim : kUnsupportedHeadDims) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    const DeviceShards shards{DType::bf16, head_dim};
    const RingBackwardArgs b = shards.backward();
    ringattn_ring_forward_params_t fp{};
    fp.struct_size = sizeof(fp);
    fp.q = describe(b.q);
    fp.k = describe(b.k);
    fp.v = describe(b.v);
    fp.o = describe(b.o);
    fp.lse = describe(b.lse);
    fp.scale = 0.125;
    fp.causal = 1;
    ringattn_ring_backward_params_t bp = test::ring_backward_params_of(
        fp, describe(b.dout), describe(b.dq), describe(b.dk), describe(b.dv));
    for (const bool forward : {true, false}) {
      const ringattn_status_t status = forward ? ringattn_ring_forward(ring, &fp, nullptr)
                                               : ringattn_ring_backward(ring, &bp, nullptr);
      const std::string message = ringattn_last_error();
      EXPECT_EQ(status, RINGATTN_ERROR_UNSUPPORTED) << message;
      EXPECT_NE(message.find(refusal(head_dim)), std::string::npos) << message;
      const std::vector<std::string> all = all_gather_text(*host_, message);
      for (int r = 0; r < ranks_; ++r) EXPECT_EQ(all[r], all[0]) << "rank " << r;
    }
  }
  EXPECT_EQ(ringattn_ring_destroy(ring), RINGATTN_SUCCESS);
}

}  // namespace
}  // namespace ringattn
