// The element-wise operations of the ring's backend switch on host tensors: fill, convert-copy
// and add over strided views (checked element by element against loops written here), their
// argument checks, and the device entry points (and the NCCL communicator) of a library built
// without CUDA.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "parallel/local_block.hpp"
#include "ringattn/config.h"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/runtime.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/head_dims.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::ThrowsNaming;

// A [2, 5, 3, 4] view of [2, 3, 5, 4] storage (heads before tokens), with room to spare after it.
template <typename T>
struct Strided {
  std::vector<T> storage;
  TensorView view;
  explicit Strided(T fill) : storage(2 * 3 * 5 * 4 + 7, fill) {
    view = test::strided_view(storage, 0, {2, 5, 3, 4}, {60, 4, 20, 1});
  }
};

TEST(LocalBlockElementwise, FillWritesTheViewOnly) {
  Strided<double> t(1.5);
  detail::fill(t.view, -std::numeric_limits<double>::infinity(), nullptr);
  for (std::size_t i = 0; i < t.storage.size(); ++i) {
    EXPECT_EQ(t.storage[i], i < 120 ? -std::numeric_limits<double>::infinity() : 1.5) << i;
  }
  std::vector<float> lse(2 * 3 * 7, 2.0f);
  detail::fill(TensorView::contiguous(lse.data(), DType::f32, {2, 3, 7}), 0.0, nullptr);
  for (float value : lse) EXPECT_EQ(value, 0.0f);
}

TEST(LocalBlockElementwise, CopyConvertsBetweenLayoutsAndDtypes) {
  std::mt19937_64 rng = test::make_rng(80);
  Strided<double> src(0.0);
  test::fill_normal(src.storage, rng);
  std::vector<float> to_f32(120, std::nanf(""));
  const TensorView dst = TensorView::contiguous(to_f32.data(), DType::f32, {2, 5, 3, 4});
  detail::copy(src.view, dst, nullptr);
  const std::vector<double> expected = test::read_view(src.view);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(to_f32[i], static_cast<float>(expected[i])) << i;
  }
  // Back into a strided f64 view, then bf16: exact widening, round-to-nearest narrowing.
  Strided<double> back(0.0);
  detail::copy(dst, back.view, nullptr);
  const std::vector<double> round_trip = test::read_view(back.view);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(round_trip[i], static_cast<double>(static_cast<float>(expected[i]))) << i;
  }
  std::vector<std::uint16_t> bf16(120);
  detail::copy(dst, TensorView::contiguous(bf16.data(), DType::bf16, {2, 5, 3, 4}), nullptr);
  for (std::size_t i = 0; i < bf16.size(); ++i) EXPECT_EQ(bf16[i], float_to_bf16(to_f32[i])) << i;
}

TEST(LocalBlockElementwise, AddAccumulates) {
  std::mt19937_64 rng = test::make_rng(81);
  Strided<float> dst(0.0f);
  test::fill_normal(dst.storage, rng);
  const std::vector<double> before = test::read_view(dst.view);
  std::vector<float> src = test::normal_vector<float>(120, rng);
  detail::add(TensorView::contiguous(src.data(), DType::f32, {2, 5, 3, 4}), dst.view, nullptr);
  const std::vector<double> after = test::read_view(dst.view);
  for (std::size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i], static_cast<float>(static_cast<float>(before[i]) + src[i])) << i;
  }
}

TEST(LocalBlockElementwise, ArgumentChecks) {
  std::vector<float> a(24), b(24);
  std::vector<double> c(24);
  const TensorView a1 = TensorView::contiguous(a.data(), DType::f32, {2, 3, 4});
  const TensorView b1 = TensorView::contiguous(b.data(), DType::f32, {2, 4, 3});
  const TensorView c1 = TensorView::contiguous(c.data(), DType::f64, {2, 3, 4});
  EXPECT_TRUE(ThrowsNaming([&] { detail::copy(a1, b1, nullptr); },
                           {"copy", "src is f32[2, 3, 4]", "dst is f32[2, 4, 3]", "same shape"}));
  EXPECT_TRUE(
      ThrowsNaming([&] { detail::add(a1, c1, nullptr); }, {"add", "one accumulator dtype"}));
}

TEST(LocalBlockElementwise, DeviceNeedsCuda) {
  if (built_with_cuda()) GTEST_SKIP() << "the CUDA build runs these on the GPU (gpu tests)";
  std::vector<float> a(8);
  TensorView device = TensorView::contiguous(a.data(), DType::f32, {8}, Memory::device);
  EXPECT_TRUE(ThrowsNaming([&] { detail::fill(device, 0.0, nullptr); },
                           {"device::fill", "built with CUDA"}));
  EXPECT_TRUE(ThrowsNaming([&] { detail::copy(device, device, nullptr); }, {"device::copy"}));
  EXPECT_TRUE(ThrowsNaming([&] { detail::add(device, device, nullptr); }, {"device::add"}));
#if !RINGATTN_WITH_CUDA
  EXPECT_TRUE(ThrowsNaming([] { nccl_world_communicator(); },
                           {"nccl_world_communicator", "NCCL", "built with CUDA"}));
#endif
}

TEST(LocalBlockChecks, BlockDtypesAndDeviceLayout) {
  EXPECT_NO_THROW(detail::check_block_dtype(DType::f64, 16, Memory::host, "ring"));
  EXPECT_TRUE(ThrowsNaming([] { detail::check_block_dtype(DType::bf16, 64, Memory::host, "ring"); },
                           {"ring: q has dtype bf16", "CPU block", "f32 or f64"}));
  EXPECT_TRUE(
      ThrowsNaming([] { detail::check_block_dtype(DType::f32, 64, Memory::device, "ring"); },
                   {"CUDA block", "bf16 or f16"}));
  EXPECT_TRUE(
      ThrowsNaming([] { detail::check_block_dtype(DType::bf16, 80, Memory::device, "ring"); },
                   {"head_dim 80 is not supported", test::built_cuda_head_dims_text()}));
  // A v_head_dim of its own: any on the host; on the device 192/128 where the build has head dim
  // 192 (refused as left out where not), no other pair (unsupported, naming both and the pairs
  // taken).
  EXPECT_NO_THROW(detail::check_block_dtype(DType::f32, 192, 128, Memory::host, "ring"));
  EXPECT_NO_THROW(detail::check_block_dtype(DType::f32, 128, 64, Memory::host, "ring"));
  const std::int64_t built = test::kBuiltCudaHeadDims[0];
  EXPECT_NO_THROW(detail::check_block_dtype(DType::bf16, built, built, Memory::device, "ring"));
  const auto refusal = [](DType dtype, std::int64_t d, std::int64_t dv) -> std::string {
    try {
      detail::check_block_dtype(dtype, d, dv, Memory::device, "ring");
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::unsupported) << error.what();
      return error.what();
    }
    return "";
  };
  for (const DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    if (test::kBuiltCudaValueDimPair) {
      EXPECT_EQ(refusal(dtype, 192, 128), "") << "192/128 refused on the device";
    } else {
      EXPECT_NE(refusal(dtype, 192, 128).find("ring: " + test::cuda_value_dim_pair_left_out()),
                std::string::npos)
          << refusal(dtype, 192, 128);
    }
    // The pair reversed, another d_v for 192, d_v 128 for another d_qk, and pairs of built head
    // dims.
    for (const auto& [d, dv] : {std::pair<std::int64_t, std::int64_t>{128, 192},
                                {192, 64}, {256, 128}, {128, 64}, {64, 128}, {192, 96}}) {
      const std::string message = refusal(dtype, d, dv);
      EXPECT_NE(message.find("ring: " + test::cuda_value_dim_refusal(d, dv)), std::string::npos)
          << "head_dim " << d << " with v_head_dim " << dv << ": \"" << message << "\"";
    }
  }
  // Layout rules of device tensors (no memory is touched; the views only describe it).
  alignas(16) static std::uint16_t storage[64];
  TensorView q = TensorView::contiguous(storage, DType::bf16, {1, 2, 1, 16}, Memory::device);
  EXPECT_NO_THROW(detail::check_block_layout(q, "q", "ring"));
  EXPECT_TRUE(ThrowsNaming(
      [&] {
        detail::check_block_layout(q.with_strides({32, 16, 16, 2}), "q", "ring");
      },
      {"q has stride 2 along head_dim"}));
  EXPECT_TRUE(ThrowsNaming(
      [&] {
        detail::check_block_layout(q.with_strides({36, 18, 16, 1}), "q", "ring");
      },
      {"q has stride 18 on axis 1", "multiple of 8"}));
  TensorView shifted = q;
  shifted.data = storage + 1;
  EXPECT_TRUE(
      ThrowsNaming([&] { detail::check_block_layout(shifted, "q", "ring"); }, {"16-byte aligned"}));
  // Host tensors have no layout rule.
  shifted.memory = Memory::host;
  EXPECT_NO_THROW(detail::check_block_layout(shifted.with_strides({36, 18, 16, 2}), "q", "ring"));
}

}  // namespace
}  // namespace ringattn
