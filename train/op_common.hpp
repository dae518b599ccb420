// What every op of the model shares: the overwrite-or-add choice for outputs, and the argument
// checks that name a bad buffer or size before anything is written.
//
// The ops take their buffers as std::span (pointer and element count) plus the logical sizes in a
// small shape struct; each checks that every span is non-null and holds exactly the elements its
// shape implies (or, for strided views, at least the elements the view reaches).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>

#include "ringattn/error.hpp"
#include "src/thread_pool.hpp"

namespace ringattn::train {

// Whether an op's output replaces the buffer's contents or is added to them (gradients that
// several paths contribute to, gradient accumulation over micro-batches).
enum class Write { overwrite, add };

namespace detail {

// `name` is positive.
inline void check_positive(std::string_view where, std::string_view name, std::int64_t value) {
  if (value <= 0) ringattn::detail::fail(where, name, " is ", value, "; expected > 0");
}

// `buffer` is non-null and holds exactly `expected` elements; `formula` says where the number
// comes from ("rows * dim").
template <typename T>
void check_size(std::string_view where, std::string_view name, std::span<T> buffer,
                std::int64_t expected, std::string_view formula) {
  if (buffer.data() == nullptr) ringattn::detail::fail(where, name, " is null");
  if (static_cast<std::int64_t>(buffer.size()) != expected) {
    ringattn::detail::fail(where, name, " has ", buffer.size(), " elements; expected ", formula,
                           " = ", expected);
  }
}

// `buffer` is non-null and holds at least the `extent` elements a strided view reaches.
template <typename T>
void check_extent(std::string_view where, std::string_view name, std::span<T> buffer,
                  std::int64_t extent, std::string_view formula) {
  if (buffer.data() == nullptr) ringattn::detail::fail(where, name, " is null");
  if (static_cast<std::int64_t>(buffer.size()) < extent) {
    ringattn::detail::fail(where, name, " has ", buffer.size(), " elements; the view reaches ",
                           formula, " = ", extent);
  }
}

// Calls body(begin, end) for consecutive blocks of rows, in parallel. A block holds about 16K
// elements (whole rows, at least one): enough work to amortise the pool's dispatch of a task (a
// few microseconds), small enough to spread a few thousand rows over the threads. The blocks
// depend only on the sizes, never on the thread count.
template <typename Body>
void parallel_rows(std::int64_t rows, std::int64_t row_elements, const Body& body) {
  constexpr std::int64_t kElementsPerTask = 16384;
  const std::int64_t block = std::max<std::int64_t>(1, kElementsPerTask / row_elements);
  ringattn::detail::parallel_for((rows + block - 1) / block, [&](std::int64_t task) {
    body(task * block, std::min(rows, (task + 1) * block));
  });
}

}  // namespace detail
}  // namespace ringattn::train
