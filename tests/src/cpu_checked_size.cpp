// The checked size helpers (src/checked_size.hpp): products and sums exactly at and just past the
// int64 boundary, of either sign; element counts that refuse negative extents and overflow; and
// TensorView's own sizes, which go through them.
#include "src/checked_size.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "ringattn/tensor.hpp"
#include "tests/common/attention_testing.hpp"

namespace ringattn {
namespace {

using detail::checked_add;
using detail::checked_elements;
using detail::checked_mul;
using test::ThrowsNaming;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
constexpr std::int64_t k2To31 = std::int64_t{1} << 31, k2To32 = std::int64_t{1} << 32;

// The error is invalid_argument and names where, what and both operands.
TEST(CheckedSize, ProductsAtTheBoundary) {
  EXPECT_EQ(checked_mul(kMax, 1, "f", "x"), kMax);
  EXPECT_EQ(checked_mul(k2To31, k2To32 - 1, "f", "x"), kMax - (k2To31 - 1));
  EXPECT_EQ(checked_mul(3037000499, 3037000499, "f", "x"), 9223372030926249001);  // floor(sqrt)
  EXPECT_EQ(checked_mul(0, kMax, "f", "x"), 0);
  EXPECT_TRUE(ThrowsNaming([] { checked_mul(k2To31, k2To32, "f", "the ", "bytes of q"); },
                           {"f: the bytes of q overflows int64 (2147483648 x 4294967296)"}));
  EXPECT_TRUE(ThrowsNaming([] { checked_mul(3037000500, 3037000500, "f", "x"); },
                           {"x overflows int64 (3037000500 x 3037000500)"}));
  EXPECT_TRUE(ThrowsNaming([] { checked_mul(kMax, 2, "f", "x"); }, {"(9223372036854775807 x 2)"}));
  try {
    checked_mul(kMax, kMax, "f", "x");
    ADD_FAILURE() << "no Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    EXPECT_EQ(e.where(), "f");
  }
}

// int64 holds -2^63 but not 2^63: the negative boundary is one further out.
TEST(CheckedSize, ProductsOfNegativeOperands) {
  EXPECT_EQ(checked_mul(-3, 4, "f", "x"), -12);
  EXPECT_EQ(checked_mul(-3, -4, "f", "x"), 12);
  EXPECT_EQ(checked_mul(-k2To31, k2To32, "f", "x"), kMin);
  EXPECT_EQ(checked_mul(kMin, 1, "f", "x"), kMin);
  EXPECT_TRUE(ThrowsNaming([] { checked_mul(-k2To31, -k2To32, "f", "x"); },
                           {"x overflows int64 (-2147483648 x -4294967296)"}));
  EXPECT_TRUE(ThrowsNaming([] { checked_mul(kMin, -1, "f", "x"); },
                           {"x overflows int64 (-9223372036854775808 x -1)"}));
  EXPECT_TRUE(ThrowsNaming([] { checked_mul(-k2To31, k2To32 + 1, "f", "x"); },
                           {"(-2147483648 x 4294967297)"}));
}

TEST(CheckedSize, SumsAtTheBoundary) {
  EXPECT_EQ(checked_add(kMax - 1, 1, "f", "x"), kMax);
  EXPECT_EQ(checked_add(kMin, kMax, "f", "x"), -1);
  EXPECT_EQ(checked_add(kMin + 1, -1, "f", "x"), kMin);
  EXPECT_TRUE(ThrowsNaming([] { checked_add(kMax, 1, "f", "the span"); },
                           {"f: the span overflows int64 (9223372036854775807 + 1)"}));
  EXPECT_TRUE(ThrowsNaming([] { checked_add(kMin, -1, "f", "x"); },
                           {"x overflows int64 (-9223372036854775808 + -1)"}));
}

TEST(CheckedSize, ElementCounts) {
  const std::int64_t fits[] = {k2To31, k2To32 - 1};
  EXPECT_EQ(checked_elements(fits, 2, "q", "f"), kMax - (k2To31 - 1));
  const std::int64_t past[] = {k2To31, 1, k2To32};
  EXPECT_TRUE(
      ThrowsNaming([&] { checked_elements(past, 3, "q", "f"); },
                   {"f: the element count of q (shape [2147483648, 1, 4294967296]) overflows int64 "
                    "(2147483648 x 4294967296)"}));
  const std::int64_t four[] = {std::int64_t{1} << 20, std::int64_t{1} << 20, std::int64_t{1} << 20,
                               std::int64_t{1} << 20};
  EXPECT_TRUE(ThrowsNaming([&] { checked_elements(four, 4, "k", "f"); },
                           {"element count of k", "(1152921504606846976 x 1048576)"}));
  // A zero extent anywhere: no elements, whatever the product of the others.
  const std::int64_t empty[] = {k2To32, k2To32, 0};
  EXPECT_EQ(checked_elements(empty, 3, "q", "f"), 0);
  EXPECT_EQ(checked_elements(empty, 0, "q", "f"), 1);  // rank 0: one element
  const std::int64_t negative[] = {2, -3, 4};
  EXPECT_TRUE(ThrowsNaming([&] { checked_elements(negative, 3, "v", "f"); },
                           {"f: v has extent -3 on axis 1 (shape [2, -3, 4]); expected >= 0"}));
  // Negative and zero: refused, not taken as empty.
  const std::int64_t negative_and_zero[] = {0, -1};
  EXPECT_TRUE(ThrowsNaming([&] { checked_elements(negative_and_zero, 2, "v", "f"); },
                           {"v has extent -1 on axis 1"}));
}

TEST(CheckedSize, TensorViewSizesAreChecked) {
  TensorView view;
  view.rank = 2;
  view.shape = {k2To32, k2To32, 0, 0};
  EXPECT_TRUE(
      ThrowsNaming([&] { (void)view.numel(); },
                   {"TensorView::numel: the element count of the view (shape "
                    "[4294967296, 4294967296]) overflows int64 (4294967296 x 4294967296)"}));
  view.shape = {3, -1, 0, 0};
  EXPECT_TRUE(ThrowsNaming([&] { (void)view.numel(); }, {"the view has extent -1 on axis 1"}));
  EXPECT_TRUE(ThrowsNaming(
      [] {
        (void)TensorView::contiguous(nullptr, DType::f32, {k2To32, k2To32});
      },
      {"TensorView::contiguous: a row-major stride overflows int64 (4294967296 x 4294967296)"}));
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::f32, {k2To31, k2To32 - 1}).strides[0],
            k2To32 - 1);
}

}  // namespace
}  // namespace ringattn
