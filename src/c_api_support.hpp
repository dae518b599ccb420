// Support of the C API's translation units: exceptions to status codes and the thread-local
// message, C tensor descriptors to TensorViews, parameter struct versions and the mask fields.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ringattn.h"
#include "ringattn/tensor.hpp"

namespace ringattn::detail {

// The message ringattn_last_error() returns on this thread.
std::string& c_api_last_error();

// Runs body; returns RINGATTN_SUCCESS, or the status of what it threw with its message kept.
template <typename Body>
ringattn_status_t guarded(Body&& body) {
  std::string& last_error = c_api_last_error();
  try {
    body();
    last_error.clear();
    return RINGATTN_SUCCESS;
  } catch (const Error& e) {
    last_error = e.what();
    return static_cast<ringattn_status_t>(static_cast<int>(e.kind()));
  } catch (const std::bad_alloc&) {
    last_error = "out of host memory";
    return RINGATTN_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    last_error = e.what();
    return RINGATTN_ERROR_INTERNAL;
  }
}

TensorView to_view(const ringattn_tensor_t& t, const char* name, const char* where);

// One version of a parameter struct: its sizeof, and the versions that had it ("0.1 to 0.3").
struct StructVersion {
  std::size_t size;
  const char* versions;
};

// A parameter struct pointer that is null, or whose struct_size is not the sizeof of one version
// of its struct (`versions`, oldest first, the last one this library's sizeof), is refused: a size
// that ends inside a field would have the library read part of a value, and a larger one comes
// from a newer header whose fields this library cannot honour.
template <typename Params, std::size_t N>
void check_params(const Params* params, const char* where, const StructVersion (&versions)[N]) {
  static_assert(N >= 1);
  if (params == nullptr) fail(where, "params is a null pointer");
  for (const StructVersion& version : versions) {
    if (params->struct_size == version.size) return;
  }
  std::string older;
  for (std::size_t i = 0; i + 1 < N; ++i) {
    older += concat(i == 0 ? "" : ", ", versions[i].size, " (", versions[i].versions, ")");
  }
  fail(where, "params->struct_size is ", params->struct_size, "; expected sizeof = ",
       versions[N - 1].size, " (set it to sizeof(the struct))",
       N > 1 ? concat(", or the size of an older version: ", older) : std::string());
}

// Whether a caller's struct of `struct_size` bytes holds the field at `offset` of `size` bytes
// (fields appended by later versions are absent from an older caller's struct).
inline bool has_field(std::size_t struct_size, std::size_t offset, std::size_t size) {
  return struct_size >= offset + size;
}

// The window and documents of a parameter struct (the same five fields, appended to each struct
// in 0.4), into Mask's or the ring arguments' fields. check_params takes whole versions only, so a
// caller's struct holds all five or none (an older version: no window, one document).
template <typename Params>
void read_window_and_documents(const Params& params, std::int64_t& window_left,
                               std::int64_t& window_right, DocumentStarts& documents) {
  if (!has_field(params.struct_size, offsetof(Params, document_batch_stride),
                 sizeof(params.document_batch_stride))) {
    return;
  }
  window_left = params.window_left;
  window_right = params.window_right;
  documents = {params.document_starts, params.num_documents, params.document_batch_stride};
}

}  // namespace ringattn::detail
