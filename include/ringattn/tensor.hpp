// TensorView: a non-owning view of up to four dimensions over host or device memory.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "ringattn/dtype.hpp"

namespace ringattn {

enum class Memory : int { host = 0, device = 1 };

// Shapes and strides are in elements, not bytes, so a packed QKV buffer `[B, S, 3, H, D]` gives
// Q, K and V as views `[B, S, H, D]` with a sequence stride of 3*H*D and no copy.
struct TensorView {
  static constexpr int kMaxRank = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  Memory memory = Memory::host;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> strides{};

  // A row-major view of `shape` over `data`; Error when its strides overflow int64.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Memory memory = Memory::host);
  // The same view with other strides (elements).
  TensorView with_strides(std::initializer_list<std::int64_t> new_strides) const;

  // The product of the extents; Error (invalid_argument) when an extent is negative or the
  // product overflows int64.
  std::int64_t numel() const;
  bool is_contiguous() const;
  std::string describe() const;  // "bf16[2, 128, 8, 64] strides [..] on device"

  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  std::int64_t offset(std::int64_t i0, std::int64_t i1 = 0, std::int64_t i2 = 0,
                      std::int64_t i3 = 0) const {
    return i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3];
  }
};

}  // namespace ringattn
