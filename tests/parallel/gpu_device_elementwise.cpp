// The ring's element-wise operations on the GPU (parallel/cuda/local_block_cuda.cu): fill,
// convert-copy (f32 <-> bf16/f16, strided) and add, against the host versions on the same values.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "parallel/local_block.hpp"
#include "ringattn/config.h"
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

template <typename T>
void upload(DeviceBuffer& buffer, const std::vector<T>& values) {
  RINGATTN_CUDA_CHECK(
      cudaMemcpy(buffer.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
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

}  // namespace
}  // namespace ringattn

#else

TEST(DeviceElementwise, MatchesHost) {
  RINGATTN_REQUIRE_GPUS(1);
}

#endif
