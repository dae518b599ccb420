#include "src/thread_pool.hpp"

#if defined(__linux__)
#include <sched.h>
#endif

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"

namespace ringattn {
namespace {

// The CPUs this process may run on: its affinity mask where the system has one (mpirun's binding
// and taskset narrow it; a pool wider than the mask would time-share its cores), else the
// hardware's count.
int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

int threads_from_environment() {
  if (const char* text = std::getenv("RINGATTN_NUM_THREADS"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (*end != '\0' || value < 1 || value > 4096) {
      detail::fail("RINGATTN_NUM_THREADS", "value '", text, "' is not a thread count in [1, 4096]");
    }
    return static_cast<int>(value);
  }
  return available_cpus();
}

// Workers wait for a job (a generation number changes), claim indices from a shared counter and
// report when they leave the job. The caller takes part too, so a pool of n threads has n - 1
// workers.
class ThreadPool {
 public:
  explicit ThreadPool(int threads) { resize(threads); }
  ~ThreadPool() { stop_workers(); }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int threads) {
    std::lock_guard run_lock(run_mutex_);
    stop_workers();
    stopping_ = false;
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this, seen = generation_] { work(seen); });
    }
  }

  void run(std::int64_t count, const std::function<void(std::int64_t)>& body) {
    std::lock_guard run_lock(run_mutex_);
    {
      std::lock_guard lock(mutex_);
      body_ = &body;
      count_ = count;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    claim_and_run();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void claim_and_run() {
    inside_pool = true;
    for (std::int64_t i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) {
      try {
        (*body_)(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(count_);  // stop handing out work
      }
    }
    inside_pool = false;
  }

  void work(std::uint64_t seen) {
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
      }
      claim_and_run();
      {
        std::lock_guard lock(mutex_);
        if (--active_ == 0) done_.notify_one();
      }
    }
  }

  void stop_workers() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
  }

 public:
  static thread_local bool inside_pool;

 private:
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(std::int64_t)>* body_ = nullptr;
  std::int64_t count_ = 0;
  std::atomic<std::int64_t> next_{0};
  int active_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

thread_local bool ThreadPool::inside_pool = false;

ThreadPool& pool() {
  static ThreadPool instance(threads_from_environment());
  return instance;
}

}  // namespace

namespace detail {

void parallel_for(std::int64_t count, const std::function<void(std::int64_t)>& body) {
  if (count <= 0) return;
  if (count == 1 || ThreadPool::inside_pool || pool().size() == 1) {
    for (std::int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  pool().run(count, body);
}

}  // namespace detail

namespace cpu {

int num_threads() { return pool().size(); }

void set_num_threads(int threads) {
  if (threads < 1 || threads > 4096) {
    detail::fail("cpu::set_num_threads", "threads is ", threads, "; expected 1 to 4096");
  }
  pool().resize(threads);
}

}  // namespace cpu
}  // namespace ringattn
