// Support of the C API's translation units: exceptions to status codes and the thread-local
// message, C tensor descriptors to TensorViews, parameter struct checks.
#pragma once

#include <exception>
#include <new>
#include <string>

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

// A parameter struct pointer that is null, or shorter than the first version of its struct
// (`first_size` bytes; by default this library's whole struct), is refused.
template <typename Params>
void check_params(const Params* params, const char* where, std::size_t first_size = sizeof(Params)) {
  if (params == nullptr) fail(where, "params is a null pointer");
  if (params->struct_size < first_size) {
    fail(where, "params->struct_size is ", params->struct_size, "; expected sizeof = ",
         sizeof(Params), " (set it to sizeof(the struct))");
  }
}

// Whether a caller's struct of `struct_size` bytes holds the field at `offset` of `size` bytes
// (fields appended by later versions are absent from an older caller's struct).
inline bool has_field(std::size_t struct_size, std::size_t offset, std::size_t size) {
  return struct_size >= offset + size;
}

}  // namespace ringattn::detail
