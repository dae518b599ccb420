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

// A parameter struct pointer that is null, or older than this library's struct, is refused.
template <typename Params>
void check_params(const Params* params, const char* where) {
  if (params == nullptr) fail(where, "params is a null pointer");
  if (params->struct_size < sizeof(Params)) {
    fail(where, "params->struct_size is ", params->struct_size, "; expected sizeof = ",
         sizeof(Params), " (set it to sizeof(the struct))");
  }
}

}  // namespace ringattn::detail
