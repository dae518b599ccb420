#include "parallel/cuda/nccl_communicator.hpp"

#include "parallel/device_communicator.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <string>
#include <string_view>
#include <vector>

#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "src/cuda/cuda_check.hpp"
#include "src/mpi_check.hpp"

namespace ringattn {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
  }
  detail::fail("NcclCommunicator", "unknown dtype value ", static_cast<int>(dtype));
}

// RINGATTN_EXCHANGE: 0 auto, 1 copy engines, 2 NCCL.
int exchange_choice() {
  const char* text = std::getenv("RINGATTN_EXCHANGE");
  const std::string_view value = text == nullptr ? "" : text;
  if (value.empty() || value == "auto") return 0;
  if (value == "copy") return 1;
  if (value == "nccl") return 2;
  detail::fail("NcclCommunicator", "RINGATTN_EXCHANGE is '", value,
               "'; expected auto, copy or nccl");
}

// RINGATTN_TEST_STALL_EXCHANGE=RANK:N: N (from 1) when RANK is `rank`, else 0.
long long stall_exchange(int rank) {
  const char* text = std::getenv("RINGATTN_TEST_STALL_EXCHANGE");
  if (text == nullptr || *text == '\0') return 0;
  int stall_rank = -1;
  long long n = 0;
  char tail = 0;
  if (std::sscanf(text, "%d:%lld%c", &stall_rank, &n, &tail) != 2 || stall_rank < 0 || n < 1) {
    detail::fail("NcclCommunicator", "RINGATTN_TEST_STALL_EXCHANGE is '", text,
                 "'; expected RANK:N with N >= 1 (a test's hung peer)");
  }
  return stall_rank == rank ? n : 0;
}

}  // namespace

int select_node_local_device(const MpiCommunicator& comm) {
  int devices = 0;
  RINGATTN_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices == 0) detail::fail_as(ErrorKind::unsupported, "select_node_local_device", "no CUDA GPU on this node");
  const int device = node_local_rank(comm) % devices;
  RINGATTN_CUDA_CHECK(cudaSetDevice(device));
  return device;
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<MpiCommunicator> mpi) : mpi_(std::move(mpi)) {
  if (!mpi_) detail::fail("NcclCommunicator", "the MPI communicator is null");
  rank_ = mpi_->rank();
  size_ = mpi_->size();
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device_));
  ncclUniqueId id{};
  if (rank_ == 0) RINGATTN_NCCL_CHECK(ncclGetUniqueId(&id));
  RINGATTN_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi_->handle()));
  RINGATTN_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  start();
}

NcclCommunicator::NcclCommunicator(const ncclUniqueId& id, int rank, int size) : rank_(rank), size_(size) {
  if (size < 1 || rank < 0 || rank >= size) {
    detail::fail("NcclCommunicator", "rank ", rank, " of ", size, " ranks; expected 0 <= rank < size");
  }
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device_));
  RINGATTN_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  start();
}

void NcclCommunicator::start() {
  // The exchange path and the watchdog's timeout, the same on every rank: a bad or differing
  // RINGATTN_EXCHANGE or RINGATTN_NCCL_TIMEOUT_S fails on all. The watchdog starts first (with the
  // default timeout where this rank's setting is bad): without MPI, the agreement itself is an
  // NCCL collective, which it watches.
  std::optional<Error> local_error;
  int choice = 0;
  double timeout_s = CollectiveWatchdog::kDefaultTimeoutS;
  try {
    choice = exchange_choice();
    timeout_s = CollectiveWatchdog::timeout_from_environment();
    stall_before_ = stall_exchange(rank_);
    if (choice == 1 && !mpi_ && size_ > 1) {
      detail::fail_as(ErrorKind::unsupported, "NcclCommunicator",
                      "RINGATTN_EXCHANGE=copy, but a ring made from an NCCL unique id has no MPI "
                      "to set the copy engines up; use auto or nccl, or make the ring over MPI");
    }
  } catch (const Error& error) {
    local_error = error;
  }
  ncclComm_t comm = comm_;
  watchdog_ = std::make_unique<CollectiveWatchdog>(
      rank_, device_, timeout_s,
      [comm]() -> std::string {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return "";
        if (state == ncclSuccess || state == ncclInProgress) return "";
        return std::string("NCCL reports an asynchronous error: ") + ncclGetErrorString(state) +
               " (" + ncclGetLastError(comm) + "); aborting";
      },
      [comm](const std::string& message) {
        std::fprintf(stderr, "ringattn: %s\n", message.c_str());
        std::fflush(stderr);
        ncclCommAbort(comm);
        std::_Exit(1);
      });
  check_no_rank_failed(*this, "NcclCommunicator", local_error ? &*local_error : nullptr);
  check_same_on_all_ranks(*this, "NcclCommunicator",
                          "RINGATTN_EXCHANGE " + std::to_string(choice) +
                              ", RINGATTN_NCCL_TIMEOUT_S " + std::to_string(timeout_s));
  if (choice == 2 || size_ == 1 || !mpi_) return;
  std::string why;
  // auto: the copy engines from 256 MiB an exchange (the 128k-token ring with 16 K/V heads moves
  // 256 and 512 MiB); below that, copies were no faster than NCCL on two H200 (RINGATTN_EXCHANGE
  // in bench/results/ring-bench-2xh200-2026-11-30.md).
  constexpr std::size_t kAutoCopyMinBytes = std::size_t{256} << 20;
  peer_ = PeerExchange::create(mpi_->handle(), device_, choice == 1 ? 0 : kAutoCopyMinBytes, why);
  if (peer_ == nullptr && choice == 1) {
    detail::fail_as(ErrorKind::unsupported, "NcclCommunicator",
                    "RINGATTN_EXCHANGE=copy, but the copy engines cannot carry the ring: ", why);
  }
}

NcclCommunicator::~NcclCommunicator() {
  // Transfers still queued must finish before the communicator goes (the watchdog still times
  // them); destructors only log.
  RINGATTN_CUDA_LOG(cudaStreamSynchronize(comm_stream_.get()));
  watchdog_.reset();
  if (comm_ != nullptr) {
    const ncclResult_t status = ncclCommDestroy(comm_);
    if (status != ncclSuccess) std::fprintf(stderr, "ringattn: ncclCommDestroy failed: %s\n", ncclGetErrorString(status));
  }
}

void NcclCommunicator::exchange_start(const void* send, std::size_t send_bytes, void* recv,
                                      std::size_t recv_bytes, void* stream) {
  const auto compute = static_cast<cudaStream_t>(stream);
  if (++exchanges_ == stall_before_) {
    std::fprintf(stderr, "ringattn: rank %d stops for good before ring exchange %lld "
                 "(RINGATTN_TEST_STALL_EXCHANGE)\n", rank(), exchanges_);
    std::fflush(stderr);
    while (true) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  compute_ready_.record(compute);
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_.get(), compute_ready_.get(), 0));
  const int n = size(), next = (rank() + 1) % n, previous = (rank() + n - 1) % n;
  if (n == 1) {
    if (send_bytes != recv_bytes) {
      detail::fail("NcclCommunicator::exchange_start", "one rank sends ", send_bytes,
                   " bytes to itself but receives ", recv_bytes);
    }
    RINGATTN_CUDA_CHECK(cudaMemcpyAsync(recv, send, send_bytes, cudaMemcpyDeviceToDevice, comm_stream_.get()));
  } else {
    PeerExchange::Fallback nccl{true, true};
    if (peer_) nccl = peer_->start(send, send_bytes, recv, recv_bytes, compute);
    if (nccl.send || nccl.recv) {
      RINGATTN_NCCL_CHECK(ncclGroupStart());
      if (nccl.send) RINGATTN_NCCL_CHECK(ncclSend(send, send_bytes, ncclUint8, next, comm_, comm_stream_.get()));
      if (nccl.recv) RINGATTN_NCCL_CHECK(ncclRecv(recv, recv_bytes, ncclUint8, previous, comm_, comm_stream_.get()));
      RINGATTN_NCCL_CHECK(ncclGroupEnd());
      watchdog_->watch(comm_stream_.get(),
                       "ring exchange " + std::to_string(exchanges_) + " over NCCL (to rank " +
                           std::to_string(next) + ", from rank " + std::to_string(previous) + ")");
    }
  }
}

void NcclCommunicator::exchange_wait(void* stream) {
  const auto compute = static_cast<cudaStream_t>(stream);
  if (measuring_) {
    waits_.emplace_back(CudaEvent(cudaEventDefault), CudaEvent(cudaEventDefault));
    waits_.back().first.record(compute);
  }
  if (peer_) peer_->issue(comm_stream_.get());
  // comm_stream_ runs in order: this record covers every exchange started so far, the copies out
  // of the send buffers included.
  transfer_done_.record(comm_stream_.get());
  if (peer_) {
    const int previous = (rank() + size() - 1) % size();
    CollectiveWatchdog::HostWait waiting(
        *watchdog_, "ring exchange " + std::to_string(exchanges_) +
                        " by the copy engines (waiting for rank " + std::to_string(previous) + ")");
    peer_->wait(compute);
  }
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(compute, transfer_done_.get(), 0));
  if (measuring_) waits_.back().second.record(compute);
}

void NcclCommunicator::exchange_finish(void* stream) {
  (void)stream;
  if (peer_) peer_->finish(comm_stream_.get());
}

void NcclCommunicator::keep_memory(const void* data, std::size_t bytes) {
  if (peer_) peer_->keep(data, bytes);
}

void NcclCommunicator::release_kept_memory(double timeout_s) {
  if (peer_) peer_->release_kept(comm_stream_.get(), timeout_s);
}

double NcclCommunicator::take_waited_ms() {
  double total = 0.0;
  for (const auto& [before, after] : waits_) {
    RINGATTN_CUDA_CHECK(cudaEventSynchronize(after.get()));
    float ms = 0.0f;
    RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, before.get(), after.get()));
    total += ms;
  }
  waits_.clear();
  return total;
}

void NcclCommunicator::all_reduce_sum(void* data, std::size_t count, DType dtype, void* stream) {
  RINGATTN_NCCL_CHECK(ncclAllReduce(data, data, count, nccl_type(dtype), ncclSum, comm_,
                                    static_cast<cudaStream_t>(stream)));
  watchdog_->watch(static_cast<cudaStream_t>(stream),
                   "an all-reduce of " + std::to_string(count) + " " +
                       std::string(dtype_name(dtype)) + " over NCCL");
}

void NcclCommunicator::barrier() {
  if (mpi_) {
    mpi_->barrier();
    return;
  }
  const unsigned char mine = 0;
  std::vector<unsigned char> all(static_cast<std::size_t>(size_));
  host_all_gather(&mine, 1, all.data());
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) const {
  if (!mpi_) {
    detail::fail_as(ErrorKind::unsupported, "NcclCommunicator::split",
                    "a communicator made from an NCCL unique id cannot split; make one per group, "
                    "each from its own unique id");
  }
  std::unique_ptr<Communicator> group = mpi_->split(color, key);
  auto* mpi_group = dynamic_cast<MpiCommunicator*>(group.get());
  if (mpi_group == nullptr) detail::fail("NcclCommunicator::split", "the MPI split gave no MPI communicator");
  group.release();
  return std::make_unique<NcclCommunicator>(std::unique_ptr<MpiCommunicator>(mpi_group));
}

void NcclCommunicator::host_all_gather(const void* send, std::size_t bytes, void* recv) const {
  if (mpi_) {
    mpi_->host_all_gather(send, bytes, recv);
    return;
  }
  if (bytes == 0) return;
  // Through device memory on the communication stream, behind any exchange still queued there
  // (every rank queues its collectives in the same order), waited for by the host.
  const std::size_t total = bytes * static_cast<std::size_t>(size_);
  if (gather_staging_.bytes() < total) gather_staging_ = DeviceBuffer(total);
  auto* staging = gather_staging_.as<unsigned char>();
  unsigned char* slot = staging + bytes * static_cast<std::size_t>(rank_);
  const cudaStream_t stream = comm_stream_.get();
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(slot, send, bytes, cudaMemcpyHostToDevice, stream));
  RINGATTN_NCCL_CHECK(ncclAllGather(slot, staging, bytes, ncclUint8, comm_, stream));
  watchdog_->watch(stream, "an all-gather of " + std::to_string(bytes) + " bytes of metadata over NCCL");
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(recv, staging, total, cudaMemcpyDeviceToHost, stream));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
}

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "NCCL's unique id is not 128 bytes");

void nccl_unique_id_bytes(unsigned char* id) {
  ncclUniqueId made{};
  RINGATTN_NCCL_CHECK(ncclGetUniqueId(&made));
  std::memcpy(id, &made, sizeof(made));
}

std::shared_ptr<Communicator> nccl_communicator_from_id(const unsigned char* id, int rank, int size) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    detail::fail_as(ErrorKind::unsupported, "NcclCommunicator",
                    "no CUDA GPU is visible to this process; a ring made from an NCCL unique id "
                    "moves device tensors (bf16, f16) between GPUs");
  }
  ncclUniqueId copy{};
  std::memcpy(&copy, id, sizeof(copy));
  return std::make_shared<NcclCommunicator>(copy, rank, size);
}

std::shared_ptr<Communicator> nccl_communicator_over(MPI_Comm comm) {
  auto mpi = std::make_unique<MpiCommunicator>(comm);
  select_node_local_device(*mpi);
  return std::make_shared<NcclCommunicator>(std::move(mpi));
}

std::shared_ptr<Communicator> nccl_world_communicator() { return nccl_communicator_over(MPI_COMM_WORLD); }

}  // namespace ringattn
