// RoPE. Angles are formed and their sines and cosines taken in double: at position 1e5 the angle
// of the fastest pair is 1e5 radians, where a float angle would already be off by ~4e-3 rad. Each
// token's table of head_dim / 2 (cos, sin) pairs is computed once and shared by all its heads.
#include "train/op_rope.hpp"

#include <cmath>
#include <vector>

namespace ringattn::train::cpu {
void check_rope_shape(std::string_view where, const RopeShape& s) {
  detail::check_positive(where, "shape.tokens", s.tokens);
  detail::check_positive(where, "shape.heads", s.heads);
  detail::check_positive(where, "shape.head_dim", s.head_dim);
  if (s.head_dim % 2 != 0) {
    ringattn::detail::fail(where, "shape.head_dim is ", s.head_dim, "; expected an even number");
  }
  if (s.token_stride < s.heads * s.head_dim) {
    ringattn::detail::fail(where, "shape.token_stride is ", s.token_stride,
                           "; expected >= heads * head_dim = ", s.heads * s.head_dim);
  }
}

namespace {

template <typename T>
void rotate(std::span<T> x, std::span<const std::int64_t> positions, const RopeShape& s,
            double theta, double direction, std::string_view where, std::string_view x_name) {
  check_rope_shape(where, s);
  if (!(theta > 0.0) || !std::isfinite(theta)) {
    ringattn::detail::fail(where, "theta is ", theta, "; expected a finite value > 0");
  }
  detail::check_extent(where, x_name, x, (s.tokens - 1) * s.token_stride + s.heads * s.head_dim,
                       "(tokens - 1) * token_stride + heads * head_dim");
  detail::check_size(where, "positions", positions, s.tokens, "tokens");
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    if (positions[t] < 0) {
      ringattn::detail::fail(where, "positions[", t, "] is ", positions[t], "; expected >= 0");
    }
  }

  const std::int64_t half = s.head_dim / 2;
  std::vector<double> inv_freq(half);
  for (std::int64_t i = 0; i < half; ++i) {
    inv_freq[i] = std::pow(theta, -2.0 * double(i) / double(s.head_dim));
  }
  detail::parallel_rows(s.tokens, s.heads * s.head_dim, [&](std::int64_t begin, std::int64_t end) {
    std::vector<T> cos_table(half), sin_table(half);
    for (std::int64_t t = begin; t < end; ++t) {
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = double(positions[t]) * inv_freq[i];
        cos_table[i] = static_cast<T>(std::cos(angle));
        sin_table[i] = static_cast<T>(direction * std::sin(angle));
      }
      for (std::int64_t h = 0; h < s.heads; ++h) {
        T* lo = x.data() + t * s.token_stride + h * s.head_dim;
        T* hi = lo + half;
        for (std::int64_t i = 0; i < half; ++i) {
          const T a = lo[i], b = hi[i];
          lo[i] = a * cos_table[i] - b * sin_table[i];
          hi[i] = a * sin_table[i] + b * cos_table[i];
        }
      }
    }
  });
}

}  // namespace

template <typename T>
void rope_forward(std::span<T> x, std::span<const std::int64_t> positions, const RopeShape& s,
                  double theta) {
  rotate(x, positions, s, theta, 1.0, "train::cpu::rope_forward", "x");
}

template <typename T>
void rope_backward(std::span<T> dx, std::span<const std::int64_t> positions, const RopeShape& s,
                   double theta) {
  rotate(dx, positions, s, theta, -1.0, "train::cpu::rope_backward", "dx");
}

#define RINGATTN_INSTANTIATE(T)                                                                 \
  template void rope_forward<T>(std::span<T>, std::span<const std::int64_t>, const RopeShape&,  \
                                double);                                                        \
  template void rope_backward<T>(std::span<T>, std::span<const std::int64_t>, const RopeShape&, \
                                 double);
RINGATTN_INSTANTIATE(float)
RINGATTN_INSTANTIATE(double)
#undef RINGATTN_INSTANTIATE

}  // namespace ringattn::train::cpu
