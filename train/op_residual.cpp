// Residual adds: flat elementwise loops over the pool.
#include "train/op_residual.hpp"

#include <algorithm>

namespace ringattn::train::cpu {
namespace {

// Treats a flat buffer as rows of this many elements, for detail::parallel_rows.
constexpr std::int64_t kRowElements = 1024;

}  // namespace

template <typename T>
void residual_add(std::span<T> y, std::span<const T> x) {
  constexpr const char* kWhere = "train::cpu::residual_add";
  const auto n = static_cast<std::int64_t>(y.size());
  detail::check_positive(kWhere, "y.size()", n);
  detail::check_size(kWhere, "y", y, n, "y.size()");
  detail::check_size(kWhere, "x", x, n, "y.size()");
  const std::int64_t rows = (n + kRowElements - 1) / kRowElements;
  detail::parallel_rows(rows, kRowElements, [&](std::int64_t begin, std::int64_t end) {
    const std::int64_t stop = std::min(n, end * kRowElements);
    for (std::int64_t i = begin * kRowElements; i < stop; ++i) y[i] += x[i];
  });
}

template <typename T>
void residual_sum(std::span<T> out, std::span<const T> a, std::span<const T> b) {
  constexpr const char* kWhere = "train::cpu::residual_sum";
  const auto n = static_cast<std::int64_t>(out.size());
  detail::check_positive(kWhere, "out.size()", n);
  detail::check_size(kWhere, "out", out, n, "out.size()");
  detail::check_size(kWhere, "a", a, n, "out.size()");
  detail::check_size(kWhere, "b", b, n, "out.size()");
  const std::int64_t rows = (n + kRowElements - 1) / kRowElements;
  detail::parallel_rows(rows, kRowElements, [&](std::int64_t begin, std::int64_t end) {
    const std::int64_t stop = std::min(n, end * kRowElements);
    for (std::int64_t i = begin * kRowElements; i < stop; ++i) out[i] = a[i] + b[i];
  });
}

template void residual_add<float>(std::span<float>, std::span<const float>);
template void residual_add<double>(std::span<double>, std::span<const double>);
template void residual_sum<float>(std::span<float>, std::span<const float>, std::span<const float>);
template void residual_sum<double>(std::span<double>, std::span<const double>,
                                   std::span<const double>);

}  // namespace ringattn::train::cpu
