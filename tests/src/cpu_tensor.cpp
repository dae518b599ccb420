// TensorView: row-major views, strided views over packed buffers, and their description.
#include "ringattn/tensor.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace ringattn {
namespace {

using Dims = std::array<std::int64_t, TensorView::kMaxRank>;

TEST(TensorView, ContiguousIsRowMajor) {
  float storage = 0.0f;
  const TensorView view =
      TensorView::contiguous(&storage, DType::bf16, {2, 3, 4, 5}, Memory::device);
  EXPECT_EQ(view.data, &storage);
  EXPECT_EQ(view.dtype, DType::bf16);
  EXPECT_EQ(view.memory, Memory::device);
  EXPECT_EQ(view.rank, 4);
  EXPECT_EQ(view.shape, (Dims{2, 3, 4, 5}));
  EXPECT_EQ(view.strides, (Dims{60, 20, 5, 1}));
  EXPECT_EQ(view.numel(), 120);
  EXPECT_TRUE(view.is_contiguous());
  EXPECT_EQ(view.offset(1, 2, 3, 4), 119);
}

TEST(TensorView, ContiguousOfLowerRank) {
  float storage = 0.0f;
  const TensorView matrix = TensorView::contiguous(&storage, DType::f64, {6, 7});
  EXPECT_EQ(matrix.memory, Memory::host);
  EXPECT_EQ(matrix.rank, 2);
  EXPECT_EQ(matrix.shape[0], 6);
  EXPECT_EQ(matrix.shape[1], 7);
  EXPECT_EQ(matrix.strides[0], 7);
  EXPECT_EQ(matrix.strides[1], 1);
  EXPECT_EQ(matrix.numel(), 42);
  EXPECT_TRUE(matrix.is_contiguous());

  const TensorView lse = TensorView::contiguous(&storage, DType::f32, {2, 8, 17});
  EXPECT_EQ(lse.rank, 3);
  EXPECT_EQ(lse.strides[0], 8 * 17);
  EXPECT_EQ(lse.strides[1], 17);
  EXPECT_EQ(lse.strides[2], 1);
  EXPECT_EQ(lse.numel(), 2 * 8 * 17);
  EXPECT_EQ(lse.offset(1, 7, 16), 2 * 8 * 17 - 1);

  const TensorView vector = TensorView::contiguous(&storage, DType::f16, {9});
  EXPECT_EQ(vector.rank, 1);
  EXPECT_EQ(vector.strides[0], 1);
  EXPECT_EQ(vector.numel(), 9);
  EXPECT_TRUE(vector.is_contiguous());
}

TEST(TensorView, EmptyDimensionHasNoElements) {
  float storage = 0.0f;
  EXPECT_EQ(TensorView::contiguous(&storage, DType::f32, {2, 0, 4}).numel(), 0);
}

// Q, K and V of a packed [B, S, 3, H, D] buffer are [B, S, H, D] views with sequence stride 3*H*D.
TEST(TensorView, PackedQkvGivesStridedViews) {
  constexpr std::int64_t B = 2, S = 5, H = 3, D = 4;
  std::vector<float> packed(B * S * 3 * H * D);
  const Dims packed_strides{S * 3 * H * D, 3 * H * D, D, 1};
  const TensorView q =
      TensorView::contiguous(packed.data(), DType::f32, {B, S, H, D}, Memory::device)
          .with_strides({packed_strides[0], packed_strides[1], D, 1});
  EXPECT_EQ(q.data, packed.data());
  EXPECT_EQ(q.dtype, DType::f32);
  EXPECT_EQ(q.memory, Memory::device);
  EXPECT_EQ(q.rank, 4);
  EXPECT_EQ(q.shape, (Dims{B, S, H, D}));
  EXPECT_EQ(q.strides, packed_strides);
  EXPECT_EQ(q.numel(), B * S * H * D);
  EXPECT_FALSE(q.is_contiguous());
  // Element (b, s, h, d) of K sits H*D after the one of Q.
  EXPECT_EQ(q.offset(1, 4, 2, 3) + H * D,
            1 * S * 3 * H * D + 4 * 3 * H * D + 1 * H * D + 2 * D + 3);
}

TEST(TensorView, WithStridesLeavesTheOriginalAlone) {
  float storage = 0.0f;
  const TensorView view = TensorView::contiguous(&storage, DType::f32, {2, 3, 4, 5});
  const TensorView transposed = view.with_strides({60, 5, 15, 1});  // [B, H, S, D] in memory
  EXPECT_EQ(view.strides, (Dims{60, 20, 5, 1}));
  EXPECT_EQ(transposed.strides, (Dims{60, 5, 15, 1}));
  EXPECT_EQ(transposed.shape, view.shape);
  EXPECT_EQ(transposed.numel(), 120);
  EXPECT_FALSE(transposed.is_contiguous());
  EXPECT_TRUE(view.with_strides({60, 20, 5, 1}).is_contiguous());
}

TEST(TensorView, DescribeNamesDtypeShapeAndMemory) {
  float storage = 0.0f;
  const std::string device =
      TensorView::contiguous(&storage, DType::bf16, {2, 128, 8, 64}, Memory::device).describe();
  EXPECT_NE(device.find("bf16[2, 128, 8, 64]"), std::string::npos) << device;
  EXPECT_NE(device.find("device"), std::string::npos) << device;
  const std::string host = TensorView::contiguous(&storage, DType::f64, {3, 4}).describe();
  EXPECT_NE(host.find("f64[3, 4]"), std::string::npos) << host;
  EXPECT_NE(host.find("host"), std::string::npos) << host;
}

}  // namespace
}  // namespace ringattn
