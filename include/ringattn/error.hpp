// ringattn::Error: the one exception type of the C++ API.
#pragma once

#include <charconv>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

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

// Appends one part of a message: text as it is, numbers by std::to_chars (what `<<` would print:
// bool as 0 or 1, floating point as %g, pointers in hex). Messages never go through iostreams, so
// they ignore the global locale (no "1,024"), and formatting one cannot fault in a process that
// holds a second, uninitialised copy of the iostream locale facets: under PyTorch on the GPU
// machines, `<<` of a number inside this library crashed the caller (SIGSEGV in num_put) where
// every message with a number was formed. Other types still go through a stream.
template <typename T>
void append_part(std::string& out, const T& part) {
  char digits[64];
  std::to_chars_result written{digits, std::errc{}};
  if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(part);
    return;
  } else if constexpr (std::is_same_v<T, char>) {
    out += part;
    return;
  } else if constexpr (std::is_same_v<T, bool>) {
    out += part ? '1' : '0';
    return;
  } else if constexpr (std::is_integral_v<T>) {
    written = std::to_chars(digits, digits + sizeof digits, part);
  } else if constexpr (std::is_enum_v<T>) {
    written = std::to_chars(digits, digits + sizeof digits,
                            static_cast<std::underlying_type_t<T>>(part));
  } else if constexpr (std::is_floating_point_v<T>) {
    written = std::to_chars(digits, digits + sizeof digits, part, std::chars_format::general, 6);
  } else if constexpr (std::is_pointer_v<T>) {
    const auto address = reinterpret_cast<std::uintptr_t>(part);
    if (address == 0) {
      out += '0';
      return;
    }
    out += "0x";
    written = std::to_chars(digits, digits + sizeof digits, address, 16);
  } else {
    std::ostringstream stream;
    stream << part;
    out += stream.str();
    return;
  }
  out.append(digits, written.ptr);
}

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append_part(out, parts), ...);
  return out;
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
