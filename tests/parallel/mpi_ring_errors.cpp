// ringattn-mpi-ranks: 1 2 3 4 8
// Bad ring calls fail on every rank with the same message, before any transfer, and nothing
// hangs: ranks that disagree on a shape, a dtype or the mask; a bad argument on one rank only;
// lengths the layout cannot split; dtypes and memory the backend cannot run. After a failed call
// the same RingAttention still computes correct results.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::HostTensor;

// One rank's shards of a small problem: Sl tokens, q_heads on 2 K/V heads, head_dim 16, batch 2.
struct Shards {
  HostTensor<double> q, k, v, o, lse, dout, dq, dk, dv;

  explicit Shards(std::int64_t local = 32, std::int64_t q_heads = 4)
      : q({2, local, q_heads, 16}),
        k({2, local, 2, 16}),
        v({2, local, 2, 16}),
        o({2, local, q_heads, 16}),
        lse({2, q_heads, local}),
        dout({2, local, q_heads, 16}),
        dq({2, local, q_heads, 16}),
        dk({2, local, 2, 16}),
        dv({2, local, 2, 16}) {
    std::mt19937_64 rng = test::make_rng(60);
    for (HostTensor<double>* t : {&q, &k, &v, &dout}) test::fill_normal(t->storage, rng);
  }

  RingForwardArgs forward_args(bool causal = true) const {
    return {q.view, k.view, v.view, o.view, lse.view, 0.25, causal, nullptr, {}};
  }
  RingBackwardArgs backward_args(bool causal = true) const {
    return {q.view,  k.view,  v.view, o.view, lse.view, dout.view, dq.view,
            dk.view, dv.view, 0.25,   causal, false,    nullptr, {}};
  }
};

class MpiRingErrors : public testing::Test {
 protected:
  void SetUp() override {
    comm_ = std::shared_ptr<Communicator>(MpiCommunicator::world());
    ranks_ = comm_->size();
    rank_ = comm_->rank();
  }

  // The call throws ringattn::Error naming every part, with the same message on every rank.
  template <typename F>
  void expect_same_error_everywhere(F&& call, std::initializer_list<std::string_view> parts) {
    std::string message = "(no error)";
    try {
      call();
    } catch (const Error& error) {
      message = error.what();
    }
    for (std::string_view part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "the message \"" << message << "\" does not contain \"" << part << "\"";
    }
    const std::vector<std::string> all = all_gather_text(*comm_, message);
    for (int r = 0; r < ranks_; ++r) {
      EXPECT_EQ(all[r], all[0]) << "rank " << r << " threw another message than rank 0";
    }
  }

  std::shared_ptr<Communicator> comm_;
  int ranks_ = 1, rank_ = 0;
};

// "rank 1" or "ranks 1, 2" or "ranks 1-7": the names the messages use for ranks [first, last].
std::string ranks_text(int first, int last) {
  if (first == last) return "rank " + std::to_string(first);
  if (last == first + 1) return "ranks " + std::to_string(first) + ", " + std::to_string(last);
  return "ranks " + std::to_string(first) + "-" + std::to_string(last);
}

TEST_F(MpiRingErrors, OneRankWithAnotherHeadCount) {
  if (ranks_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  const int odd = ranks_ - 1;
  Shards shards(32, rank_ == odd ? 8 : 4);
  RingAttention ring(comm_, SequenceLayoutKind::zigzag);
  // Two ranks tie and are named in rank order; more name the odd one out first.
  const std::string disagreement =
      ranks_ == 2 ? "rank 0 has q [2, 32, 4, 16] f64 but rank 1 has q [2, 32, 8, 16] f64"
                  : "rank " + std::to_string(odd) + " has q [2, 32, 8, 16] f64 but " +
                        ranks_text(0, odd - 1) + " have q [2, 32, 4, 16] f64";
  expect_same_error_everywhere([&] { ring.forward(shards.forward_args()); },
                               {"RingAttention::forward: the ranks disagree: ", disagreement});
  expect_same_error_everywhere([&] { ring.backward(shards.backward_args()); },
                               {"RingAttention::backward", "dq [2, 32, 8, 16] f64"});
}

TEST_F(MpiRingErrors, OneRankWithAnotherLength) {
  if (ranks_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Shards shards(rank_ == 0 ? 40 : 32);
  RingAttention ring(comm_, SequenceLayoutKind::contiguous);
  expect_same_error_everywhere([&] { ring.forward(shards.forward_args()); },
                               {"rank 0 has q [2, 40, 4, 16] f64 but " + ranks_text(1, ranks_ - 1),
                                "q [2, 32, 4, 16] f64", "k [2, 40, 2, 16] f64"});
}

TEST_F(MpiRingErrors, OneRankWithAnotherMask) {
  if (ranks_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  const int odd = ranks_ - 1;
  Shards shards;
  RingAttention ring(comm_, SequenceLayoutKind::zigzag);
  const std::string disagreement = ranks_ == 2
                                       ? "rank 0 has causal false but rank 1 has causal true"
                                       : "rank " + std::to_string(odd) + " has causal true but " +
                                             ranks_text(0, odd - 1) + " have causal false";
  expect_same_error_everywhere([&] { ring.forward(shards.forward_args(rank_ == odd)); },
                               {disagreement});
}

TEST_F(MpiRingErrors, OneRankWithAnotherGradientDtype) {
  if (ranks_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Shards shards;
  std::vector<float> dq_f32(shards.dq.storage.size());
  RingBackwardArgs args = shards.backward_args();
  if (rank_ == 0) args.dq = TensorView::contiguous(dq_f32.data(), DType::f32, {2, 32, 4, 16});
  RingAttention ring(comm_, SequenceLayoutKind::zigzag);
  expect_same_error_everywhere([&] { ring.backward(args); },
                               {"rank 0 has dq [2, 32, 4, 16] f32 but", "dq [2, 32, 4, 16] f64"});
}

TEST_F(MpiRingErrors, BadArgumentOnOneRankOnly) {
  Shards shards;
  RingForwardArgs args = shards.forward_args();
  if (rank_ == 0) args.o.data = nullptr;  // same shapes everywhere, so only the local check sees it
  RingAttention ring(comm_, SequenceLayoutKind::zigzag);
  expect_same_error_everywhere(
      [&] { ring.forward(args); },
      {"RingAttention::forward: ", ranks_ > 1 ? "rank 0: " : "", "o is a null pointer"});
}

// key_rotation reaches the one block call of a one-rank ring: dK is the call's without it rotated
// back (test::rotate_keys_back), to f64 rounding; a ring of more ranks names it.
TEST_F(MpiRingErrors, KeyRotationOnOneRankOnly) {
  Shards shards;
  std::mt19937_64 rng = test::make_rng(61);
  test::KeyRotationTables<double> tables = test::random_key_rotation<double>(32, 16, rng);
  RingBackwardArgs args = shards.backward_args();
  args.key_rotation = {TensorView::contiguous(tables.cos.data(), DType::f64, {32, 8}),
                       TensorView::contiguous(tables.sin.data(), DType::f64, {32, 8})};
  RingAttention ring(comm_, SequenceLayoutKind::zigzag);
  if (ranks_ > 1) {
    expect_same_error_everywhere(
        [&] { ring.backward(args); },
        {"RingAttention::backward", "key_rotation is given on a ring of " +
                                        std::to_string(ranks_) + " ranks; expected one rank"});
    return;
  }
  ring.forward(shards.forward_args());
  ring.backward(shards.backward_args());
  const std::vector<double> plain = test::read_view(shards.dk.view);
  ring.backward(args);
  std::vector<double> expected, magnitude;
  test::rotate_keys_back(plain, {2, 32, 32, 4, 2, 16}, tables, expected, magnitude);
  EXPECT_TRUE(test::Close("dK (rotated back)", test::read_view(shards.dk.view), expected, 1e-12));
}

TEST_F(MpiRingErrors, ZigzagNeedsAMultipleOfTwiceTheRanks) {
  Shards shards(33);  // S = 33 N is not a multiple of 2N
  RingAttention ring(comm_, SequenceLayoutKind::zigzag);
  const std::string total = std::to_string(33 * ranks_);
  expect_same_error_everywhere(
      [&] { ring.forward(shards.forward_args()); },
      {"zigzag layout", "S = " + total, "not a multiple of 2N = " + std::to_string(2 * ranks_),
       "N = " + std::to_string(ranks_) + " ranks"});
  expect_same_error_everywhere([&] { ring.backward(shards.backward_args()); },
                               {"RingAttention::backward", "zigzag layout", "S = " + total});
  // The contiguous layout splits the same sequence.
  RingAttention contiguous(comm_, SequenceLayoutKind::contiguous);
  EXPECT_NO_THROW(contiguous.forward(shards.forward_args()));
}

TEST_F(MpiRingErrors, DtypesAndMemoryTheBackendCannotRun) {
  Shards shards;
  RingAttention ring(comm_, SequenceLayoutKind::contiguous);
  // Host bf16 tensors: the CPU block runs f32 and f64.
  std::vector<std::uint16_t> q(2 * 32 * 4 * 16), kv(2 * 32 * 2 * 16), o(2 * 32 * 4 * 16);
  std::vector<float> lse(2 * 4 * 32);
  RingForwardArgs bf16{TensorView::contiguous(q.data(), DType::bf16, {2, 32, 4, 16}),
                       TensorView::contiguous(kv.data(), DType::bf16, {2, 32, 2, 16}),
                       TensorView::contiguous(kv.data(), DType::bf16, {2, 32, 2, 16}),
                       TensorView::contiguous(o.data(), DType::bf16, {2, 32, 4, 16}),
                       TensorView::contiguous(lse.data(), DType::f32, {2, 4, 32}),
                       0.25,
                       false,
                       nullptr,
                       {}};
  expect_same_error_everywhere([&] { ring.forward(bf16); },
                               {"q has dtype bf16", "CPU block", "f32 or f64"});
  // Device tensors on an MPI communicator, which moves host memory.
  RingForwardArgs device = shards.forward_args();
  device.q.memory = device.k.memory = device.v.memory = device.o.memory = device.lse.memory =
      Memory::device;
  expect_same_error_everywhere([&] { ring.forward(device); },
                               {"q is in device memory; expected host memory"});
}

TEST_F(MpiRingErrors, StillCorrectAfterFailedCalls) {
  SCOPED_TRACE(test::seed_trace());
  RingAttention ring(comm_, SequenceLayoutKind::zigzag);
  Shards bad(33);
  EXPECT_THROW(ring.forward(bad.forward_args()), Error);
  EXPECT_THROW(ring.backward(bad.backward_args()), Error);

  // One whole problem on every rank, this rank's shard through the ring, the oracle on the rest.
  const std::int64_t total = 32 * ranks_;
  Shards whole(total);
  Shards shards;
  ring.shard(whole.q.view, shards.q.view);
  ring.shard(whole.k.view, shards.k.view);
  ring.shard(whole.v.view, shards.v.view);
  ring.shard(whole.dout.view, shards.dout.view);
  ring.forward(shards.forward_args());
  ring.backward(shards.backward_args());

  const Mask mask{true, 0, 0};
  reference::attention_forward(whole.q.view, whole.k.view, whole.v.view, mask, 0.25, whole.o.view,
                               whole.lse.view);
  reference::attention_backward(whole.q.view, whole.k.view, whole.v.view, whole.dout.view, mask,
                                0.25, whole.dq.view, whole.dk.view, whole.dv.view);
  // This rank's part of the oracle, sharded like the outputs.
  Shards expected;
  HostTensor<double> Shards::*const fields[] = {&Shards::o, &Shards::lse, &Shards::dq, &Shards::dk,
                                                &Shards::dv};
  const char* names[] = {"O", "LSE", "dQ", "dK", "dV"};
  for (int i = 0; i < 5; ++i) {
    ring.shard((whole.*fields[i]).view, (expected.*fields[i]).view);
    EXPECT_TRUE(
        test::Close(names[i], (shards.*fields[i]).values(), (expected.*fields[i]).values(), 1e-12))
        << "rank " << rank_;
  }
}

}  // namespace
}  // namespace ringattn
