// Turns HDF5 return codes into ringattn::Error with the innermost message of HDF5's error stack.
#pragma once

#include <hdf5.h>

#include <string>

#include "ringattn/error.hpp"

namespace ringattn::detail {

// The description of the most specific error on HDF5's current stack ("" when it is empty).
inline std::string hdf5_error_text() {
  std::string text;
  auto walk = [](unsigned, const H5E_error2_t* entry, void* out) -> herr_t {
    if (entry->desc != nullptr) *static_cast<std::string*>(out) = entry->desc;
    return 0;
  };
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, walk, &text);
  return text;
}

// HDF5 signals failure with a negative herr_t or hid_t.
template <typename Code>
Code check_hdf5(Code code, const char* call, const char* where, const std::string& file) {
  if (code >= 0) return code;
  const std::string text = hdf5_error_text();
  H5Eclear2(H5E_DEFAULT);
  fail_as(ErrorKind::io, where, "HDF5 call ", call, " failed on '", file, "'", text.empty() ? "" : ": ", text);
}

}  // namespace ringattn::detail

#define RINGATTN_HDF5_CHECK(call, file) ::ringattn::detail::check_hdf5((call), #call, __func__, (file))
