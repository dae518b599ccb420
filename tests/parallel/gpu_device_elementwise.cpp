// The ring's element-wise operations on the GPU (parallel/cuda/local_block_cuda.cu): fill,
// convert-copy (f32 <-> bf16/f16, strided) and add, against the host versions on the same values;
// then over views that take each of the device's two paths (16 bytes a thread along contiguous
// rows, one element a thread otherwise), with the storage around the views left untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <limits>
#include <vector>

#include "parallel/local_block.hpp"
#include "ringattn/config.h"
#include "src/element_access.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/gpu.hpp"
#include "tests/common/random.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/device_buffer.hpp"

namespace ringattn {
namespace {

// [2, 5, 3, 8] as a view of [2, 3, 5, 8] storage (heads before tokens), 240 elements.
constexpr std::int64_t kCount = 2 * 3 * 5 * 8;
TensorView strided(void* data, DType dtype, Memory memory) {
  return TensorView::contiguous(data, dtype, {2, 5, 3, 8}, memory).with_strides({120, 8, 40, 1});
}

template <typename T>
std::vector<T> download(const DeviceBuffer& buffer, std::size_t count) {
  std::vector<T> out(count);
  RINGATTN_CUDA_CHECK(
      cudaMemcpy(out.data(), buffer.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// A copy from pageable host memory may return before its DMA has landed, and the operations run
// on a non-blocking stream that does not wait for it: each upload waits for the device.
void upload_bytes(void* device, const void* host, std::size_t bytes) {
  RINGATTN_CUDA_CHECK(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
}

template <typename T>
void upload(DeviceBuffer& buffer, const std::vector<T>& values) {
  upload_bytes(buffer.data(), values.data(), values.size() * sizeof(T));
}

TEST(DeviceElementwise, MatchesHost) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(90);
  const std::vector<float> values = test::normal_vector<float>(kCount, rng);
  const std::vector<float> other = test::normal_vector<float>(kCount, rng);
  CudaStream stream;
  DeviceBuffer a(kCount * sizeof(float)), b(kCount * sizeof(float)), half(kCount * 2);

  // copy: strided f32 -> contiguous bf16 and f16, as the host converts.
  upload(a, values);
  const TensorView a_strided = strided(a.data(), DType::f32, Memory::device);
  for (DType dtype : {DType::bf16, DType::f16}) {
    const TensorView h = TensorView::contiguous(half.data(), dtype, {2, 5, 3, 8}, Memory::device);
    detail::copy(a_strided, h, stream.get());
    stream.synchronize();
    std::vector<std::uint16_t> expected(kCount);
    detail::copy(strided(const_cast<float*>(values.data()), DType::f32, Memory::host),
                 TensorView::contiguous(expected.data(), dtype, {2, 5, 3, 8}), nullptr);
    EXPECT_EQ(download<std::uint16_t>(half, kCount), expected) << dtype_name(dtype);
  }

  // add: strided += contiguous, in fp32.
  upload(b, other);
  detail::add(TensorView::contiguous(b.data(), DType::f32, {2, 5, 3, 8}, Memory::device), a_strided,
              stream.get());
  stream.synchronize();
  std::vector<float> sum = values;
  detail::add(TensorView::contiguous(const_cast<float*>(other.data()), DType::f32, {2, 5, 3, 8}),
              strided(sum.data(), DType::f32, Memory::host), nullptr);
  EXPECT_EQ(download<float>(a, kCount), sum);

  // fill: -inf into a [2, 3, 20] view of the first 120 elements, the rest untouched.
  upload(a, values);
  detail::fill(TensorView::contiguous(a.data(), DType::f32, {2, 3, 20}, Memory::device),
               -std::numeric_limits<double>::infinity(), stream.get());
  stream.synchronize();
  const std::vector<float> filled = download<float>(a, kCount);
  for (std::int64_t i = 0; i < kCount; ++i) {
    EXPECT_EQ(filled[i], i < 120 ? -std::numeric_limits<float>::infinity() : values[i]) << i;
  }
}


// A [2, 7, 3, W] view (batch, token, head, dim) into storage whose rows hold `row` elements, from
// element `offset` on: the packed-QKV layout of the trainer when row > 3 * W, contiguous when
// row == 3 * W, misaligned for 16-byte access when `offset` is odd.
struct ViewCase {
  const char* name;
  std::int64_t width, row, offset;
};

TensorView packed(void* data, DType dtype, const ViewCase& c, Memory memory) {
  auto* base = static_cast<unsigned char*>(data) + c.offset * dtype_size(dtype);
  return TensorView::contiguous(base, dtype, {2, 7, 3, c.width}, memory)
      .with_strides({7 * c.row, c.row, c.width, 1});
}

// "" when the two byte arrays of `count` elements of `dtype` agree, else the first element that
// differs, with both values.
std::string first_difference(const void* device, const void* host, std::int64_t count,
                             DType dtype) {
  const auto* a = static_cast<const unsigned char*>(device);
  const auto* b = static_cast<const unsigned char*>(host);
  const std::size_t size = dtype_size(dtype);
  for (std::int64_t i = 0; i < count; ++i) {
    if (std::memcmp(a + i * size, b + i * size, size) != 0) {
      const TensorView d = TensorView::contiguous(const_cast<unsigned char*>(a), dtype, {count});
      const TensorView h = TensorView::contiguous(const_cast<unsigned char*>(b), dtype, {count});
      return "element " + std::to_string(i) + " of " + std::to_string(count) + ": device " +
             std::to_string(detail::load_element(d, i)) + ", host " +
             std::to_string(detail::load_element(h, i));
    }
  }
  return "";
}

TEST(DeviceElementwise, RowAndElementPathsMatchHost) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(91);
  const ViewCase cases[] = {{"contiguous", 16, 48, 0},
                            {"packed rows", 16, 80, 16},
                            {"packed rows, odd offset", 16, 80, 1},
                            {"rows of 12", 12, 40, 0},
                            {"rows of 6", 6, 20, 2}};
  for (const ViewCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::int64_t storage = 2 * 7 * c.row + c.offset + 8;
    DeviceBuffer src(storage * 4), dst(storage * 4);
    for (DType from : {DType::f32, DType::bf16}) {
      for (DType to : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
        // Random bytes as the source (finite as both dtypes: normal floats, rounded where 16-bit),
        // and a poison of distinct values around and under the target view.
        std::vector<float> values = test::normal_vector<float>(storage, rng);
        std::vector<std::uint16_t> values16(storage);
        detail::copy(TensorView::contiguous(values.data(), DType::f32, {storage}),
                     TensorView::contiguous(values16.data(), DType::bf16, {storage}), nullptr);
        std::vector<float> poison = test::normal_vector<float>(storage, rng);
        std::vector<std::uint16_t> poison16(storage);
        detail::copy(TensorView::contiguous(poison.data(), DType::f32, {storage}),
                     TensorView::contiguous(poison16.data(), DType::bf16, {storage}), nullptr);
        void* host_src = from == DType::f32 ? static_cast<void*>(values.data()) : values16.data();
        void* host_dst = to == DType::f32 ? static_cast<void*>(poison.data()) : poison16.data();
        upload_bytes(src.data(), host_src, storage * dtype_size(from));
        upload_bytes(dst.data(), host_dst, storage * dtype_size(to));
        CudaStream stream;
        const std::size_t bytes = storage * dtype_size(to);
        std::vector<unsigned char> device_out(bytes);

        detail::copy(packed(src.data(), from, c, Memory::device),
                     packed(dst.data(), to, c, Memory::device), stream.get());
        if (from == to && from == DType::f32) {
          detail::add(packed(src.data(), from, c, Memory::device),
                      packed(dst.data(), to, c, Memory::device), stream.get());
        }
        stream.synchronize();
        RINGATTN_CUDA_CHECK(
            cudaMemcpy(device_out.data(), dst.data(), bytes, cudaMemcpyDeviceToHost));
        detail::copy(packed(host_src, from, c, Memory::host), packed(host_dst, to, c, Memory::host),
                     nullptr);
        if (from == to && from == DType::f32) {
          detail::add(packed(host_src, from, c, Memory::host),
                      packed(host_dst, to, c, Memory::host), nullptr);
        }
        EXPECT_EQ(first_difference(device_out.data(), host_dst, storage, to), "") << "copy / add";

        detail::fill(packed(dst.data(), to, c, Memory::device), -0.5, stream.get());
        stream.synchronize();
        RINGATTN_CUDA_CHECK(
            cudaMemcpy(device_out.data(), dst.data(), bytes, cudaMemcpyDeviceToHost));
        detail::fill(packed(host_dst, to, c, Memory::host), -0.5, nullptr);
        EXPECT_EQ(first_difference(device_out.data(), host_dst, storage, to), "") << "fill";
      }
    }
  }
}

}  // namespace
}  // namespace ringattn

#else

TEST(DeviceElementwise, MatchesHost) {
  RINGATTN_REQUIRE_GPUS(1);
}

TEST(DeviceElementwise, RowAndElementPathsMatchHost) {
  RINGATTN_REQUIRE_GPUS(1);
}

#endif
