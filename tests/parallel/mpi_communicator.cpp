// ringattn-mpi-ranks: 1 2 3 4 8
// MpiCommunicator against the Communicator contract the ring relies on: an exchange sends to
// rank + 1 and receives from rank - 1; two exchanges of different sizes in flight at once each
// land in their own buffer; sums, host gathers, splits ordered by key, the node-local rank; and
// check_same_on_all_ranks, which must agree on every rank whatever it finds.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"

namespace ringattn {
namespace {

class MpiCommunicatorTest : public testing::Test {
 protected:
  void SetUp() override {
    comm_ = MpiCommunicator::world();
    ranks_ = comm_->size();
    rank_ = comm_->rank();
  }
  int previous() const { return (rank_ + ranks_ - 1) % ranks_; }

  std::unique_ptr<MpiCommunicator> comm_;
  int ranks_ = 1, rank_ = 0;
};

TEST_F(MpiCommunicatorTest, ExchangesRotateAroundTheRing) {
  EXPECT_EQ(comm_->memory(), Memory::host);
  // A small message of doubles and a larger one of bytes in flight together, one wait.
  const std::vector<double> small_send(3, 10.0 * rank_ + 1);
  std::vector<double> small_recv(3, -1);
  std::vector<unsigned char> large_send(100000), large_recv(100000, 0);
  for (std::size_t i = 0; i < large_send.size(); ++i) {
    large_send[i] = static_cast<unsigned char>((i * 7 + static_cast<std::size_t>(rank_)) % 251);
  }
  comm_->exchange_start(small_send.data(), 3 * sizeof(double), small_recv.data(),
                        3 * sizeof(double), nullptr);
  comm_->exchange_start(large_send.data(), large_send.size(), large_recv.data(), large_recv.size(),
                        nullptr);
  comm_->exchange_wait(nullptr);
  EXPECT_EQ(small_recv, std::vector<double>(3, 10.0 * previous() + 1));
  for (std::size_t i = 0; i < large_recv.size(); ++i) {
    ASSERT_EQ(large_recv[i], (i * 7 + static_cast<std::size_t>(previous())) % 251) << i;
  }
  // A wait with nothing in flight returns at once; an empty exchange moves nothing.
  comm_->exchange_wait(nullptr);
  comm_->exchange_start(nullptr, 0, nullptr, 0, nullptr);
  comm_->exchange_wait(nullptr);
}

TEST_F(MpiCommunicatorTest, SumsAndGathers) {
  std::vector<double> f64 = {1.0 * rank_, 2.0};
  std::vector<float> f32 = {0.5f * static_cast<float>(rank_)};
  comm_->all_reduce_sum(f64.data(), f64.size(), DType::f64, nullptr);
  comm_->all_reduce_sum(f32.data(), f32.size(), DType::f32, nullptr);
  EXPECT_EQ(f64, (std::vector<double>{ranks_ * (ranks_ - 1) / 2.0, 2.0 * ranks_}));
  EXPECT_EQ(f32[0], 0.25f * static_cast<float>(ranks_ * (ranks_ - 1)));
  std::uint16_t bf16 = 0;
  EXPECT_TRUE(test::ThrowsNaming([&] { comm_->all_reduce_sum(&bf16, 1, DType::bf16, nullptr); },
                                 {"all_reduce_sum", "f32 and f64", "bf16"}));

  const std::int32_t mine = 100 + rank_;
  std::vector<std::int32_t> all(static_cast<std::size_t>(ranks_));
  comm_->host_all_gather(&mine, sizeof(mine), all.data());
  for (int r = 0; r < ranks_; ++r) EXPECT_EQ(all[r], 100 + r);
  const std::vector<std::string> texts = all_gather_text(*comm_, std::string(rank_, 'x'));
  for (int r = 0; r < ranks_; ++r) EXPECT_EQ(texts[r], std::string(r, 'x'));
  comm_->barrier();
}

TEST_F(MpiCommunicatorTest, SplitGroupsByColorOrderedByKey) {
  // Two groups (even and odd ranks), each ordered by descending world rank.
  std::unique_ptr<Communicator> group = comm_->split(rank_ % 2, -rank_);
  const int members = (ranks_ + 1 - rank_ % 2) / 2;
  EXPECT_EQ(group->size(), members);
  EXPECT_EQ(group->rank(), members - 1 - rank_ / 2);
  // The group's ring: the next rank of the group is the next lower world rank of the same parity.
  const int sent = rank_;
  int received = -1;
  group->exchange_start(&sent, sizeof(sent), &received, sizeof(received), nullptr);
  group->exchange_wait(nullptr);
  const int expected = rank_ + 2 < ranks_ ? rank_ + 2 : rank_ % 2;  // previous in descending order
  EXPECT_EQ(received, expected);
  EXPECT_TRUE(test::ThrowsNaming([&] { comm_->split(-1, 0); }, {"color is -1", ">= 0"}));
}

TEST_F(MpiCommunicatorTest, NodeLocalRankOnOneNode) {
  // mpiexec of the tests runs every rank on this machine.
  EXPECT_EQ(node_local_rank(*comm_), rank_);
  EXPECT_EQ(node_local_size(*comm_), ranks_);
}

TEST_F(MpiCommunicatorTest, CheckSameOnAllRanksAgreesEverywhere) {
  EXPECT_NO_THROW(check_same_on_all_ranks(*comm_, "test", "q [1, 8] f32; causal true"));
  if (ranks_ == 1) return;
  // The last rank differs in one item of two.
  const std::string mine =
      std::string("q [1, 8] f32; causal ") + (rank_ == ranks_ - 1 ? "false" : "true");
  std::string message;
  try {
    check_same_on_all_ranks(*comm_, "test", mine);
  } catch (const Error& error) {
    message = error.what();
  }
  const std::string odd = "rank " + std::to_string(ranks_ - 1) + " has causal false";
  EXPECT_NE(message.find(ranks_ == 2 ? "rank 0 has causal true but rank 1 has causal false" : odd),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("q [1, 8]"), std::string::npos) << "names an item all ranks agree on";
  const std::vector<std::string> all = all_gather_text(*comm_, message);
  for (int r = 0; r < ranks_; ++r) EXPECT_EQ(all[r], all[0]) << "rank " << r;
}

}  // namespace
}  // namespace ringattn
