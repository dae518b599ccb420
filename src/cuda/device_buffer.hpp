// RAII owners of device memory, streams and events. Algorithm code never calls cudaMalloc or
// cudaFree itself.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <utility>

#include "src/cuda/cuda_check.hpp"

namespace ringattn {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes > 0) RINGATTN_CUDA_CHECK(cudaMalloc(&data_, bytes));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { release(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void release() noexcept {
    if (data_ != nullptr) RINGATTN_CUDA_LOG(cudaFree(data_));
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

class CudaStream {
 public:
  CudaStream() { RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  // A stream whose kernels the device schedules before those of lower priority (a smaller
  // number is a higher priority; the range is cudaDeviceGetStreamPriorityRange's).
  explicit CudaStream(int priority) {
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
  }
  // The highest priority of the current device.
  static int highest_priority() {
    int least = 0, greatest = 0;
    RINGATTN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    return greatest;
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream() { RINGATTN_CUDA_LOG(cudaStreamDestroy(stream_)); }
  cudaStream_t get() const { return stream_; }
  void synchronize() const { RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

// `count` elements of T in page-locked host memory (uninitialised): a copy from the device into it
// is queued on its stream and returns at once, where one into pageable memory waits for the copy.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  explicit PinnedArray(std::size_t count) : size_(count) {
    void* data = nullptr;
    if (count > 0) RINGATTN_CUDA_CHECK(cudaMallocHost(&data, count * sizeof(T)));
    data_.reset(static_cast<T*>(data));
  }
  T* data() const { return data_.get(); }
  std::size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(T* data) const noexcept { RINGATTN_CUDA_LOG(cudaFreeHost(data)); }
  };
  std::unique_ptr<T, Free> data_;
  std::size_t size_ = 0;
};

class CudaEvent {
 public:
  explicit CudaEvent(unsigned flags = cudaEventDisableTiming) {
    RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags));
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    std::swap(event_, other.event_);
    return *this;
  }
  ~CudaEvent() {
    if (event_ != nullptr) RINGATTN_CUDA_LOG(cudaEventDestroy(event_));
  }
  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) { RINGATTN_CUDA_CHECK(cudaEventRecord(event_, stream)); }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace ringattn
