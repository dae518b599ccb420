// MpiCommunicator: the Communicator of host memory, over a duplicate of an MPI communicator (its
// own context, so the ring's messages never match anyone else's) with MPI_ERRORS_RETURN, every
// return code checked. The CPU backend of ring attention, and the bootstrap of NCCL.
#pragma once

#include <mpi.h>

#include <memory>
#include <vector>

#include "parallel/communicator.hpp"

namespace ringattn {

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `comm` (collective over it). MPI must be initialised.
  explicit MpiCommunicator(MPI_Comm comm);
  // A duplicate of MPI_COMM_WORLD.
  static std::unique_ptr<MpiCommunicator> world();
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::host; }
  std::string transport() const override { return "MPI"; }
  void exchange_start(const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes,
                      void* stream) override;
  void exchange_wait(void* stream) override;
  void all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(int color, int key) const override;
  void host_all_gather(const void* send, std::size_t bytes, void* recv) const override;

  // The duplicate this object owns (for bootstrapping NCCL: MPI_Bcast of its unique id).
  MPI_Comm handle() const { return comm_; }

 private:
  struct Adopt {};
  MpiCommunicator(MPI_Comm owned, Adopt);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<MPI_Request> pending_;
  int exchange_count_ = 0;  // tags the exchanges, so that two in flight never match each other
};

// The rank of this process among the ranks of `comm` on the same node
// (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)), and how many those are: a GPU backend picks its
// device as node_local_rank % device count.
int node_local_rank(const MpiCommunicator& comm);
int node_local_size(const MpiCommunicator& comm);

}  // namespace ringattn
