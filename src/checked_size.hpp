// Sizes computed from caller-given extents and strides, with overflow checks. A product that int64
// cannot hold wraps to a small or negative size that passes every later check and then indexes
// outside the buffers (heap corruption, faults on any rank); these throw Error (invalid_argument)
// instead, naming what was computed and its operands. Every size formed from a shape goes through
// them: element counts, byte sizes, strides x extents.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ringattn/error.hpp"

namespace ringattn::detail {

// a * b, or Error from `where`: "<what...> overflows int64 (<a> x <b>)". The parts of `what` are
// joined only on failure, so naming the product costs nothing on the way through.
template <typename... What>
std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view where,
                         const What&... what) {
  std::int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) {
    fail(where, what..., " overflows int64 (", a, " x ", b, ")");
  }
  return product;
}

// a + b, or Error from `where`: "<what...> overflows int64 (<a> + <b>)".
template <typename... What>
std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view where,
                         const What&... what) {
  std::int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) {
    fail(where, what..., " overflows int64 (", a, " + ", b, ")");
  }
  return sum;
}

// "[2, 3, 4]": the first `rank` extents of `shape`.
inline std::string extents_text(const std::int64_t* shape, int rank) {
  std::string text = "[";
  for (int i = 0; i < rank; ++i) text += concat(i ? ", " : "", shape[i]);
  return text + "]";
}

// The number of elements of a shape: the product of its first `rank` extents. Error from `where`
// naming `name` and the shape when an extent is negative ("q has extent -3 on axis 1 (shape
// [2, -3, 4, 5]); expected >= 0") or when the product overflows int64. A shape with a zero extent
// has no elements, however large the others.
inline std::int64_t checked_elements(const std::int64_t* shape, int rank, std::string_view name,
                                     std::string_view where) {
  bool empty = false;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] < 0) {
      fail(where, name, " has extent ", shape[i], " on axis ", i, " (shape ",
           extents_text(shape, rank), "); expected >= 0");
    }
    empty = empty || shape[i] == 0;
  }
  if (empty) return 0;
  std::int64_t count = 1;
  for (int i = 0; i < rank; ++i) {
    std::int64_t next = 0;
    // checked_mul's message, with the shape formed only on failure.
    if (__builtin_mul_overflow(count, shape[i], &next)) {
      fail(where, "the element count of ", name, " (shape ", extents_text(shape, rank),
           ") overflows int64 (", count, " x ", shape[i], ")");
    }
    count = next;
  }
  return count;
}

}  // namespace ringattn::detail
