// A 64-bit FNV-1a digest of bytes, for checking that ranks hold the same thing (a dataset file, the
// checkpoint state they resumed from) without sending it: not a cryptographic hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ringattn::train {

class Digest {
 public:
  Digest& add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) {
      value_ = (value_ ^ p[i]) * 0x100000001b3ull;
    }
    return *this;
  }
  template <class T>
  Digest& add_value(const T& value) {
    return add(&value, sizeof value);
  }
  std::uint64_t value() const { return value_; }
  // 16 hexadecimal digits.
  std::string hex() const {
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value_));
    return text;
  }

 private:
  std::uint64_t value_ = 0xcbf29ce484222325ull;
};

}  // namespace ringattn::train
