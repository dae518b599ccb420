// NcclCommunicator: the Communicator of device memory. Ring exchanges run on a dedicated
// communication stream, ordered after the caller's compute stream by an event and waited for by
// another event, so the ring loop never synchronises the host. Two ways to make one:
//   - from an MPI communicator: rank 0 creates the NCCL unique id and broadcasts it; metadata and
//     splits go through MPI;
//   - from an NCCL unique id that the caller handed to every rank itself (nccl_unique_id_bytes() on one
//     rank, broadcast over a torch.distributed group, say), with this rank and the number of
//     ranks: no MPI call is made. Metadata goes through NCCL (a small all-gather through device
//     memory), the exchanges go through NCCL only (the copy engines' handshakes need MPI), and
//     split is refused.
//
// Where every rank's next neighbour shares its node and its GPU can write into the neighbour's
// memory, the ring exchanges go by the copy engines instead (PeerExchange, peer_exchange.hpp):
// NCCL's send/receive kernels would hold multiprocessors the local block is using. The
// environment variable RINGATTN_EXCHANGE chooses: `auto` (the default: copy engines where they
// reach, for exchanges of 256 MiB and more), `copy` (copy engines for every exchange, or an error
// saying which link they cannot take) or `nccl`. It must be the same on every rank. All-reduces
// always go through NCCL.
//
// A CollectiveWatchdog (collective_watchdog.hpp) times every NCCL collective and the copy-engine
// exchange's host waits: one that has not completed after RINGATTN_NCCL_TIMEOUT_S seconds, or an
// asynchronous NCCL error, prints the rank and the operation, aborts the NCCL communicator and
// ends the process with status 1. For tests, RINGATTN_TEST_STALL_EXCHANGE=RANK:N makes rank RANK
// stop for good before its N-th ring exchange (counting from 1), as a hung peer would.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.hpp"
#include "parallel/cuda/collective_watchdog.hpp"
#include "parallel/cuda/peer_exchange.hpp"
#include "parallel/mpi_communicator.hpp"
#include "src/cuda/device_buffer.hpp"

namespace ringattn {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `mpi`'s ranks. The CUDA device of this rank must be current (see
  // select_node_local_device); the communicator stays on it.
  explicit NcclCommunicator(std::unique_ptr<MpiCommunicator> mpi);
  // Collective over the `size` ranks that pass the same `id`, on the CUDA device current now.
  NcclCommunicator(const ncclUniqueId& id, int rank, int size);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::device; }
  std::string transport() const override {
    if (!peer_) return "NCCL";
    if (peer_->copy_min_bytes() == 0) return "copy engines";
    return "copy engines from " + std::to_string(peer_->copy_min_bytes() >> 20) + " MiB, NCCL below";
  }
  void exchange_start(const void* send, std::size_t send_bytes, void* recv,
                      std::size_t recv_bytes, void* stream) override;
  void exchange_wait(void* stream) override;
  void exchange_finish(void* stream) override;
  void keep_memory(const void* data, std::size_t bytes) override;
  void release_kept_memory(double timeout_s) override;
  void measure_waits(bool on) override { measuring_ = on; }
  double take_waited_ms() override;
  void all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(int color, int key) const override;
  void host_all_gather(const void* send, std::size_t bytes, void* recv) const override;

  int device() const { return device_; }

 private:
  // What both constructors do once comm_ exists: the settings agreed between the ranks, the
  // watchdog, the copy engines where MPI can set them up.
  void start();

  std::unique_ptr<MpiCommunicator> mpi_;  // null for a communicator made from an NCCL unique id
  int rank_ = 0;
  int size_ = 1;
  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  // The device's highest priority: the transfer kernels take multiprocessors as the block's CTAs
  // retire, instead of waiting behind the rest of the block's grid.
  CudaStream comm_stream_{CudaStream::highest_priority()};
  CudaEvent compute_ready_;  // recorded on the caller's stream, waited on by comm_stream_
  CudaEvent transfer_done_;  // recorded on comm_stream_, waited on by the caller's stream
  std::unique_ptr<PeerExchange> peer_;  // the ring exchanges by the copy engines, where they reach
  bool measuring_ = false;
  std::vector<std::pair<CudaEvent, CudaEvent>> waits_;  // timing events around measured waits
  long long exchanges_ = 0;     // ring exchanges started
  long long stall_before_ = 0;  // RINGATTN_TEST_STALL_EXCHANGE's N for this rank, else 0
  // Without MPI: host_all_gather's device staging, grown to the largest gather so far.
  mutable DeviceBuffer gather_staging_;
  std::unique_ptr<CollectiveWatchdog> watchdog_;  // declared last: it goes first
};

// Makes GPU (node-local rank % GPUs on this node) current for this process and returns it;
// throws Error when the node has no GPU.
int select_node_local_device(const MpiCommunicator& comm);

}  // namespace ringattn
