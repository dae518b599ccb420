// MPI for the gpu test binaries that bootstrap NCCL: run alone (MPI's singleton mode, one rank)
// or under mpiexec. Including this header registers a gtest environment that initialises MPI
// before the first test and finalises it after the last; world_size() and world_rank() answer
// for MPI_COMM_WORLD. (The mpi test binaries have their own main, tests/common/mpi_main.cpp.)
#pragma once

#include <mpi.h>

#include <gtest/gtest.h>

namespace ringattn::test {

class MpiEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    }
  }
  void TearDown() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

inline const ::testing::Environment* const kMpiEnvironment =
    ::testing::AddGlobalTestEnvironment(new MpiEnvironment);

inline int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

inline int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

}  // namespace ringattn::test
