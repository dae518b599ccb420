// A 64-bit digest of bytes, for checking that ranks hold the same thing (a dataset file, the
// checkpoint state they resumed from) without sending it: not a cryptographic hash. It is XXH64
// (seed 0; Yann Collet's xxHash), fed in pieces of any size: four independent lanes over 32-byte
// stripes run at several GB/s, so a whole dataset or model state can be digested (FNV-1a, a byte
// at a time behind a multiply, managed under 1 GB/s). Words are read little-endian as x86 and
// Arm store them; ranks on machines of another byte order would disagree on every digest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace ringattn::train {

class Digest {
 public:
  Digest& add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    total_bytes_ += bytes;
    const std::size_t room = kStripeBytes - pending_bytes_;  // 1 to 32
    if (bytes < room) {
      std::memcpy(pending_ + (kStripeBytes - room), p, bytes);
      pending_bytes_ += bytes;
      return *this;
    }
    if (pending_bytes_ > 0) {
      std::memcpy(pending_ + (kStripeBytes - room), p, room);
      stripe(pending_);
      p += room;
      bytes -= room;
      pending_bytes_ = 0;
    }
    for (; bytes >= kStripeBytes; p += kStripeBytes, bytes -= kStripeBytes) stripe(p);
    if (bytes > 0) std::memcpy(pending_, p, bytes);
    pending_bytes_ = bytes;
    return *this;
  }
  template <class T>
  Digest& add_value(const T& value) {
    return add(&value, sizeof value);
  }
  std::uint64_t value() const {
    std::uint64_t h;
    if (total_bytes_ >= kStripeBytes) {
      h = rotl(lanes_[0], 1) + rotl(lanes_[1], 7) + rotl(lanes_[2], 12) + rotl(lanes_[3], 18);
      for (const std::uint64_t lane : lanes_) h = (h ^ round(0, lane)) * kPrime1 + kPrime4;
    } else {
      h = kPrime5;
    }
    h += total_bytes_;
    const unsigned char* p = pending_;
    std::size_t left = pending_bytes_;
    for (; left >= 8; p += 8, left -= 8) h = rotl(h ^ round(0, word64(p)), 27) * kPrime1 + kPrime4;
    if (left >= 4) {
      std::uint32_t word;
      std::memcpy(&word, p, sizeof word);
      h = rotl(h ^ (std::uint64_t{word} * kPrime1), 23) * kPrime2 + kPrime3;
      p += 4;
      left -= 4;
    }
    for (; left > 0; ++p, --left) h = rotl(h ^ (*p * kPrime5), 11) * kPrime1;
    h ^= h >> 33;
    h *= kPrime2;
    h ^= h >> 29;
    h *= kPrime3;
    return h ^ (h >> 32);
  }
  // 16 hexadecimal digits.
  std::string hex() const {
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value()));
    return text;
  }

 private:
  static constexpr std::size_t kStripeBytes = 32;  // four lanes of one 64-bit word
  static constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
  static constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
  static constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ull;
  static constexpr std::uint64_t kPrime4 = 0x85EBCA77C2B2AE63ull;
  static constexpr std::uint64_t kPrime5 = 0x27D4EB2F165667C5ull;

  static std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static std::uint64_t round(std::uint64_t lane, std::uint64_t word) {
    return rotl(lane + word * kPrime2, 31) * kPrime1;
  }
  static std::uint64_t word64(const unsigned char* p) {
    std::uint64_t word;
    std::memcpy(&word, p, sizeof word);
    return word;
  }
  void stripe(const unsigned char* p) {
    for (int i = 0; i < 4; ++i) lanes_[i] = round(lanes_[i], word64(p + 8 * i));
  }

  std::uint64_t lanes_[4] = {kPrime1 + kPrime2, kPrime2, 0, 0 - kPrime1};
  unsigned char pending_[kStripeBytes] = {};
  std::size_t pending_bytes_ = 0;
  std::uint64_t total_bytes_ = 0;
};

}  // namespace ringattn::train
