// MPI on host buffers. Transfers are split into messages of at most kMaxMessageBytes because MPI
// counts are ints; the pieces of one exchange share its tag and MPI's non-overtaking rule keeps
// them in order (an empty transfer sends nothing: both sides compute the same piece count from
// matching sizes). Successive exchanges take successive tags, so an exchange of K/V and one of
// gradient accumulators in flight together never match each other whatever their sizes.
#include "parallel/mpi_communicator.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "src/mpi_check.hpp"

namespace ringattn {
namespace {

constexpr std::size_t kMaxMessageBytes = std::size_t{1} << 30;
// MPI guarantees tags up to 32767 (MPI_TAG_UB >= 32767).
constexpr int kTagCount = 32768;

void require_initialised(const char* where) {
  int initialised = 0, finalised = 0;
  RINGATTN_MPI_CHECK(MPI_Initialized(&initialised));
  RINGATTN_MPI_CHECK(MPI_Finalized(&finalised));
  if (!initialised || finalised) {
    detail::fail(where, "MPI is ", finalised ? "already finalised" : "not initialised",
                 "; call MPI_Init (or MPI_Init_thread) before making a communicator and "
                 "MPI_Finalize after destroying it");
  }
}

MPI_Datatype mpi_type(DType dtype, const char* where) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    default:
      detail::fail_as(ErrorKind::unsupported, where, "MPI sums f32 and f64, not ",
                      dtype_name(dtype));
  }
}

int shared_split(const MpiCommunicator& comm, bool want_rank) {
  constexpr const char* where = "node_local_rank";
  MPI_Comm local = MPI_COMM_NULL;
  RINGATTN_MPI_CHECK(
      MPI_Comm_split_type(comm.handle(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL, &local));
  int value = 0;
  const int status = want_rank ? MPI_Comm_rank(local, &value) : MPI_Comm_size(local, &value);
  MPI_Comm_free(&local);
  detail::check_mpi(status, want_rank ? "MPI_Comm_rank" : "MPI_Comm_size", where);
  return value;
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) {
  require_initialised("MpiCommunicator");
  RINGATTN_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  RINGATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  RINGATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  RINGATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::MpiCommunicator(MPI_Comm owned, Adopt) : comm_(owned) {
  RINGATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  RINGATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  RINGATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::world() {
  require_initialised("MpiCommunicator::world");
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

MpiCommunicator::~MpiCommunicator() {
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (finalised || comm_ == MPI_COMM_NULL) return;
  // Only a call that threw between exchange_start and exchange_wait leaves requests behind; the
  // buffers they name may be gone, so they are left to MPI rather than waited for.
  if (!pending_.empty()) {
    std::fprintf(stderr, "ringattn: MpiCommunicator destroyed with %zu transfers in flight\n",
                 pending_.size());
  }
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::exchange_start(const void* send, std::size_t send_bytes, void* recv,
                                     std::size_t recv_bytes, void*) {
  const int next = (rank_ + 1) % size_, previous = (rank_ + size_ - 1) % size_;
  const int tag = exchange_count_;
  exchange_count_ = (exchange_count_ + 1) % kTagCount;
  // Receives first, so that a message finds its receive already posted.
  for (std::size_t offset = 0; offset < recv_bytes; offset += kMaxMessageBytes) {
    const int count = static_cast<int>(std::min(kMaxMessageBytes, recv_bytes - offset));
    pending_.push_back(MPI_REQUEST_NULL);
    RINGATTN_MPI_CHECK(MPI_Irecv(static_cast<char*>(recv) + offset, count, MPI_BYTE, previous, tag,
                                 comm_, &pending_.back()));
  }
  for (std::size_t offset = 0; offset < send_bytes; offset += kMaxMessageBytes) {
    const int count = static_cast<int>(std::min(kMaxMessageBytes, send_bytes - offset));
    pending_.push_back(MPI_REQUEST_NULL);
    RINGATTN_MPI_CHECK(MPI_Isend(static_cast<const char*>(send) + offset, count, MPI_BYTE, next,
                                 tag, comm_, &pending_.back()));
  }
}

void MpiCommunicator::exchange_wait(void*) {
  if (pending_.empty()) return;
  std::vector<MPI_Request> requests;
  requests.swap(pending_);
  RINGATTN_MPI_CHECK(
      MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
}

void MpiCommunicator::all_reduce_sum(void* data, std::size_t count, DType dtype, void*) {
  const MPI_Datatype type = mpi_type(dtype, "MpiCommunicator::all_reduce_sum");
  const std::size_t element_bytes = dtype_size(dtype);
  const std::size_t max_count = kMaxMessageBytes / element_bytes;
  for (std::size_t first = 0; first < count; first += max_count) {
    const int n = static_cast<int>(std::min(max_count, count - first));
    RINGATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(data) + first * element_bytes,
                                     n, type, MPI_SUM, comm_));
  }
}

void MpiCommunicator::barrier() {
  RINGATTN_MPI_CHECK(MPI_Barrier(comm_));
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) const {
  if (color < 0) {
    detail::fail("MpiCommunicator::split", "color is ", color,
                 "; expected >= 0 (every rank joins a group)");
  }
  MPI_Comm group = MPI_COMM_NULL;
  RINGATTN_MPI_CHECK(MPI_Comm_split(comm_, color, key, &group));
  return std::unique_ptr<Communicator>(new MpiCommunicator(group, Adopt{}));
}

void MpiCommunicator::host_all_gather(const void* send, std::size_t bytes, void* recv) const {
  if (bytes > kMaxMessageBytes) {
    detail::fail("MpiCommunicator::host_all_gather", bytes,
                 " bytes per rank is not small metadata; expected at most ", kMaxMessageBytes);
  }
  RINGATTN_MPI_CHECK(MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, recv,
                                   static_cast<int>(bytes), MPI_BYTE, comm_));
}

int node_local_rank(const MpiCommunicator& comm) {
  return shared_split(comm, true);
}
int node_local_size(const MpiCommunicator& comm) {
  return shared_split(comm, false);
}

std::shared_ptr<Communicator> mpi_world_communicator() {
  return MpiCommunicator::world();
}

}  // namespace ringattn
