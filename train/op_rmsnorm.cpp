// RMSNorm. Row reductions accumulate in double: free on the CPU next to the memory traffic, and it
// keeps the CPU op the more accurate twin of the CUDA one. With xhat = x * inv_rms, the backward is
//
//   dx = inv_rms * (dy * g - xhat * mean(dy * g * xhat))        dg = sum over rows of dy * xhat
//
// dx is a pass over rows; dg is a sum over rows, done as a second pass in which each task owns a
// slice of columns and walks the rows in order (deterministic, no atomics, no partial buffers).
#include "train/op_rmsnorm.hpp"

#include <algorithm>
#include <cmath>

#include "src/thread_pool.hpp"

namespace ringattn::train::cpu {
namespace {

// Columns per task of the dg pass: 64 floats = 4 cache lines of each row.
constexpr std::int64_t kColumnsPerTask = 64;

void check_shape(std::string_view where, const RmsNormShape& s) {
  detail::check_positive(where, "shape.rows", s.rows);
  detail::check_positive(where, "shape.dim", s.dim);
}

}  // namespace

template <typename T>
void rmsnorm_forward(std::span<T> y, std::span<T> inv_rms, std::span<const T> x,
                     std::span<const T> g, const RmsNormShape& s, double eps) {
  constexpr const char* kWhere = "train::cpu::rmsnorm_forward";
  check_shape(kWhere, s);
  detail::check_size(kWhere, "y", y, s.rows * s.dim, "rows * dim");
  detail::check_size(kWhere, "inv_rms", inv_rms, s.rows, "rows");
  detail::check_size(kWhere, "x", x, s.rows * s.dim, "rows * dim");
  detail::check_size(kWhere, "g", g, s.dim, "dim");
  if (!(eps > 0.0) || !std::isfinite(eps)) {
    ringattn::detail::fail(kWhere, "eps is ", eps, "; expected a finite value > 0");
  }
  detail::parallel_rows(s.rows, s.dim, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const T* xr = x.data() + r * s.dim;
      double squares = 0.0;
      for (std::int64_t c = 0; c < s.dim; ++c) squares += double(xr[c]) * double(xr[c]);
      const T inv = static_cast<T>(1.0 / std::sqrt(squares / double(s.dim) + eps));
      T* yr = y.data() + r * s.dim;
      for (std::int64_t c = 0; c < s.dim; ++c) yr[c] = xr[c] * inv * g[c];
      inv_rms[r] = inv;
    }
  });
}

template <typename T>
void rmsnorm_backward(std::span<T> dx, std::span<T> dg, std::span<const T> dy, std::span<const T> x,
                      std::span<const T> g, std::span<const T> inv_rms, const RmsNormShape& s,
                      Write dx_write, Write dg_write) {
  constexpr const char* kWhere = "train::cpu::rmsnorm_backward";
  check_shape(kWhere, s);
  detail::check_size(kWhere, "dx", dx, s.rows * s.dim, "rows * dim");
  detail::check_size(kWhere, "dg", dg, s.dim, "dim");
  detail::check_size(kWhere, "dy", dy, s.rows * s.dim, "rows * dim");
  detail::check_size(kWhere, "x", x, s.rows * s.dim, "rows * dim");
  detail::check_size(kWhere, "g", g, s.dim, "dim");
  detail::check_size(kWhere, "inv_rms", inv_rms, s.rows, "rows");

  detail::parallel_rows(s.rows, s.dim, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const T* xr = x.data() + r * s.dim;
      const T* dyr = dy.data() + r * s.dim;
      const T inv = inv_rms[r];
      double dot = 0.0;  // sum of dy * g * xhat
      for (std::int64_t c = 0; c < s.dim; ++c) dot += double(dyr[c]) * g[c] * xr[c] * inv;
      const T mean = static_cast<T>(dot / double(s.dim));
      T* dxr = dx.data() + r * s.dim;
      for (std::int64_t c = 0; c < s.dim; ++c) {
        const T value = inv * (dyr[c] * g[c] - xr[c] * inv * mean);
        dxr[c] = dx_write == Write::add ? dxr[c] + value : value;
      }
    }
  });

  const std::int64_t tasks = (s.dim + kColumnsPerTask - 1) / kColumnsPerTask;
  ringattn::detail::parallel_for(tasks, [&](std::int64_t task) {
    const std::int64_t begin = task * kColumnsPerTask;
    const std::int64_t end = std::min(s.dim, begin + kColumnsPerTask);
    double sums[kColumnsPerTask];
    for (std::int64_t c = begin; c < end; ++c) {
      sums[c - begin] = dg_write == Write::add ? double(dg[c]) : 0.0;
    }
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const T* xr = x.data() + r * s.dim;
      const T* dyr = dy.data() + r * s.dim;
      const T inv = inv_rms[r];
      for (std::int64_t c = begin; c < end; ++c) sums[c - begin] += double(dyr[c]) * xr[c] * inv;
    }
    for (std::int64_t c = begin; c < end; ++c) dg[c] = static_cast<T>(sums[c - begin]);
  });
}

#define RINGATTN_INSTANTIATE(T)                                                                 \
  template void rmsnorm_forward<T>(std::span<T>, std::span<T>, std::span<const T>,              \
                                   std::span<const T>, const RmsNormShape&, double);            \
  template void rmsnorm_backward<T>(std::span<T>, std::span<T>, std::span<const T>,             \
                                    std::span<const T>, std::span<const T>, std::span<const T>, \
                                    const RmsNormShape&, Write, Write);
RINGATTN_INSTANTIATE(float)
RINGATTN_INSTANTIATE(double)
#undef RINGATTN_INSTANTIATE

}  // namespace ringattn::train::cpu
