// Communicator: the one interface the ring schedule talks to. Two implementations: MPI on host
// memory (mpi_communicator.hpp) and NCCL on device memory with CUDA streams; the ring is written
// once against this class, so the CPU ranks of the tests run the schedule of the GPU ranks.
//
// Every call is collective over the communicator's ranks unless it says otherwise: all ranks make
// the same calls in the same order with matching sizes.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ringattn/dtype.hpp"
#include "ringattn/error.hpp"
#include "ringattn/tensor.hpp"

namespace ringattn {

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The memory the data calls move: host for MPI, device for NCCL.
  virtual Memory memory() const = 0;
  // How the data moves, for people and benchmark records: "MPI", "NCCL", "copy engines".
  virtual std::string transport() const = 0;

  // One step of a ring: send `send_bytes` to rank + 1 and receive `recv_bytes` from rank - 1
  // (modulo size), asynchronously. On a stream backend the transfer starts after the work already
  // queued on `stream` (a cudaStream_t; the MPI backend ignores it). Several exchanges may be in
  // flight; they complete in the order they were started. Neither buffer may be touched until
  // exchange_wait.
  virtual void exchange_start(const void* send, std::size_t send_bytes, void* recv,
                              std::size_t recv_bytes, void* stream) = 0;
  // Completes every exchange started since the last wait: host code after this call (MPI), or
  // work queued on `stream` after it (NCCL: the stream waits on an event, the host does not),
  // sees the received data and may reuse the send buffers.
  virtual void exchange_wait(void* stream) = 0;
  // Ends one ring call's exchanges, after its last exchange_wait. A backend that writes straight
  // into other ranks' buffers (the copy engines) lets go of them here: once this returns on a
  // rank, no other rank holds a mapping of that rank's receive buffers, and its caller may free
  // them (stream order still applies to its own queued work). The host may block until the
  // transfers are done; no stream waits. The MPI backend has nothing to do.
  virtual void exchange_finish(void* stream) { (void)stream; }
  // Receive buffers that persist: `data` (bytes long) lies in memory its owner keeps allocated,
  // at this address, until release_kept_memory has returned on every rank. A backend that writes
  // into other ranks' buffers may then keep what it set up for them between ring calls (the copy
  // engines: the sender's CUDA IPC mapping, whose opening and closing costs the host milliseconds
  // a call), and exchange_finish does not let go of them. The MPI backend ignores both.
  virtual void keep_memory(const void* data, std::size_t bytes) {
    (void)data;
    (void)bytes;
  }
  // Collective: lets go of everything kept for the memory keep_memory named on any rank; once it
  // returns on a rank, no other rank holds a mapping of that rank's memory, and its owner may
  // free it. Waits for the previous rank at most `timeout_s` seconds (then warns on stderr and
  // returns), so a rank that never comes cannot hang the others.
  virtual void release_kept_memory(double timeout_s = 60.0) { (void)timeout_s; }
  // For benchmarks: while measuring, each exchange_wait on a stream backend records how long its
  // stream then waits for transfers still running (events on either side of the wait);
  // take_waited_ms() waits for those events, returns the sum since the last call and clears it.
  // The MPI backend returns 0 (its waits block the host, which the caller times itself).
  virtual void measure_waits(bool on) { (void)on; }
  virtual double take_waited_ms() { return 0.0; }

  // In place: data[i] = sum over ranks of data[i], `count` elements of `dtype`, ordered on
  // `stream` like exchange_start.
  virtual void all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) = 0;
  // Returns when every rank has entered it (host side).
  virtual void barrier() = 0;
  // Groups of a dp x cp mesh: ranks with the same `color` (>= 0) form one communicator, ordered
  // by `key` then by rank here, so ranks with adjacent keys are ring neighbours.
  virtual std::unique_ptr<Communicator> split(int color, int key) const = 0;

  // Small metadata on the host, whatever memory() is (NCCL goes through the MPI communicator it
  // was bootstrapped from): every rank sends `bytes` and receives size() * bytes, in rank order.
  virtual void host_all_gather(const void* send, std::size_t bytes, void* recv) const = 0;
};

// In place on the host whatever memory() is: values[i] = sum over ranks of values[i], summed in
// rank order (the same bits on every rank and in every run). For scalars and small vectors.
void host_all_reduce_sum(const Communicator& comm, double* values, std::size_t count);

// Every rank's text, in rank order (two host_all_gather: the lengths, then the bytes).
std::vector<std::string> all_gather_text(const Communicator& comm, std::string_view text);

// What check_same_on_all_ranks and check_no_rank_failed throw: every rank of a communicator of
// ranks() ranks throws it alike. A program whose world is that communicator may report it once and
// end normally; any other error is one rank's, which the others may be waiting for.
class CollectiveError : public Error {
 public:
  CollectiveError(std::string where, const std::string& message, ErrorKind kind, int ranks)
      : Error(std::move(where), message, kind), ranks_(ranks) {}
  int ranks() const noexcept { return ranks_; }

 private:
  int ranks_;
};

// Throws CollectiveError(where, ...) on every rank, with the same message, when `description` differs
// between ranks; returns on every rank otherwise. A description made of items separated by "; "
// ("q [1, 512, 8, 64] bf16; k [1, 512, 8, 64] bf16; causal true") is compared item by item and
// the message names the items that differ and which ranks hold which value, the odd ones out
// first when most ranks agree, else in rank order:
//   rank 1 has q [1, 512, 8, 64] bf16 but ranks 0, 2, 3 have q [1, 512, 4, 64] bf16
//   rank 0 has causal false but rank 1 has causal true
// Collective, so that a mismatch fails everywhere instead of leaving ranks waiting for a peer.
void check_same_on_all_ranks(const Communicator& comm, const char* where,
                             const std::string& description);

// Throws CollectiveError(where, ...) on every rank, with the same message, when any rank passes a
// `local_error` (a check that failed there; nullptr where none did): the message names the ranks
// that failed and their messages, the kind is that of the lowest failing rank. Returns on every
// rank when none failed.
void check_no_rank_failed(const Communicator& comm, const char* where, const Error* local_error);

}  // namespace ringattn
