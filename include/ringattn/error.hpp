// ringattn::Error: the one exception type of the C++ API.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ringattn {

// Thrown for every failure: bad arguments (the message names the argument, its value and what
// was expected), and failed CUDA, cuBLAS, NCCL, MPI or HDF5 calls (the message names the call
// and the library's own error text). `where()` is the public function that detected it.
class Error : public std::runtime_error {
 public:
  Error(std::string where, const std::string& message)
      : std::runtime_error(where + ": " + message), where_(std::move(where)) {}
  const std::string& where() const noexcept { return where_; }

 private:
  std::string where_;
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

}  // namespace detail
}  // namespace ringattn
