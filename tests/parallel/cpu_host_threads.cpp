// rank_threads against counts worked out by hand for the launch layouts it serves.
#include <gtest/gtest.h>

#include "tests/train/expect_error.hpp"
#include "parallel/host_threads.hpp"

namespace ringattn {
namespace {

using test::throws_error_with;

struct Case {
  int allowed, online, node_ranks, expected;
  const char* layout;
};

TEST(RankThreads, TakesTheMaskButNoMoreThanAnEqualPartOfTheNode) {
  const Case cases[] = {
      {1, 16, 2, 1, "mpirun's default for 2 ranks: each bound to one core"},
      {16, 16, 2, 8, "--bind-to none, 2 ranks on 16 CPUs: half each"},
      {16, 16, 3, 5, "--bind-to none, 3 ranks on 16 CPUs: the part rounds down"},
      {32, 64, 4, 16, "4 ranks bound to 2 sockets of 32: two share a socket"},
      {4, 64, 4, 4, "bound to 4 cores each (PE=4): the mask, below the part"},
      {16, 16, 32, 1, "more ranks than CPUs: still one thread"},
      {2, 2, 1, 2, "one rank alone: every CPU it may use"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(rank_threads(c.allowed, c.online, c.node_ranks), c.expected) << c.layout;
  }
}

TEST(RankThreads, RejectsCountsBelowOneByName) {
  EXPECT_TRUE(throws_error_with([] { rank_threads(0, 16, 2); },
                                {"rank_threads", "allowed_cpus is 0; expected >= 1"}));
  EXPECT_TRUE(throws_error_with([] { rank_threads(4, -1, 2); },
                                {"rank_threads", "online_cpus is -1"}));
  EXPECT_TRUE(throws_error_with([] { rank_threads(4, 16, 0); },
                                {"rank_threads", "node_ranks is 0"}));
}

}  // namespace
}  // namespace ringattn
