// OwnedBuffer: memory that one object owns, on the host (64-byte aligned) or on the current CUDA
// device, chosen at run time by a Memory value, so that code written once for both backends (the
// ring's workspaces) allocates with one type. Moves, never copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "ringattn/tensor.hpp"

namespace ringattn {

class OwnedBuffer {
 public:
  // Alignment of host allocations: a cache line, and enough for any vector load.
  static constexpr std::size_t kHostAlignmentBytes = 64;

  OwnedBuffer() = default;
  // Uninitialised memory. Device memory needs a library built with CUDA (Error otherwise) and
  // comes from cudaMalloc on the current device.
  OwnedBuffer(Memory memory, std::size_t bytes);
  OwnedBuffer(const OwnedBuffer&) = delete;
  OwnedBuffer& operator=(const OwnedBuffer&) = delete;
  OwnedBuffer(OwnedBuffer&& other) noexcept;
  OwnedBuffer& operator=(OwnedBuffer&& other) noexcept;
  ~OwnedBuffer();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Memory memory() const { return memory_; }

  // A row-major view of `shape` starting `byte_offset` bytes into the buffer; throws Error when
  // it does not fit.
  TensorView view(DType dtype, std::initializer_list<std::int64_t> shape,
                  std::size_t byte_offset = 0) const;

  // Keeps the buffer when it already has `memory` and at least `bytes`, else replaces it (the old
  // contents are lost). Workspaces grow to the largest call and stay.
  void reserve(Memory memory, std::size_t bytes);

 private:
  void release() noexcept;

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Memory memory_ = Memory::host;
};

}  // namespace ringattn
