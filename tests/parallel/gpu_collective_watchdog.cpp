// CollectiveWatchdog on one GPU, with a stream held back the way a lost peer holds NCCL's kernels:
// a host function enqueued on the stream blocks until the test lets it go, so work watched behind
// it stays pending. The watchdog must fail once that work has been pending for its timeout (and
// not before: work that completes in time, and a healthy communicator, never fail), with a message
// naming the rank, the operation, the wait and the setting; a host wait is timed the same way; an
// asynchronous error reported by `health` fails at once with its text. The fail callback here
// records the message instead of ending the process, as NcclCommunicator's does. Timings are
// bounds on when the failure came (it is polled every tenth of the timeout), not speed claims.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "ringattn/config.h"
#include "tests/common/gpu.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "parallel/cuda/collective_watchdog.hpp"
#include "src/cuda/device_buffer.hpp"
#endif

namespace ringattn {
namespace {

#if RINGATTN_WITH_CUDA

using Clock = std::chrono::steady_clock;

// What the fail callback saw.
struct Failure {
  std::mutex mutex;
  std::string message;
  Clock::time_point at;
  int calls = 0;

  void record(const std::string& text) {
    std::lock_guard<std::mutex> lock(mutex);
    message = text;
    at = Clock::now();
    ++calls;
  }
  int count() {
    std::lock_guard<std::mutex> lock(mutex);
    return calls;
  }
};

// Holds a stream at a host function until release().
struct StreamGate {
  std::atomic<bool> open{false};
  static void CUDART_CB hold(void* data) {
    auto* gate = static_cast<StreamGate*>(data);
    while (!gate->open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void close_on(cudaStream_t stream) {
    ASSERT_EQ(cudaLaunchHostFunc(stream, &StreamGate::hold, this), cudaSuccess);
  }
  void release() { open = true; }
};

int current_device() {
  int device = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  return device;
}

// Waits up to `limit` for the callback; true when it came.
bool wait_for_failure(Failure& failure, std::chrono::duration<double> limit) {
  const Clock::time_point end = Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
  while (Clock::now() < end) {
    if (failure.count() > 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return failure.count() > 0;
}

TEST(CollectiveWatchdog, FailsOnWorkPendingPastTheTimeout) {
  RINGATTN_REQUIRE_GPUS(1);
  CudaStream stream;
  StreamGate gate;
  Failure failure;
  constexpr double kTimeout = 0.5;
  Clock::time_point watched;
  {
    CollectiveWatchdog dog(3, current_device(), kTimeout, nullptr,
                           [&](const std::string& m) { failure.record(m); });
    gate.close_on(stream.get());
    watched = Clock::now();
    dog.watch(stream.get(), "ring exchange 7 over NCCL (to rank 0, from rank 2)");
    const bool failed = wait_for_failure(failure, std::chrono::duration<double>(5 * kTimeout));
    gate.release();
    ASSERT_TRUE(failed) << "no failure " << 5 * kTimeout << " s after the work was held";
    EXPECT_TRUE(dog.failed());
    ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  }
  const double after = std::chrono::duration<double>(failure.at - watched).count();
  EXPECT_GE(after, kTimeout) << "failed before the timeout";
  EXPECT_LE(after, kTimeout + 0.5) << "failed long after the timeout";
  EXPECT_EQ(failure.count(), 1);
  for (const char* part : {"rank 3: ", "ring exchange 7 over NCCL (to rank 0, from rank 2)",
                           "has not completed after", "RINGATTN_NCCL_TIMEOUT_S=0.5 s",
                           "a peer rank stopped, died or lost its link"}) {
    EXPECT_NE(failure.message.find(part), std::string::npos)
        << "'" << part << "' missing from: " << failure.message;
  }
}

TEST(CollectiveWatchdog, WorkThatCompletesInTimeNeverFails) {
  RINGATTN_REQUIRE_GPUS(1);
  CudaStream stream;
  Failure failure;
  constexpr double kTimeout = 0.3;
  CollectiveWatchdog dog(0, current_device(), kTimeout, [] { return std::string(); },
                         [&](const std::string& m) { failure.record(m); });
  // Work held for less than the timeout, many times over several timeouts.
  for (int i = 0; i < 12; ++i) {
    StreamGate gate;
    gate.close_on(stream.get());
    dog.watch(stream.get(), "an all-reduce");
    std::this_thread::sleep_for(std::chrono::duration<double>(kTimeout / 3));
    gate.release();
    ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(2 * kTimeout));
  EXPECT_EQ(failure.count(), 0) << failure.message;
  EXPECT_FALSE(dog.failed());
}

TEST(CollectiveWatchdog, TimesHostWaits) {
  RINGATTN_REQUIRE_GPUS(1);
  Failure failure;
  constexpr double kTimeout = 0.4;
  CollectiveWatchdog dog(1, current_device(), kTimeout, nullptr,
                         [&](const std::string& m) { failure.record(m); });
  {
    CollectiveWatchdog::HostWait short_wait(dog, "a short wait");
    std::this_thread::sleep_for(std::chrono::duration<double>(kTimeout / 4));
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(2 * kTimeout));
  EXPECT_EQ(failure.count(), 0) << "a wait that ended failed: " << failure.message;
  const Clock::time_point begun = Clock::now();
  CollectiveWatchdog::HostWait waiting(dog, "ring exchange 2 by the copy engines (waiting for rank 0)");
  ASSERT_TRUE(wait_for_failure(failure, std::chrono::duration<double>(5 * kTimeout)));
  EXPECT_GE(std::chrono::duration<double>(failure.at - begun).count(), kTimeout);
  EXPECT_NE(failure.message.find("rank 1: ring exchange 2 by the copy engines (waiting for rank 0) "
                                 "has not completed after"),
            std::string::npos)
      << failure.message;
}

TEST(CollectiveWatchdog, AnAsynchronousErrorFailsAtOnce) {
  RINGATTN_REQUIRE_GPUS(1);
  Failure failure;
  std::atomic<bool> broken{false};
  CollectiveWatchdog dog(2, current_device(), 60.0,
                         [&] { return broken ? std::string("NCCL reports remote process exited") : std::string(); },
                         [&](const std::string& m) { failure.record(m); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(failure.count(), 0);
  const Clock::time_point at = Clock::now();
  broken = true;
  ASSERT_TRUE(wait_for_failure(failure, std::chrono::seconds(2)));
  EXPECT_LE(std::chrono::duration<double>(failure.at - at).count(), 0.5);
  EXPECT_EQ(failure.message, "rank 2: NCCL reports remote process exited");
}

TEST(CollectiveWatchdog, ZeroTimeoutWatchesNothing) {
  RINGATTN_REQUIRE_GPUS(1);
  CudaStream stream;
  StreamGate gate;
  Failure failure;
  {
    CollectiveWatchdog dog(0, current_device(), 0.0, nullptr,
                           [&](const std::string& m) { failure.record(m); });
    EXPECT_FALSE(dog.active());
    gate.close_on(stream.get());
    dog.watch(stream.get(), "held");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate.release();
  }
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  EXPECT_EQ(failure.count(), 0) << failure.message;
}

#endif  // RINGATTN_WITH_CUDA

// The setting is read and checked on any machine that builds the CUDA backend.
#if RINGATTN_WITH_CUDA
TEST(CollectiveWatchdog, TimeoutSettingIsChecked) {
  const char* saved = std::getenv("RINGATTN_NCCL_TIMEOUT_S");
  const std::string restore = saved == nullptr ? "" : saved;
  unsetenv("RINGATTN_NCCL_TIMEOUT_S");
  EXPECT_EQ(CollectiveWatchdog::timeout_from_environment(), 600.0);
  setenv("RINGATTN_NCCL_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(CollectiveWatchdog::timeout_from_environment(), 2.5);
  setenv("RINGATTN_NCCL_TIMEOUT_S", "0", 1);
  EXPECT_EQ(CollectiveWatchdog::timeout_from_environment(), 0.0);
  for (const char* bad : {"-1", "ten", "5s", "nan", "inf"}) {
    setenv("RINGATTN_NCCL_TIMEOUT_S", bad, 1);
    try {
      CollectiveWatchdog::timeout_from_environment();
      ADD_FAILURE() << "RINGATTN_NCCL_TIMEOUT_S=" << bad << " was accepted";
    } catch (const std::exception& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(std::string("RINGATTN_NCCL_TIMEOUT_S is '") + bad + "'"),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("expected seconds >= 0"), std::string::npos) << message;
    }
  }
  if (saved == nullptr) {
    unsetenv("RINGATTN_NCCL_TIMEOUT_S");
  } else {
    setenv("RINGATTN_NCCL_TIMEOUT_S", restore.c_str(), 1);
  }
}
#endif

}  // namespace
}  // namespace ringattn
