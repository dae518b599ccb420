// main() of every mpi test binary: gtest between MPI_Init and MPI_Finalize, on every rank.
//
// Rank 0 prints gtest's usual report; the other ranks print only their failures, each line
// prefixed with the rank, so that N ranks read as one report plus what went wrong elsewhere.
// Every rank returns the same exit status: non-zero when a test failed on any rank.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "tests/common/random.hpp"

namespace {

void print_prefixed(int rank, std::string_view text) {
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    const std::string_view line = text.substr(0, end);
    std::printf("[rank %d] %.*s\n", rank, static_cast<int>(line.size()), line.data());
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
}

class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    const char* file = result.file_name() != nullptr ? result.file_name() : "unknown file";
    print_prefixed(rank_, std::string(file) + ":" + std::to_string(result.line_number()) +
                              ": Failure\n" + result.message());
    std::fflush(stdout);
  }

  void OnTestEnd(const testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    print_prefixed(rank_,
                   std::string("[  FAILED  ] ") + info.test_suite_name() + "." + info.name());
    std::fflush(stdout);
  }

 private:
  int rank_;
};

// Ring tests build the same global inputs on every rank: all ranks take rank 0's seed.
void share_seed(int rank) {
  std::uint64_t seed = 0;
  if (rank == 0) {
    try {
      seed = ringattn::test::test_seed();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "%s\n", error.what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  setenv("RINGATTN_TEST_SEED", std::to_string(seed).c_str(), 1);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  share_seed(rank);

  if (rank == 0) {
    std::printf("[ ringattn ] %d MPI ranks, %s\n", size, ringattn::test::seed_trace().c_str());
  } else {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    // One XML report per run (rank 0's), not N writers of the same file.
    delete listeners.Release(listeners.default_xml_generator());
    listeners.Append(new FailurePrinter(rank));
  }

  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !failed) {
    std::printf("[ ringattn ] FAILED on another rank: see the [rank N] lines\n");
  }
  MPI_Finalize();
  return any_failed;
}
