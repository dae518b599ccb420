// CollectiveWatchdog: a thread that ends what a lost or stopped peer would otherwise block
// forever. NCCL's kernels wait on the GPU for a peer that never comes, and every host call that
// waits for them (a stream or event synchronisation, a copy) waits with them; an MPI receive from
// a stopped peer does the same on the host. The watchdog sees both:
//   - watch(stream, what) records an event on `stream` behind the collective just enqueued; the
//     thread polls the oldest events and, once one has been pending for `timeout_s`, fails;
//   - HostWait marks a blocking host wait (the copy-engine exchange's MPI receive) for the same
//     deadline;
//   - `health` (ncclCommGetAsyncError for NCCL) is polled too: an asynchronous error fails at once.
// To fail, the thread calls `fail` with a message that names the rank, the operation, how long it
// waited and the setting; NcclCommunicator's `fail` prints it, aborts the NCCL communicator
// (ncclCommAbort) and ends the process with status 1, so that the launcher (mpiexec) takes the
// other ranks down within its own few seconds, as PyTorch's NCCL watchdog does by default.
//
// The timeout is RINGATTN_NCCL_TIMEOUT_S (seconds, default 600; 0 turns the watchdog off), read
// once per communicator. A collective's event completes only after everything queued before it on
// its stream, so the timeout must exceed the longest stretch of GPU work between two collectives
// (one layer's attention block): the default leaves minutes to spare at any length that fits.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ringattn {

class CollectiveWatchdog {
 public:
  // The error text of an asynchronous failure, or "" while healthy. Called from the thread.
  using Health = std::function<std::string()>;
  // Called once, from the thread, with the message; expected not to return (it may, in tests).
  using Fail = std::function<void(const std::string& message)>;

  // `rank` only names this process in messages; `device` is the CUDA device of the streams
  // watched. A timeout of 0 starts no thread: watch() and HostWait then do nothing.
  CollectiveWatchdog(int rank, int device, double timeout_s, Health health, Fail fail);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  double timeout_s() const { return timeout_s_; }
  bool active() const { return timeout_s_ > 0; }
  // Whether the thread has failed (the process normally ends right after).
  bool failed() const;

  // Watches the work enqueued on `stream` so far; `what` names it in the message ("the ring
  // exchange with ranks 1 and 3", "an all-reduce of 4096 f32").
  void watch(cudaStream_t stream, std::string what);

  // Marks a blocking host wait from construction to destruction.
  class HostWait {
   public:
    HostWait(CollectiveWatchdog& dog, std::string what);
    ~HostWait();
    HostWait(const HostWait&) = delete;
    HostWait& operator=(const HostWait&) = delete;

   private:
    CollectiveWatchdog& dog_;
  };

  static constexpr double kDefaultTimeoutS = 600.0;
  // RINGATTN_NCCL_TIMEOUT_S: kDefaultTimeoutS when unset; a number >= 0 otherwise, else Error
  // naming the value.
  static double timeout_from_environment();

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    cudaEvent_t event;
    Clock::time_point since;
    std::string what;
  };

  void run();
  cudaEvent_t take_event();  // under mutex_
  std::string waited_text(Clock::time_point since, const std::string& what) const;

  const int rank_;
  const int device_;
  const double timeout_s_;
  Health health_;
  Fail fail_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool failed_ = false;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> spare_events_;
  bool host_waiting_ = false;
  Clock::time_point host_wait_since_;
  std::string host_wait_what_;
  std::thread thread_;
};

}  // namespace ringattn
