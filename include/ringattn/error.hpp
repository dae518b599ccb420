// ringattn::Error: the one exception type of the C++ API.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ringattn {

// What went wrong, for callers that branch on it (the C API maps it to a status code).
enum class ErrorKind : int {
  invalid_argument = 1,  // a shape, dtype, stride, pointer or value the call cannot take
  unsupported = 2,       // valid, but not built or not available here (head_dim, GPU, backend)
  library = 3,           // a CUDA, cuBLAS, NCCL, MPI or HDF5 call failed
  io = 4,                // a file is missing, unreadable or corrupt
};

// Thrown for every failure: bad arguments (the message names the argument, its value and what
// was expected), and failed CUDA, cuBLAS, NCCL, MPI or HDF5 calls (the message names the call
// and the library's own error text). `where()` is the public function that detected it.
class Error : public std::runtime_error {
 public:
  Error(std::string where, const std::string& message, ErrorKind kind = ErrorKind::invalid_argument)
      : std::runtime_error(where + ": " + message), where_(std::move(where)), kind_(kind) {}
  const std::string& where() const noexcept { return where_; }
  ErrorKind kind() const noexcept { return kind_; }

 private:
  std::string where_;
  ErrorKind kind_;
};

namespace detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

template <typename... Parts>
[[noreturn]] void fail(std::string_view where, const Parts&... parts) {
  throw Error(std::string(where), concat(parts...));
}

template <typename... Parts>
[[noreturn]] void fail_as(ErrorKind kind, std::string_view where, const Parts&... parts) {
  throw Error(std::string(where), concat(parts...), kind);
}

}  // namespace detail
}  // namespace ringattn
