#include "parallel/cuda/collective_watchdog.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "ringattn/error.hpp"
#include "src/cuda/cuda_check.hpp"

namespace ringattn {
namespace {

constexpr const char* kTimeoutVariable = "RINGATTN_NCCL_TIMEOUT_S";

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

}  // namespace

double CollectiveWatchdog::timeout_from_environment() {
  const char* text = std::getenv(kTimeoutVariable);
  if (text == nullptr || *text == '\0') return kDefaultTimeoutS;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || errno != 0 || !std::isfinite(value) || value < 0) {
    detail::fail("NcclCommunicator", kTimeoutVariable, " is '", text,
                 "'; expected seconds >= 0 (0 turns the collective watchdog off; default ",
                 kDefaultTimeoutS, ")");
  }
  return value;
}

CollectiveWatchdog::CollectiveWatchdog(int rank, int device, double timeout_s, Health health,
                                       Fail fail)
    : rank_(rank),
      device_(device),
      timeout_s_(timeout_s),
      health_(std::move(health)),
      fail_(std::move(fail)) {
  if (active()) thread_ = std::thread([this] { run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (const Pending& p : pending_) RINGATTN_CUDA_LOG(cudaEventDestroy(p.event));
  for (cudaEvent_t e : spare_events_) RINGATTN_CUDA_LOG(cudaEventDestroy(e));
}

bool CollectiveWatchdog::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
}

cudaEvent_t CollectiveWatchdog::take_event() {
  if (!spare_events_.empty()) {
    cudaEvent_t e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CollectiveWatchdog::watch(cudaStream_t stream, std::string what) {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  cudaEvent_t e = take_event();
  RINGATTN_CUDA_CHECK(cudaEventRecord(e, stream));
  pending_.push_back({e, Clock::now(), std::move(what)});
}

CollectiveWatchdog::HostWait::HostWait(CollectiveWatchdog& dog, std::string what) : dog_(dog) {
  if (!dog_.active()) return;
  std::lock_guard<std::mutex> lock(dog_.mutex_);
  dog_.host_waiting_ = true;
  dog_.host_wait_since_ = Clock::now();
  dog_.host_wait_what_ = std::move(what);
}

CollectiveWatchdog::HostWait::~HostWait() {
  if (!dog_.active()) return;
  std::lock_guard<std::mutex> lock(dog_.mutex_);
  dog_.host_waiting_ = false;
}

std::string CollectiveWatchdog::waited_text(Clock::time_point since,
                                            const std::string& what) const {
  const double waited = std::chrono::duration<double>(Clock::now() - since).count();
  return "rank " + std::to_string(rank_) + ": " + what + " has not completed after " +
         seconds_text(waited) + " (" + kTimeoutVariable + "=" + seconds_text(timeout_s_) +
         "): a peer rank stopped, died or lost its link; aborting";
}

void CollectiveWatchdog::run() {
  // The runtime's current device is per thread: the events belong to the streams' device.
  if (cudaSetDevice(device_) != cudaSuccess) {
    std::fprintf(stderr, "ringattn: rank %d: the collective watchdog cannot select GPU %d\n",
                 rank_, device_);
    return;
  }
  const auto timeout = std::chrono::duration<double>(timeout_s_);
  // Polls often enough to fail within a tenth of the timeout (at most 100 ms late).
  const auto poll = std::chrono::duration_cast<Clock::duration>(
      std::min(std::chrono::duration<double>(0.1), timeout / 10));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, poll, [this] { return stopping_; });
    if (stopping_) break;
    std::string message;
    // Completed collectives leave the queue in order; the oldest pending one is the one to time.
    while (!pending_.empty()) {
      const cudaError_t status = cudaEventQuery(pending_.front().event);
      if (status == cudaErrorNotReady) break;
      if (status != cudaSuccess) {
        message = "rank " + std::to_string(rank_) + ": " + pending_.front().what +
                  " failed on the GPU: " + cudaGetErrorString(status);
        break;
      }
      spare_events_.push_back(pending_.front().event);
      pending_.pop_front();
    }
    const Clock::time_point now = Clock::now();
    if (message.empty() && !pending_.empty() && now - pending_.front().since >= timeout) {
      message = waited_text(pending_.front().since, pending_.front().what);
    }
    if (message.empty() && host_waiting_ && now - host_wait_since_ >= timeout) {
      message = waited_text(host_wait_since_, host_wait_what_);
    }
    if (message.empty() && health_) {
      lock.unlock();
      const std::string error = health_();
      lock.lock();
      if (!error.empty()) message = "rank " + std::to_string(rank_) + ": " + error;
    }
    if (message.empty()) continue;
    failed_ = true;
    lock.unlock();
    fail_(message);
    return;
  }
}

}  // namespace ringattn
