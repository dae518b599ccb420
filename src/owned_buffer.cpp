// Host memory through aligned operator new; device memory through cudaMalloc when the library has
// its CUDA backend. Freeing device memory with cudaFree waits for the work queued on it, so a
// buffer may be dropped while kernels that use it are still queued.
#include "src/owned_buffer.hpp"

#include <new>
#include <utility>

#include "ringattn/config.h"
#include "ringattn/error.hpp"

#if RINGATTN_WITH_CUDA
#include "src/cuda/cuda_check.hpp"
#endif

namespace ringattn {
namespace {

void* allocate(Memory memory, std::size_t bytes) {
  if (bytes == 0) return nullptr;
  if (memory == Memory::host) {
    return ::operator new (bytes, std::align_val_t{OwnedBuffer::kHostAlignmentBytes});
  }
#if RINGATTN_WITH_CUDA
  void* data = nullptr;
  RINGATTN_CUDA_CHECK(cudaMalloc(&data, bytes));
  return data;
#else
  detail::fail_as(
      ErrorKind::unsupported, "OwnedBuffer",
      "device memory needs a ringattn built with CUDA (configure with -DRINGATTN_CUDA=ON)");
#endif
}

void deallocate(Memory memory, void* data) noexcept {
  if (data == nullptr) return;
  if (memory == Memory::host) {
    ::operator delete (data, std::align_val_t{OwnedBuffer::kHostAlignmentBytes});
    return;
  }
#if RINGATTN_WITH_CUDA
  RINGATTN_CUDA_LOG(cudaFree(data));
#endif
}

}  // namespace

OwnedBuffer::OwnedBuffer(Memory memory, std::size_t bytes)
    : data_(allocate(memory, bytes)), bytes_(bytes), memory_(memory) {}

OwnedBuffer::OwnedBuffer(OwnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      memory_(other.memory_) {}

OwnedBuffer& OwnedBuffer::operator=(OwnedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    memory_ = other.memory_;
  }
  return *this;
}

OwnedBuffer::~OwnedBuffer() {
  release();
}

void OwnedBuffer::release() noexcept {
  deallocate(memory_, data_);
  data_ = nullptr;
  bytes_ = 0;
}

void OwnedBuffer::reserve(Memory memory, std::size_t bytes) {
  if (memory == memory_ && bytes <= bytes_) return;
  release();
  memory_ = memory;
  data_ = allocate(memory, bytes);
  bytes_ = bytes;
}

TensorView OwnedBuffer::view(DType dtype, std::initializer_list<std::int64_t> shape,
                             std::size_t byte_offset) const {
  TensorView v = TensorView::contiguous(nullptr, dtype, shape, memory_);
  const std::size_t bytes = static_cast<std::size_t>(v.numel()) * dtype_size(dtype);
  if (byte_offset + bytes > bytes_) {
    detail::fail("OwnedBuffer::view", "a view of ", bytes, " bytes at offset ", byte_offset,
                 " does not fit in a buffer of ", bytes_, " bytes");
  }
  v.data = static_cast<unsigned char*>(data_) + byte_offset;
  return v;
}

}  // namespace ringattn
