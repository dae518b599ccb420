// The ring part of the C API: a handle owning a RingAttention over an MPI communicator (MPI for
// host tensors, NCCL for device tensors), and its forward and backward.
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
    if (layout != RINGATTN_CONTIGUOUS && layout != RINGATTN_ZIGZAG) {
      detail::fail(kWhere, "layout is ", layout, "; expected 0 (contiguous) or 1 (zigzag)");
    }
    const MPI_Comm comm = *static_cast<const MPI_Comm*>(mpi_comm);
    std::shared_ptr<Communicator> communicator =
        memory == RINGATTN_HOST ? std::shared_ptr<Communicator>(std::make_shared<MpiCommunicator>(comm))
                                : nccl_communicator_over(comm);
    *ring = new ringattn_ring{RingAttention(std::move(communicator), static_cast<SequenceLayoutKind>(layout))};
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
