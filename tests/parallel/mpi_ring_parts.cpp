// ringattn-mpi-ranks: 1 2 3 4
// The halves of the ring schedule (RingWork, parallel/ring_attention.hpp) that ringattn-bench ring
// times apart. The transfers half makes exactly the ring's exchanges (sizes, order and waits, and
// the one exchange_finish after the last wait) and the compute half none. Without a mask every step of the compute half merges the block of the
// local Q on the local K/V, so its forward gives that block's O and its LSE plus log N (N steps
// ran and merged), and its backward, with that LSE, that block's gradients (N contributions of a
// 1/N share each, dK/dV through the step buffer and the addition). A RingAttention that ran the
// halves then computes what a fresh one does.
//
// The workspace: with scratch lent to its calls the ring computes bitwise what it does without,
// holds no workspace of its own when the scratch has room for all of it and only what did not fit
// otherwise, and a scratch region that overlaps a tensor of the call fails on every rank.
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "parallel/ring_attention.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::HostTensor;

// The MPI communicator of every rank, recording the exchanges asked of it.
class RecordingCommunicator final : public Communicator {
 public:
  explicit RecordingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Memory memory() const override { return inner_->memory(); }
  std::string transport() const override { return inner_->transport(); }
  void exchange_start(const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes,
                      void* stream) override {
    log_.push_back("send " + std::to_string(send_bytes) + ", receive " + std::to_string(recv_bytes));
    inner_->exchange_start(send, send_bytes, recv, recv_bytes, stream);
  }
  void exchange_wait(void* stream) override {
    log_.push_back("wait");
    inner_->exchange_wait(stream);
  }
  void exchange_finish(void* stream) override {
    log_.push_back("finish");
    inner_->exchange_finish(stream);
  }
  void keep_memory(const void* data, std::size_t bytes) override {
    log_.push_back("keep " + std::to_string(bytes));
    inner_->keep_memory(data, bytes);
  }
  void release_kept_memory(double timeout_s) override {
    log_.push_back("release");
    inner_->release_kept_memory(timeout_s);
  }
  void all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) override {
    inner_->all_reduce_sum(data, count, dtype, stream);
  }
  void barrier() override { inner_->barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) const override {
    return inner_->split(color, key);
  }
  void host_all_gather(const void* send, std::size_t bytes, void* recv) const override {
    inner_->host_all_gather(send, bytes, recv);
  }

  std::vector<std::string> take_log() { return std::exchange(log_, {}); }

 private:
  std::unique_ptr<Communicator> inner_;
  std::vector<std::string> log_;
};

// One rank's shards: 32 tokens, 4 query heads on 2 K/V heads, head_dim 16, batch 2, f64.
struct Shards {
  HostTensor<double> q, k, v, o, lse, dout, dq, dk, dv;

  explicit Shards(std::uint64_t stream)
      : q({2, 32, 4, 16}),
        k({2, 32, 2, 16}),
        v({2, 32, 2, 16}),
        o({2, 32, 4, 16}),
        lse({2, 4, 32}),
        dout({2, 32, 4, 16}),
        dq({2, 32, 4, 16}),
        dk({2, 32, 2, 16}),
        dv({2, 32, 2, 16}) {
    std::mt19937_64 rng = test::make_rng(stream);
    for (HostTensor<double>* t : {&q, &k, &v, &dout}) test::fill_normal(t->storage, rng);
  }

  RingForwardArgs forward_args(bool causal) const {
    return {q.view, k.view, v.view, o.view, lse.view, 0.25, causal, nullptr, {}};
  }
  RingBackwardArgs backward_args(bool causal) const {
    return {q.view, k.view, v.view, o.view, lse.view, dout.view, dq.view, dk.view, dv.view, 0.25, causal,
            false,  nullptr, {}};
  }
};

// Bitwise the same outputs and gradients.
void expect_same_results(const Shards& got, const Shards& expected) {
  EXPECT_EQ(got.o.storage, expected.o.storage);
  EXPECT_EQ(got.lse.storage, expected.lse.storage);
  EXPECT_EQ(got.dq.storage, expected.dq.storage);
  EXPECT_EQ(got.dk.storage, expected.dk.storage);
  EXPECT_EQ(got.dv.storage, expected.dv.storage);
}

class MpiRingParts : public testing::Test {
 protected:
  void SetUp() override {
    recording_ = std::make_shared<RecordingCommunicator>(MpiCommunicator::world());
    ranks_ = recording_->size();
    rank_ = recording_->rank();
  }

  std::shared_ptr<RecordingCommunicator> recording_;
  int ranks_ = 1, rank_ = 0;
};

TEST_F(MpiRingParts, TransfersAreTheRingsExchangesAndComputeHasNone) {
  for (const SequenceLayoutKind layout : {SequenceLayoutKind::zigzag, SequenceLayoutKind::contiguous}) {
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(std::string(sequence_layout_name(layout)) + (causal ? ", causal" : ", full"));
      RingAttention ring(recording_, layout);
      Shards s(70 + rank_);

      ring.forward(s.forward_args(causal));
      const std::vector<std::string> forward = recording_->take_log();
      ring_forward(ring, s.forward_args(causal), RingWork::transfers);
      EXPECT_EQ(recording_->take_log(), forward);
      ring_forward(ring, s.forward_args(causal), RingWork::compute);
      EXPECT_TRUE(recording_->take_log().empty());

      ring.backward(s.backward_args(causal));
      const std::vector<std::string> backward = recording_->take_log();
      ring_backward(ring, s.backward_args(causal), RingWork::transfers);
      EXPECT_EQ(recording_->take_log(), backward);
      ring_backward(ring, s.backward_args(causal), RingWork::compute);
      EXPECT_TRUE(recording_->take_log().empty());

      // f64 inputs accumulate in f64, so K|V and dK|dV messages have one size: N - 1 of them
      // forward, N - 1 of K|V and N - 1 of dK|dV backward (a shard's accumulator starts at the
      // rank after its owner).
      const std::string kv = "send " + std::to_string(2 * 2 * 32 * 2 * 16 * 8);
      auto sends = [](const std::vector<std::string>& log, const std::string& what) {
        int count = 0;
        for (const std::string& line : log) count += line.rfind(what, 0) == 0 ? 1 : 0;
        return count;
      };
      EXPECT_EQ(sends(forward, kv), ranks_ - 1);
      EXPECT_EQ(sends(backward, kv), 2 * (ranks_ - 1));
      // Each call ends its exchanges once, after the last wait (a single rank has none to end).
      for (const std::vector<std::string>* log : {&forward, &backward}) {
        EXPECT_EQ(sends(*log, "finish"), ranks_ > 1 ? 1 : 0);
        if (ranks_ > 1) {
          ASSERT_GE(log->size(), 2u);
          EXPECT_EQ(log->back(), "finish");
          EXPECT_EQ((*log)[log->size() - 2], "wait");
        }
      }
    }
  }
}

TEST_F(MpiRingParts, ComputeRunsEveryStepOnTheLocalShard) {
  SCOPED_TRACE(test::seed_trace());
  RingAttention ring(recording_, SequenceLayoutKind::zigzag);
  Shards s(80 + rank_);
  ring_forward(ring, s.forward_args(false), RingWork::compute);
  ring_backward(ring, s.backward_args(false), RingWork::compute);

  // The block of the local Q on the local K/V, in fp64.
  Shards local(80 + rank_);
  const Mask none{};
  reference::attention_forward(local.q.view, local.k.view, local.v.view, none, 0.25, local.o.view,
                               local.lse.view);
  reference::attention_backward(local.q.view, local.k.view, local.v.view, local.dout.view, none, 0.25,
                                local.dq.view, local.dk.view, local.dv.view);
  std::vector<double> lse = local.lse.values();
  for (double& x : lse) x += std::log(static_cast<double>(ranks_));

  EXPECT_TRUE(test::Close("O", s.o.values(), local.o.values(), 1e-12));
  EXPECT_TRUE(test::Close("LSE", s.lse.values(), lse, 1e-12));
  EXPECT_TRUE(test::Close("dQ", s.dq.values(), local.dq.values(), 1e-11));
  EXPECT_TRUE(test::Close("dK", s.dk.values(), local.dk.values(), 1e-11));
  EXPECT_TRUE(test::Close("dV", s.dv.values(), local.dv.values(), 1e-11));
}

TEST_F(MpiRingParts, HalvesLeaveTheRingComputingWhatAFreshOneDoes) {
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    Shards fresh_out(90 + rank_), used_out(90 + rank_);
    RingAttention fresh(recording_, SequenceLayoutKind::zigzag);
    fresh.forward(fresh_out.forward_args(causal));
    fresh.backward(fresh_out.backward_args(causal));

    RingAttention used(recording_, SequenceLayoutKind::zigzag);
    for (const RingWork work : {RingWork::transfers, RingWork::compute}) {
      ring_forward(used, used_out.forward_args(causal), work);
      ring_backward(used, used_out.backward_args(causal), work);
    }
    used.forward(used_out.forward_args(causal));
    used.backward(used_out.backward_args(causal));
    expect_same_results(used_out, fresh_out);
    recording_->take_log();
  }
}


// The workspace bytes a ring call needs beyond the scratch: its own buffers after the call.
TEST_F(MpiRingParts, ScratchHoldsTheWorkspaceAndChangesNoResult) {
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    Shards plain(100 + rank_), lent(100 + rank_), partly(100 + rank_);
    RingAttention own(recording_, SequenceLayoutKind::zigzag);
    own.forward(plain.forward_args(causal));
    own.backward(plain.backward_args(causal));
    const std::size_t owned = own.owned_workspace_bytes();
    EXPECT_GT(owned, 0u);  // at least the backward's delta

    // Room for everything (plus alignment), in one region that starts off the 256-byte grid.
    std::vector<double> scratch(owned / sizeof(double) + 1024);
    const ScratchRegion region{scratch.data() + 1, (scratch.size() - 1) * sizeof(double)};
    RingAttention ring(recording_, SequenceLayoutKind::zigzag);
    RingForwardArgs forward = lent.forward_args(causal);
    RingBackwardArgs backward = lent.backward_args(causal);
    forward.scratch = backward.scratch = {region};
    ring.forward(forward);
    ring.backward(backward);
    EXPECT_EQ(ring.owned_workspace_bytes(), 0u);
    expect_same_results(lent, plain);

    // Regions too small for the largest buffers: those stay the ring's own, the rest is lent.
    std::vector<double> small(2048);
    forward = partly.forward_args(causal);
    backward = partly.backward_args(causal);
    forward.scratch = backward.scratch = {{small.data(), 8}, {small.data() + 64, 8192}};
    ring.forward(forward);
    ring.backward(backward);
    if (ranks_ > 1) {
      EXPECT_GT(ring.owned_workspace_bytes(), 0u);
      EXPECT_LT(ring.owned_workspace_bytes(), owned);
    }
    expect_same_results(partly, plain);
    recording_->take_log();
  }
}

// Persistent scratch: each call with more than one rank names its persistent regions (only those)
// to the communicator before its first exchange, the results do not change, and release_scratch
// is the communicator's release, once.
TEST_F(MpiRingParts, PersistentScratchIsNamedToTheCommunicatorAndReleased) {
  Shards plain(120 + rank_), lent(120 + rank_);
  RingAttention own(recording_, SequenceLayoutKind::zigzag);
  own.forward(plain.forward_args(true));
  own.backward(plain.backward_args(true));
  const std::size_t owned = own.owned_workspace_bytes();
  recording_->take_log();

  std::vector<double> scratch(owned / sizeof(double) + 1024), other(64);
  const std::size_t bytes = scratch.size() * sizeof(double);
  RingAttention ring(recording_, SequenceLayoutKind::zigzag);
  RingForwardArgs forward = lent.forward_args(true);
  RingBackwardArgs backward = lent.backward_args(true);
  forward.scratch = backward.scratch = {{scratch.data(), bytes, true},
                                        {other.data(), other.size() * sizeof(double), false}};
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call + 1));
    ring.forward(forward);
    const std::vector<std::string> forward_log = recording_->take_log();
    ring.backward(backward);
    const std::vector<std::string> backward_log = recording_->take_log();
    for (const std::vector<std::string>* log : {&forward_log, &backward_log}) {
      if (ranks_ == 1) {
        EXPECT_TRUE(log->empty());
        continue;
      }
      ASSERT_FALSE(log->empty());
      EXPECT_EQ(log->front(), "keep " + std::to_string(bytes)) << "before the first exchange";
      EXPECT_EQ(std::count(log->begin(), log->end(), "keep " + std::to_string(bytes)), 1);
      EXPECT_EQ(std::count_if(log->begin(), log->end(),
                              [](const std::string& line) { return line.rfind("keep", 0) == 0; }),
                1)
          << "the region lent without persistent is not named";
    }
    EXPECT_EQ(ring.owned_workspace_bytes(), 0u);
    expect_same_results(lent, plain);
  }
  ring.release_scratch();
  EXPECT_EQ(recording_->take_log(), std::vector<std::string>{"release"});
}

TEST_F(MpiRingParts, ScratchOverlappingATensorFailsEverywhere) {
  Shards s(110 + rank_);
  RingAttention ring(recording_, SequenceLayoutKind::zigzag);
  RingBackwardArgs backward = s.backward_args(true);
  // Only rank 0 lends memory that is dk's; every rank reports rank 0's error.
  if (rank_ == 0) backward.scratch = {{s.dk.storage.data() + 5, 64}};
  try {
    ring.backward(backward);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("scratch region 0 (64 bytes) overlaps dk"), std::string::npos)
        << message;
  }
  recording_->take_log();
}

}  // namespace
}  // namespace ringattn
