// The C API: converts C descriptors to TensorViews, routes host tensors to the CPU block and
// device tensors to the CUDA block, and turns exceptions into status codes and a thread-local
// message.
#include "ringattn/ringattn.h"

#include <cstddef>
#include <string>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/runtime.hpp"
#include "src/attention_checks.hpp"
#include "src/c_api_support.hpp"

namespace ringattn::detail {

std::string& c_api_last_error() {
  thread_local std::string message;
  return message;
}

TensorView to_view(const ringattn_tensor_t& t, const char* name, const char* where) {
  if (t.dtype < RINGATTN_F32 || t.dtype > RINGATTN_BF16) {
    fail(where, name, " has dtype code ", t.dtype, "; expected 0 (f32), 1 (f64), 2 (f16) or 3 (bf16)");
  }
  if (t.memory != RINGATTN_HOST && t.memory != RINGATTN_DEVICE) {
    fail(where, name, " has memory code ", t.memory, "; expected 0 (host) or 1 (device)");
  }
  if (t.rank < 0 || t.rank > TensorView::kMaxRank) {
    fail(where, name, " has rank ", t.rank, "; expected 0 to ", TensorView::kMaxRank);
  }
  TensorView view;
  view.data = t.data;
  view.dtype = static_cast<DType>(t.dtype);
  view.memory = static_cast<Memory>(t.memory);
  view.rank = t.rank;
  for (int i = 0; i < t.rank; ++i) {
    view.shape[i] = t.shape[i];
    view.strides[i] = t.strides[i];
  }
  return view;
}

}  // namespace ringattn::detail

namespace {
using namespace ringattn;
using detail::check_params;
using detail::guarded;
using detail::StructVersion;
using detail::to_view;

// Every version of each parameter struct, oldest first: a version's struct ends where the fields
// of the next one begin (each appended group starts at an 8-byte boundary, past any padding).
constexpr StructVersion kForwardVersions[] = {
    {offsetof(ringattn_forward_params_t, window_left), "0.1 to 0.3"},
    {sizeof(ringattn_forward_params_t), "0.4"}};
constexpr StructVersion kBackwardVersions[] = {
    {offsetof(ringattn_backward_params_t, overwrite_key_gradients), "0.1"},
    {offsetof(ringattn_backward_params_t, key_rotation_cos), "0.2"},
    {offsetof(ringattn_backward_params_t, window_left), "0.3"},
    {sizeof(ringattn_backward_params_t), "0.4"}};
// delta = rowsum(dout * o), and dq set to zero where given (the backends check its shape and
// dtype against o's and the accumulator's).
ringattn_status_t prepare(const ringattn_tensor_t* o, const ringattn_tensor_t* dout,
                          const ringattn_tensor_t* delta, const ringattn_tensor_t* dq, void* stream,
                          const char* where) {
  return guarded([&] {
    if (o == nullptr || dout == nullptr || delta == nullptr) {
      detail::fail(where, o == nullptr ? "o" : dout == nullptr ? "dout" : "delta", " is a null pointer");
    }
    const TensorView o_view = to_view(*o, "o", where);
    const TensorView dout_view = to_view(*dout, "dout", where);
    const TensorView delta_view = to_view(*delta, "delta", where);
    // The backends check each view but not their overlap.
    detail::check_prepare_views(o_view, dout_view, delta_view, where);
    if (dq == nullptr) {
      flash_backward_prepare(o_view, dout_view, delta_view, stream);
      return;
    }
    const TensorView dq_view = to_view(*dq, "dq", where);
    detail::check_no_overlap({{"dq", &dq_view}}, {{"o", &o_view}, {"dout", &dout_view}, {"delta", &delta_view}},
                             where);
    flash_backward_prepare(o_view, dout_view, delta_view, stream, &dq_view);
  });
}
}  // namespace

extern "C" {

int ringattn_version(void) { return RINGATTN_VERSION_CODE; }
const char* ringattn_version_string(void) { return RINGATTN_VERSION_STRING; }

const char* ringattn_status_string(ringattn_status_t status) {
  switch (status) {
    case RINGATTN_SUCCESS: return "success";
    case RINGATTN_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case RINGATTN_ERROR_UNSUPPORTED: return "unsupported";
    case RINGATTN_ERROR_LIBRARY: return "CUDA, NCCL, MPI or HDF5 call failed";
    case RINGATTN_ERROR_IO: return "file missing, unreadable or corrupt";
    case RINGATTN_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

const char* ringattn_last_error(void) { return detail::c_api_last_error().c_str(); }

int ringattn_cuda_device_count(void) { return cuda_device_count(); }

ringattn_status_t ringattn_attention_forward(const ringattn_forward_params_t* params, void* stream) {
  constexpr const char* kWhere = "ringattn_attention_forward";
  return guarded([&] {
    check_params(params, kWhere, kForwardVersions);
    ForwardArgs args;
    args.q = to_view(params->q, "q", kWhere);
    args.k = to_view(params->k, "k", kWhere);
    args.v = to_view(params->v, "v", kWhere);
    args.o = to_view(params->o, "o", kWhere);
    args.lse = to_view(params->lse, "lse", kWhere);
    args.scale = params->scale;
    args.mask = Mask{params->causal != 0, params->q_start, params->k_start};
    detail::read_window_and_documents(*params, args.mask.window_left, args.mask.window_right,
                                      args.mask.documents);
    args.combine = params->combine != 0;
    // The block checks again; checked here first, a refusal names the function the caller
    // called and comes before any backend is chosen.
    check_forward_args(args, args.q.memory, kWhere);
    flash_forward(args, stream);
  });
}

ringattn_status_t ringattn_attention_backward_prepare(const ringattn_tensor_t* o,
                                                      const ringattn_tensor_t* dout,
                                                      const ringattn_tensor_t* delta, void* stream) {
  return prepare(o, dout, delta, nullptr, stream, "ringattn_attention_backward_prepare");
}

ringattn_status_t ringattn_attention_backward_prepare_zero_dq(const ringattn_tensor_t* o,
                                                              const ringattn_tensor_t* dout,
                                                              const ringattn_tensor_t* delta,
                                                              const ringattn_tensor_t* dq,
                                                              void* stream) {
  constexpr const char* kWhere = "ringattn_attention_backward_prepare_zero_dq";
  if (dq == nullptr) {
    return guarded([&] { detail::fail(kWhere, "dq is a null pointer"); });
  }
  return prepare(o, dout, delta, dq, stream, kWhere);
}

ringattn_status_t ringattn_attention_backward(const ringattn_backward_params_t* params,
                                              void* stream) {
  constexpr const char* kWhere = "ringattn_attention_backward";
  return guarded([&] {
    check_params(params, kWhere, kBackwardVersions);
    BackwardArgs args;
    args.q = to_view(params->q, "q", kWhere);
    args.k = to_view(params->k, "k", kWhere);
    args.v = to_view(params->v, "v", kWhere);
    args.dout = to_view(params->dout, "dout", kWhere);
    args.lse = to_view(params->lse, "lse", kWhere);
    args.delta = to_view(params->delta, "delta", kWhere);
    args.dq = to_view(params->dq, "dq", kWhere);
    args.dk = to_view(params->dk, "dk", kWhere);
    args.dv = to_view(params->dv, "dv", kWhere);
    args.scale = params->scale;
    args.mask = Mask{params->causal != 0, params->q_start, params->k_start};
    detail::read_window_and_documents(*params, args.mask.window_left, args.mask.window_right,
                                      args.mask.documents);
    args.deterministic = params->deterministic != 0;
    args.overwrite_key_gradients =
        detail::has_field(params->struct_size,
                          offsetof(ringattn_backward_params_t, overwrite_key_gradients),
                          sizeof(params->overwrite_key_gradients)) &&
        params->overwrite_key_gradients != 0;
    if (detail::has_field(params->struct_size,
                          offsetof(ringattn_backward_params_t, key_rotation_sin),
                          sizeof(params->key_rotation_sin)) &&
        (params->key_rotation_cos.rank != 0 || params->key_rotation_sin.rank != 0)) {
      args.key_rotation = {to_view(params->key_rotation_cos, "key_rotation.cos", kWhere),
                           to_view(params->key_rotation_sin, "key_rotation.sin", kWhere)};
    }
    check_backward_args(args, args.q.memory, kWhere);  // as in ringattn_attention_forward
    flash_backward(args, stream);
  });
}

}  // extern "C"
