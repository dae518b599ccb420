// Helpers of the ring tests on CPU ranks (tests/parallel/mpi_ring_*.cpp): the five outputs of a
// whole problem, rank 0's copy of them on every rank, and a rank's shards gathered into a whole
// tensor.
#pragma once

#include <mpi.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/ring.hpp"
#include "tests/common/attention_testing.hpp"

namespace ringattn::test {

// Outputs of the whole problem as logical [B, S, H, D] / [B, H, S] values.
struct Outputs {
  std::vector<double> o, lse, dq, dk, dv;
};

inline constexpr const char* kNames[] = {"O", "LSE", "dQ", "dK", "dV"};
inline std::vector<double> Outputs::*const kFields[] = {&Outputs::o, &Outputs::lse,
                                                        &Outputs::dq, &Outputs::dk, &Outputs::dv};

// The whole outputs of rank 0 (of shape s) on every rank: the oracle and the one-process run are
// computed once, not by each of 8 ranks oversubscribing 2 cores.
inline Outputs broadcast_from_rank0(const Outputs& mine, const AttentionShape& s) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::int64_t q_rows = s.batch * s.q_len * s.q_heads,
                     k_rows = s.batch * s.k_len * s.kv_heads;
  const std::int64_t counts[] = {q_rows * s.value_dim(), q_rows, q_rows * s.head_dim,
                                 k_rows * s.head_dim, k_rows * s.value_dim()};
  Outputs out = rank == 0 ? mine : Outputs{};
  for (int i = 0; i < 5; ++i) {
    std::vector<double>& values = out.*kFields[i];
    values.resize(static_cast<std::size_t>(counts[i]));
    EXPECT_EQ(MPI_Bcast(values.data(), static_cast<int>(counts[i]), MPI_DOUBLE, 0, MPI_COMM_WORLD),
              MPI_SUCCESS);
  }
  return out;
}

// Every rank's shard of a contiguous local tensor, gathered and unsharded into `whole`.
template <typename T>
void gather_whole(const HostTensor<T>& local, SequenceLayoutKind kind, const Communicator& comm,
                  const TensorView& whole) {
  const std::size_t count = local.storage.size();
  std::vector<T> all(count * static_cast<std::size_t>(comm.size()));
  comm.host_all_gather(local.storage.data(), count * sizeof(T), all.data());
  const std::int64_t total = local.view.rank == 4 ? whole.shape[1] : whole.shape[2];
  for (int p = 0; p < comm.size(); ++p) {
    TensorView shard = local.view;
    shard.data = all.data() + p * count;
    SequenceLayout(kind, comm.size(), p, total).unshard(shard, whole);
  }
}

}  // namespace ringattn::test
