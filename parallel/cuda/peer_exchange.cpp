#include "parallel/cuda/peer_exchange.hpp"

#include <cudaTypedefs.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "ringattn/error.hpp"
#include "src/cuda/cuda_check.hpp"
#include "src/mpi_check.hpp"

namespace ringattn {
namespace {

constexpr int kTagReady = 7101, kTagCopied = 7102, kTagReleased = 7103, kTagKeptReleased = 7104;

// A driver function through the runtime's entry-point query (the library links against the
// runtime only); null where the driver lacks it.
void* driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    function = nullptr;
  }
  return function;
}

// The allocation a pointer lies in (what CUDA IPC exports) and its process-wide unique id.
bool allocation_of(const void* pointer, void*& base, unsigned long long& id) {
  static const auto range =
      reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(driver_function("cuMemGetAddressRange"));
  static const auto attribute =
      reinterpret_cast<PFN_cuPointerGetAttribute_v4000>(driver_function("cuPointerGetAttribute"));
  const auto address = reinterpret_cast<CUdeviceptr>(pointer);
  CUdeviceptr start = 0;
  std::size_t bytes = 0;
  if (range == nullptr || attribute == nullptr || range(&start, &bytes, address) != CUDA_SUCCESS ||
      attribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, address) != CUDA_SUCCESS) {
    return false;
  }
  base = reinterpret_cast<void*>(start);
  return true;
}

cudaEvent_t interprocess_event() {
  cudaEvent_t event = nullptr;
  RINGATTN_CUDA_CHECK(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess));
  return event;
}

}  // namespace

struct PeerExchange::Ready {
  std::uint64_t sequence;
  std::uint64_t bytes;   // the receive buffer's size
  std::uint64_t offset;  // of the receive buffer in its allocation
  std::int32_t exported; // 0: the buffer could not be exported; NCCL carries this exchange
  std::int32_t kept;     // 1: its allocation stays until release_kept; the mapping may stay too
  cudaIpcMemHandle_t handle;
};

PeerExchange::PeerExchange(MPI_Comm comm, int rank, int size, std::size_t copy_min_bytes)
    : comm_(comm),
      rank_(rank),
      next_((rank + 1) % size),
      previous_((rank + size - 1) % size),
      copy_min_bytes_(copy_min_bytes) {}

std::unique_ptr<PeerExchange> PeerExchange::create(MPI_Comm comm, int device,
                                                   std::size_t copy_min_bytes, std::string& why) {
  int rank = 0, size = 1;
  RINGATTN_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  RINGATTN_MPI_CHECK(MPI_Comm_size(comm, &size));
  if (size < 2) {
    why = "one rank";
    return nullptr;
  }
  // Every rank's node and GPU, so that each judges its link to the next rank.
  struct Place {
    char host[MPI_MAX_PROCESSOR_NAME + 1];
    char bus_id[32];
  };
  Place mine{};
  int length = 0;
  RINGATTN_MPI_CHECK(MPI_Get_processor_name(mine.host, &length));
  RINGATTN_CUDA_CHECK(cudaDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id), device));
  std::vector<Place> places(static_cast<std::size_t>(size));
  RINGATTN_MPI_CHECK(MPI_Allgather(&mine, sizeof(Place), MPI_BYTE, places.data(), sizeof(Place),
                                   MPI_BYTE, comm));
  const Place& next = places[static_cast<std::size_t>((rank + 1) % size)];
  int reachable = std::strcmp(next.host, mine.host) == 0;
  if (reachable) {
    int next_device = -1, access = 0;
    if (cudaDeviceGetByPCIBusId(&next_device, next.bus_id) != cudaSuccess) {
      (void)cudaGetLastError();
      reachable = 0;  // not visible to this process
    } else if (next_device != device) {
      RINGATTN_CUDA_CHECK(cudaDeviceCanAccessPeer(&access, device, next_device));
      reachable = access;
    }
  }
  std::vector<int> all(static_cast<std::size_t>(size));
  RINGATTN_MPI_CHECK(MPI_Allgather(&reachable, 1, MPI_INT, all.data(), 1, MPI_INT, comm));
  for (int r = 0; r < size; ++r) {
    if (all[static_cast<std::size_t>(r)] == 0) {
      const Place& from = places[static_cast<std::size_t>(r)];
      const Place& to = places[static_cast<std::size_t>((r + 1) % size)];
      why = "rank " + std::to_string(r) + " (" + from.host + ", GPU " + from.bus_id +
            ") cannot write into the memory of rank " + std::to_string((r + 1) % size) + " (" +
            to.host + ", GPU " + to.bus_id + ")";
      return nullptr;
    }
  }

  std::unique_ptr<PeerExchange> exchange(new PeerExchange(comm, rank, size, copy_min_bytes));
  PeerExchange& x = *exchange;
  std::array<cudaIpcEventHandle_t, kSlots> free_handles{}, copied_handles{}, next_free{},
      previous_copied{};
  for (int slot = 0; slot < kSlots; ++slot) {
    x.free_[slot] = interprocess_event();
    x.copied_[slot] = interprocess_event();
    RINGATTN_CUDA_CHECK(cudaIpcGetEventHandle(&free_handles[slot], x.free_[slot]));
    RINGATTN_CUDA_CHECK(cudaIpcGetEventHandle(&copied_handles[slot], x.copied_[slot]));
  }
  // Our free events go to the previous rank (it writes into us), our copied events to the next.
  RINGATTN_MPI_CHECK(MPI_Sendrecv(free_handles.data(), sizeof(free_handles), MPI_BYTE, x.previous_,
                                  kTagReady, next_free.data(), sizeof(next_free), MPI_BYTE, x.next_,
                                  kTagReady, comm, MPI_STATUS_IGNORE));
  RINGATTN_MPI_CHECK(MPI_Sendrecv(copied_handles.data(), sizeof(copied_handles), MPI_BYTE, x.next_,
                                  kTagCopied, previous_copied.data(), sizeof(previous_copied),
                                  MPI_BYTE, x.previous_, kTagCopied, comm, MPI_STATUS_IGNORE));
  for (int slot = 0; slot < kSlots; ++slot) {
    RINGATTN_CUDA_CHECK(cudaIpcOpenEventHandle(&x.next_free_[slot], next_free[slot]));
    RINGATTN_CUDA_CHECK(cudaIpcOpenEventHandle(&x.previous_copied_[slot], previous_copied[slot]));
  }
  return exchange;
}

PeerExchange::~PeerExchange() {
  // Copies still queued read or write mapped memory: let them finish first. Destructors only log.
  RINGATTN_CUDA_LOG(cudaDeviceSynchronize());
  for (const Mapping& m : mappings_) RINGATTN_CUDA_LOG(cudaIpcCloseMemHandle(m.base));
  for (auto* events : {&free_, &copied_, &next_free_, &previous_copied_}) {
    for (cudaEvent_t e : *events) {
      if (e != nullptr) RINGATTN_CUDA_LOG(cudaEventDestroy(e));
    }
  }
  if (!requests_.empty()) {
    MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
  }
}

void* PeerExchange::map(const cudaIpcMemHandle_t& handle, bool kept) {
  for (Mapping& m : mappings_) {
    if (std::memcmp(&m.handle, &handle, sizeof(handle)) == 0) {
      m.kept = m.kept || kept;
      return m.base;
    }
  }
  void* base = nullptr;
  RINGATTN_CUDA_CHECK(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess));
  mappings_.push_back({handle, base, kept});
  return base;
}

void PeerExchange::close_mappings(bool kept, cudaStream_t comm_stream) {
  std::vector<Mapping> open;
  for (const Mapping& m : mappings_) {
    if (m.kept != kept) open.push_back(m);
  }
  if (open.size() == mappings_.size()) return;
  // The copies through the mappings are the last work on comm_stream that uses them.
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(comm_stream));
  for (const Mapping& m : mappings_) {
    if (m.kept == kept) RINGATTN_CUDA_CHECK(cudaIpcCloseMemHandle(m.base));
  }
  mappings_ = std::move(open);
}

void PeerExchange::complete_sends() {
  if (!requests_.empty()) {
    RINGATTN_MPI_CHECK(MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(),
                                   MPI_STATUSES_IGNORE));
  }
  requests_.clear();
  outgoing_.clear();
}

void PeerExchange::tell_next(const std::uint64_t& count, int tag) {
  MPI_Request request = MPI_REQUEST_NULL;
  RINGATTN_MPI_CHECK(MPI_Isend(&count, 1, MPI_UINT64_T, next_, tag, comm_, &request));
  requests_.push_back(request);
}

void PeerExchange::keep(const void* data, std::size_t bytes) {
  for (const auto& [start, length] : kept_ranges_) {
    if (start == data && length == bytes) return;
  }
  kept_ranges_.emplace_back(data, bytes);
  void* base = nullptr;
  unsigned long long id = 0;
  if (bytes == 0 || !allocation_of(data, base, id)) return;  // no IPC for it: NCCL carries it
  for (unsigned long long known : kept_ids_) {
    if (known == id) return;
  }
  kept_ids_.push_back(id);
}

void PeerExchange::release_kept(cudaStream_t comm_stream, double timeout_s) {
  constexpr const char* kWhere = "NcclCommunicator::release_kept_memory";
  ++releases_;
  if (holds_kept_) {
    close_mappings(true, comm_stream);
    tell_next(releases_, kTagKeptReleased);
  }
  if (lent_kept_) {
    std::uint64_t released = 0;
    MPI_Request request = MPI_REQUEST_NULL;
    RINGATTN_MPI_CHECK(MPI_Irecv(&released, 1, MPI_UINT64_T, previous_, kTagKeptReleased, comm_,
                                 &request));
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    int done = 0;
    while (true) {
      RINGATTN_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (done || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!done) {
      RINGATTN_MPI_CHECK(MPI_Cancel(&request));
      RINGATTN_MPI_CHECK(MPI_Request_free(&request));
      std::fprintf(stderr,
                   "ringattn: %s: rank %d did not hear from rank %d within %g s that it closed its "
                   "mappings of this rank's kept memory\n",
                   kWhere, rank_, previous_, timeout_s);
    } else if (released != releases_) {
      detail::fail(kWhere, "rank ", rank_, " releases its kept memory for the ", releases_,
                   ". time but rank ", previous_, " for the ", released,
                   ". time: the ranks' calls went out of step");
    }
  }
  holds_kept_ = lent_kept_ = false;
  kept_ids_.clear();
  kept_ranges_.clear();
  complete_sends();
}

bool PeerExchange::export_handle(void* base, unsigned long long id, cudaIpcMemHandle_t& handle) {
  for (const Export& e : exports_) {
    if (e.id == id) {
      handle = e.handle;
      return true;
    }
  }
  if (cudaIpcGetMemHandle(&handle, base) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  constexpr std::size_t kKept = 16;
  if (exports_.size() >= kKept) exports_.erase(exports_.begin());
  exports_.push_back({id, handle});
  return true;
}

PeerExchange::Fallback PeerExchange::start(const void* send, std::size_t send_bytes, void* recv,
                                           std::size_t recv_bytes, cudaStream_t compute) {
  constexpr const char* kWhere = "NcclCommunicator::exchange_start";
  const std::uint64_t sequence = sequence_++;
  const int slot = static_cast<int>(sequence % kSlots);

  // Tell the previous rank where to write, once this rank's compute is done with the buffer.
  RINGATTN_CUDA_CHECK(cudaEventRecord(free_[slot], compute));
  auto ready = std::make_unique<Ready>();
  ready->sequence = sequence;
  ready->bytes = recv_bytes;
  void* base = nullptr;
  unsigned long long id = 0;
  ready->exported = recv_bytes >= copy_min_bytes_ && allocation_of(recv, base, id) &&
                    export_handle(base, id, ready->handle);
  bool kept = false;
  for (unsigned long long known : kept_ids_) kept = kept || known == id;
  ready->kept = ready->exported != 0 && kept ? 1 : 0;
  awaits_release_ = awaits_release_ || (ready->exported != 0 && ready->kept == 0);
  lent_kept_ = lent_kept_ || ready->kept != 0;
  ready->offset = ready->exported ? static_cast<std::uint64_t>(static_cast<char*>(recv) -
                                                                static_cast<char*>(base))
                                  : 0;
  Fallback fallback;
  fallback.recv = !ready->exported;
  MPI_Request request = MPI_REQUEST_NULL;
  RINGATTN_MPI_CHECK(MPI_Isend(ready.get(), sizeof(Ready), MPI_BYTE, previous_, kTagReady, comm_,
                               &request));
  requests_.push_back(request);
  outgoing_.push_back(std::move(ready));

  // Where the next rank wants this rank's data.
  Ready there{};
  RINGATTN_MPI_CHECK(MPI_Recv(&there, sizeof(Ready), MPI_BYTE, next_, kTagReady, comm_,
                              MPI_STATUS_IGNORE));
  if (there.sequence != sequence) {
    detail::fail(kWhere, "rank ", rank_, " is at exchange ", sequence, " but rank ", next_,
                 " at exchange ", there.sequence, ": the ranks' rings went out of step");
  }
  if (there.bytes != send_bytes) {
    detail::fail(kWhere, "rank ", rank_, " sends ", send_bytes, " bytes but rank ", next_,
                 " receives ", there.bytes);
  }
  fallback.send = there.exported == 0;
  owes_release_ = owes_release_ || (!fallback.send && there.kept == 0);
  holds_kept_ = holds_kept_ || (!fallback.send && there.kept != 0);
  // The copy waits for `issue`: opening the next rank's buffer can take the host milliseconds,
  // which it spends better once the compute beside the transfer is queued.
  outbound_.push_back({sequence, !fallback.send && send_bytes > 0, there.handle,
                       there.kept != 0, there.offset, send, send_bytes});
  pending_.push_back({sequence, !fallback.recv});
  return fallback;
}

void PeerExchange::issue(cudaStream_t comm_stream) {
  for (const Outbound& o : outbound_) {
    const int slot = static_cast<int>(o.sequence % kSlots);
    if (o.copy) {
      char* destination = static_cast<char*>(map(o.handle, o.kept)) + o.offset;
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, next_free_[slot], 0));
      RINGATTN_CUDA_CHECK(cudaMemcpyAsync(destination, o.send, o.bytes, cudaMemcpyDeviceToDevice,
                                          comm_stream));
    }
    // Recorded whichever way the data goes, so that the protocol has one shape.
    RINGATTN_CUDA_CHECK(cudaEventRecord(copied_[slot], comm_stream));
    auto copied = std::make_unique<Ready>();
    copied->sequence = o.sequence;
    MPI_Request request = MPI_REQUEST_NULL;
    RINGATTN_MPI_CHECK(MPI_Isend(&copied->sequence, 1, MPI_UINT64_T, next_, kTagCopied, comm_,
                                 &request));
    requests_.push_back(request);
    outgoing_.push_back(std::move(copied));
  }
  outbound_.clear();
}

void PeerExchange::wait(cudaStream_t compute) {
  for (const auto& [sequence, copied] : pending_) {
    std::uint64_t arrived = 0;
    RINGATTN_MPI_CHECK(MPI_Recv(&arrived, 1, MPI_UINT64_T, previous_, kTagCopied, comm_,
                                MPI_STATUS_IGNORE));
    if (arrived != sequence) {
      detail::fail("NcclCommunicator::exchange_wait", "rank ", rank_, " waits for exchange ",
                   sequence, " but rank ", previous_, " finished exchange ", arrived,
                   ": the ranks' rings went out of step");
    }
    if (copied) {
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(compute, previous_copied_[sequence % kSlots], 0));
    }
  }
  pending_.clear();
  // The messages are a few dozen bytes: sent eagerly, so this returns at once.
  complete_sends();
}

void PeerExchange::finish(cudaStream_t comm_stream) {
  constexpr const char* kWhere = "NcclCommunicator::exchange_finish";
  if (!outbound_.empty() || !pending_.empty()) {
    detail::fail(kWhere, "rank ", rank_, " ends its ring call with exchanges not yet waited for");
  }
  finished_ = sequence_;
  if (owes_release_) {
    close_mappings(false, comm_stream);
    tell_next(finished_, kTagReleased);
  }
  if (awaits_release_) {
    std::uint64_t released = 0;
    RINGATTN_MPI_CHECK(MPI_Recv(&released, 1, MPI_UINT64_T, previous_, kTagReleased, comm_,
                                MPI_STATUS_IGNORE));
    if (released != finished_) {
      detail::fail(kWhere, "rank ", rank_, " ends its ring call after ", finished_,
                   " exchanges but rank ", previous_, " after ", released,
                   ": the ranks' rings went out of step");
    }
  }
  owes_release_ = awaits_release_ = false;
  complete_sends();
}

}  // namespace ringattn
