// PeerExchange: the ring exchange of NcclCommunicator by the copy engines, for rings whose
// neighbours share a node and reach each other's memory (NVLink or PCIe peer access). Each rank
// writes its send buffer straight into the next rank's receive buffer with one cudaMemcpyAsync on
// the communication stream: no kernel runs, so a transfer takes no multiprocessor from the block
// computing beside it (NCCL 2.28 set up 32 p2p channels per peer between two H200, each channel a
// CTA of its send/receive kernel while the transfer runs).
//
// Per exchange, two small MPI messages order the GPUs without a host wait on either: the receiver
// records an interprocess event once its receive buffer is free and tells the sender where that
// buffer lies (a CUDA IPC handle and an offset); the sender's stream waits for that event, copies,
// records an event of its own and says so; the receiver's compute stream waits for that one. A
// receive buffer CUDA cannot export (memory from cuMemCreate, for one) goes through NCCL instead,
// for that exchange only: `start` says which halves NCCL must carry. So does one smaller than a
// threshold the receiver applies: a copy and its two event waits have a fixed cost that NCCL's
// kernels, beside the block, only repay on large transfers.
//
// Lifetime: a sender maps the next rank's receive buffers (CUDA IPC) for one ring call only.
// `finish`, after the call's last exchange, closes those mappings once the copies through them
// are done, and the receiver returns from it only after its sender has: once a ring call has
// returned, no other process holds a mapping of its buffers, so their owner may free them (CUDA
// leaves freeing an allocation that another process still maps undefined, and a mapping kept
// open holds the memory). Opening a buffer again in every call costs the sender's host up to
// 10 ms (512 MiB on an H200); `issue` does it once the compute beside the copy is queued.
// A receive buffer in an allocation its owner declared kept (`keep`: it stays allocated until
// `release_kept`, which is collective) says so in its message: the sender keeps that mapping
// between calls, and neither side's `finish` waits for it; `release_kept` closes those mappings
// with the same handshake.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ringattn {

class PeerExchange {
 public:
  // Collective over `comm` (each rank on its current device `device`). Null, with the reason in
  // `why`, where some rank's next neighbour is on another node or out of its GPU's peer reach.
  // Exchanges smaller than `copy_min_bytes` (judged by the receiver) go through NCCL.
  static std::unique_ptr<PeerExchange> create(MPI_Comm comm, int device,
                                              std::size_t copy_min_bytes, std::string& why);
  ~PeerExchange();
  PeerExchange(const PeerExchange&) = delete;
  PeerExchange& operator=(const PeerExchange&) = delete;

  // What NCCL still carries of one exchange.
  struct Fallback {
    bool send = false;  // the next rank's receive buffer could not be exported
    bool recv = false;  // this rank's receive buffer could not be exported
  };
  // Starts sending `send` to the next rank and receiving the previous rank's into `recv`: agrees
  // with both neighbours where the data goes. `compute` has produced `send` and is done with
  // `recv`; the copy itself waits for `issue` on a stream that already waits for `compute`.
  Fallback start(const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes,
                 cudaStream_t compute);
  // Queues on `comm_stream` the copies of the exchanges started since the last call, opening the
  // next rank's buffers where this call has not yet (a driver call of up to 10 ms on an H200 for
  // a buffer of 512 MiB), and tells the next rank. The caller makes it once the compute beside
  // the transfers is queued, so that the host's time here hides behind the GPU's.
  void issue(cudaStream_t comm_stream);
  // Makes `compute` wait for every receive started so far (the sends: the caller's own event).
  // After `issue`.
  void wait(cudaStream_t compute);
  // Ends one ring call's exchanges, after its last wait (see Lifetime above). Blocks the host
  // until this rank's copies into the next rank are done and the previous rank has closed its
  // mappings of this rank's buffers; neither stream waits.
  void finish(cudaStream_t comm_stream);
  // Exchanges smaller than this go through NCCL.
  std::size_t copy_min_bytes() const { return copy_min_bytes_; }
  // The allocation holding [data, data + bytes) stays allocated until release_kept (see Lifetime).
  // Between ring calls.
  void keep(const void* data, std::size_t bytes);
  // Collective, between ring calls: closes this rank's kept mappings of the next rank's buffers
  // (after the copies through them) and tells it so; waits at most `timeout_s` for the previous
  // rank to say the same, then forgets this rank's kept allocations.
  void release_kept(cudaStream_t comm_stream, double timeout_s);

 private:
  static constexpr int kSlots = 4;  // exchanges in flight at once are at most 2 (ring backward)
  struct Ready;                     // the receiver's message: where its buffer lies
  struct Mapping {
    cudaIpcMemHandle_t handle;
    void* base;
    bool kept;  // open until release_kept (else until the call's finish)
  };
  struct Export {
    unsigned long long id;  // the allocation's process-wide unique id (never reused)
    cudaIpcMemHandle_t handle;
  };
  struct Outbound {  // a send whose copy `issue` queues
    std::uint64_t sequence;
    bool copy;  // by the copy engines (else NCCL carries it, or it is empty)
    cudaIpcMemHandle_t handle;
    bool kept;
    std::uint64_t offset;
    const void* send;
    std::size_t bytes;
  };
  struct Pending {
    std::uint64_t sequence;
    bool copied;  // by the copy engines (else NCCL carried it)
  };
  PeerExchange(MPI_Comm comm, int rank, int size, std::size_t copy_min_bytes);
  void* map(const cudaIpcMemHandle_t& handle, bool kept);  // opened once a call, or kept
  // Closes the mappings that are kept (or those that are not) once comm_stream's copies are done.
  void close_mappings(bool kept, cudaStream_t comm_stream);
  // Sends `count` (a member: it stays until the request completes) to the next rank, eagerly.
  void tell_next(const std::uint64_t& count, int tag);
  // Waits for this rank's small messages (sent eagerly, so at once) and lets go of them.
  void complete_sends();
  // This rank's allocation `base` (unique id `id`) as an IPC handle; false where CUDA cannot
  // export it. Handles are kept per allocation, since getting one costs a driver call.
  bool export_handle(void* base, unsigned long long id, cudaIpcMemHandle_t& handle);

  MPI_Comm comm_;
  int rank_, next_, previous_;
  std::size_t copy_min_bytes_;
  std::uint64_t sequence_ = 0;
  std::uint64_t finished_ = 0;  // the sequence number `finish` tells the next rank
  bool owes_release_ = false;   // the next rank exported a buffer to this one in this call
  bool awaits_release_ = false; // this rank exported a buffer to the previous one in this call
  bool holds_kept_ = false;      // the next rank lent this one a kept buffer since release_kept
  bool lent_kept_ = false;       // this rank lent the previous one a kept buffer since then
  std::uint64_t releases_ = 0;   // release_kept calls so far (the ranks' must match)
  std::vector<unsigned long long> kept_ids_;          // this rank's kept allocations
  std::vector<std::pair<const void*, std::size_t>> kept_ranges_;  // as keep named them
  std::array<cudaEvent_t, kSlots> free_{};            // ours: this rank's receive buffer is free
  std::array<cudaEvent_t, kSlots> copied_{};          // ours: our copy into the next rank is done
  std::array<cudaEvent_t, kSlots> next_free_{};       // the next rank's free_, opened here
  std::array<cudaEvent_t, kSlots> previous_copied_{}; // the previous rank's copied_, opened here
  std::vector<std::unique_ptr<Ready>> outgoing_;      // messages whose sends are in flight
  std::vector<MPI_Request> requests_;
  std::vector<Outbound> outbound_;                    // sends not yet issued
  std::vector<Pending> pending_;                      // receives not yet waited for
  std::vector<Mapping> mappings_;                     // the next rank's buffers, open this call
  std::vector<Export> exports_;                       // this rank's buffers, exported
};

}  // namespace ringattn
