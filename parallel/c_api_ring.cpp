// The ring part of the C API: a handle owning a RingAttention over an MPI communicator (MPI for
// host tensors, NCCL for device tensors) or over NCCL from a unique id the caller distributes,
// and its forward and backward. A balanced ring needs nothing of its own here: RingAttention
// makes each call's layout from that call's mask, which the parameter structs carry.
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "parallel/device_communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/ringattn.h"
#include "src/c_api_support.hpp"

struct ringattn_ring {
  ringattn::RingAttention ring;
};

namespace {
using namespace ringattn;
using detail::check_params;
using detail::guarded;
using detail::StructVersion;
using detail::to_view;

// Every version of each parameter struct, oldest first (as in src/c_api.cpp).
constexpr StructVersion kRingForwardVersions[] = {
    {offsetof(ringattn_ring_forward_params_t, window_left), "0.1 to 0.3"},
    {sizeof(ringattn_ring_forward_params_t), "0.4"}};
constexpr StructVersion kRingBackwardVersions[] = {
    {offsetof(ringattn_ring_backward_params_t, window_left), "0.1 to 0.3"},
    {sizeof(ringattn_ring_backward_params_t), "0.4"}};

// The C codes are the C++ kinds: ringattn_ring_create and ringattn_layout_chunks cast one to the
// other.
static_assert(RINGATTN_CONTIGUOUS == static_cast<int>(SequenceLayoutKind::contiguous) &&
              RINGATTN_ZIGZAG == static_cast<int>(SequenceLayoutKind::zigzag) &&
              RINGATTN_BALANCED == static_cast<int>(SequenceLayoutKind::balanced));

void check_layout(int32_t layout, const char* where) {
  if (layout != RINGATTN_CONTIGUOUS && layout != RINGATTN_ZIGZAG && layout != RINGATTN_BALANCED) {
    detail::fail(where, "layout is ", layout,
                 "; expected 0 (contiguous), 1 (zigzag) or 2 (balanced)");
  }
}

void check_id_bytes(const void* id, std::size_t bytes, const char* where) {
  if (id == nullptr) detail::fail(where, "id is a null pointer");
  if (bytes != kNcclUniqueIdBytes) {
    detail::fail(where, "bytes is ", bytes, "; an NCCL unique id is RINGATTN_NCCL_UNIQUE_ID_BYTES (",
                 kNcclUniqueIdBytes, ") bytes");
  }
}

RingAttention& ring_of(ringattn_ring_t handle, const char* where) {
  if (handle == nullptr) detail::fail(where, "ring is a null handle (create it with ringattn_ring_create)");
  return handle->ring;
}
}  // namespace

extern "C" {

ringattn_status_t ringattn_ring_create(const void* mpi_comm, int32_t memory, int32_t layout,
                                       ringattn_ring_t* ring) {
  constexpr const char* kWhere = "ringattn_ring_create";
  return guarded([&] {
    if (ring == nullptr) detail::fail(kWhere, "ring (the output) is a null pointer");
    *ring = nullptr;
    if (mpi_comm == nullptr) detail::fail(kWhere, "mpi_comm is a null pointer; pass the address of an MPI_Comm");
    if (memory != RINGATTN_HOST && memory != RINGATTN_DEVICE) {
      detail::fail(kWhere, "memory is ", memory, "; expected 0 (host, MPI) or 1 (device, NCCL)");
    }
    check_layout(layout, kWhere);
    const MPI_Comm comm = *static_cast<const MPI_Comm*>(mpi_comm);
    std::shared_ptr<Communicator> communicator =
        memory == RINGATTN_HOST ? std::shared_ptr<Communicator>(std::make_shared<MpiCommunicator>(comm))
                                : nccl_communicator_over(comm);
    *ring = new ringattn_ring{RingAttention(std::move(communicator), static_cast<SequenceLayoutKind>(layout))};
  });
}

ringattn_status_t ringattn_nccl_unique_id(void* id, size_t bytes) {
  return guarded([&] {
    check_id_bytes(id, bytes, "ringattn_nccl_unique_id");
    nccl_unique_id_bytes(static_cast<unsigned char*>(id));
  });
}

ringattn_status_t ringattn_ring_create_nccl(const void* id, size_t bytes, int32_t rank, int32_t size,
                                            int32_t layout, ringattn_ring_t* ring) {
  constexpr const char* kWhere = "ringattn_ring_create_nccl";
  return guarded([&] {
    if (ring == nullptr) detail::fail(kWhere, "ring (the output) is a null pointer");
    *ring = nullptr;
    check_id_bytes(id, bytes, kWhere);
    if (size < 1) detail::fail(kWhere, "size is ", size, "; expected the number of ranks, >= 1");
    if (rank < 0 || rank >= size) {
      detail::fail(kWhere, "rank is ", rank, "; expected 0 <= rank < size (", size, ")");
    }
    check_layout(layout, kWhere);
    *ring = new ringattn_ring{RingAttention(nccl_communicator_from_id(static_cast<const unsigned char*>(id), rank, size),
                                            static_cast<SequenceLayoutKind>(layout))};
  });
}

ringattn_status_t ringattn_ring_destroy(ringattn_ring_t ring) {
  return guarded([&] { delete ring; });
}

ringattn_status_t ringattn_ring_forward(ringattn_ring_t ring, const ringattn_ring_forward_params_t* params,
                                        void* stream) {
  constexpr const char* kWhere = "ringattn_ring_forward";
  return guarded([&] {
    RingAttention& r = ring_of(ring, kWhere);
    check_params(params, kWhere, kRingForwardVersions);
    RingForwardArgs args;
    args.q = to_view(params->q, "q", kWhere);
    args.k = to_view(params->k, "k", kWhere);
    args.v = to_view(params->v, "v", kWhere);
    args.o = to_view(params->o, "o", kWhere);
    args.lse = to_view(params->lse, "lse", kWhere);
    args.scale = params->scale;
    args.causal = params->causal != 0;
    detail::read_window_and_documents(*params, args.window_left, args.window_right, args.documents);
    args.stream = stream;
    r.forward(args);
  });
}

ringattn_status_t ringattn_ring_backward(ringattn_ring_t ring, const ringattn_ring_backward_params_t* params,
                                         void* stream) {
  constexpr const char* kWhere = "ringattn_ring_backward";
  return guarded([&] {
    RingAttention& r = ring_of(ring, kWhere);
    check_params(params, kWhere, kRingBackwardVersions);
    RingBackwardArgs args;
    args.q = to_view(params->q, "q", kWhere);
    args.k = to_view(params->k, "k", kWhere);
    args.v = to_view(params->v, "v", kWhere);
    args.o = to_view(params->o, "o", kWhere);
    args.lse = to_view(params->lse, "lse", kWhere);
    args.dout = to_view(params->dout, "dout", kWhere);
    args.dq = to_view(params->dq, "dq", kWhere);
    args.dk = to_view(params->dk, "dk", kWhere);
    args.dv = to_view(params->dv, "dv", kWhere);
    args.scale = params->scale;
    args.causal = params->causal != 0;
    detail::read_window_and_documents(*params, args.window_left, args.window_right, args.documents);
    args.deterministic = params->deterministic != 0;
    args.stream = stream;
    r.backward(args);
  });
}

}  // extern "C"
