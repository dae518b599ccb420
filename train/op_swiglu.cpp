// SwiGLU. sigmoid(a) = 1 / (1 + exp(-a)) is safe at both ends: exp(-a) overflows to inf for very
// negative a and the quotient is 0. Its gradient, with s = sigmoid(a):
//
//   d out / d a = b * s * (1 + a * (1 - s))        d out / d b = a * s
#include "train/op_swiglu.hpp"

#include <cmath>

namespace ringattn::train::cpu {
namespace {

void check_shape(std::string_view where, const SwigluShape& s) {
  detail::check_positive(where, "shape.rows", s.rows);
  detail::check_positive(where, "shape.hidden", s.hidden);
}

template <typename T>
T sigmoid(T a) {
  return T(1) / (T(1) + std::exp(-a));
}

}  // namespace

template <typename T>
void swiglu_forward(std::span<T> out, std::span<const T> gate_up, const SwigluShape& s) {
  constexpr const char* kWhere = "train::cpu::swiglu_forward";
  check_shape(kWhere, s);
  detail::check_size(kWhere, "out", out, s.rows * s.hidden, "rows * hidden");
  detail::check_size(kWhere, "gate_up", gate_up, s.rows * 2 * s.hidden, "rows * 2 * hidden");
  detail::parallel_rows(s.rows, 2 * s.hidden, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const T* a = gate_up.data() + r * 2 * s.hidden;
      const T* b = a + s.hidden;
      T* o = out.data() + r * s.hidden;
      for (std::int64_t c = 0; c < s.hidden; ++c) o[c] = a[c] * sigmoid(a[c]) * b[c];
    }
  });
}

template <typename T>
void swiglu_backward(std::span<T> dgate_up, std::span<const T> dout, std::span<const T> gate_up,
                     const SwigluShape& s) {
  constexpr const char* kWhere = "train::cpu::swiglu_backward";
  check_shape(kWhere, s);
  detail::check_size(kWhere, "dgate_up", dgate_up, s.rows * 2 * s.hidden, "rows * 2 * hidden");
  detail::check_size(kWhere, "dout", dout, s.rows * s.hidden, "rows * hidden");
  detail::check_size(kWhere, "gate_up", gate_up, s.rows * 2 * s.hidden, "rows * 2 * hidden");
  detail::parallel_rows(s.rows, 2 * s.hidden, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const T* a = gate_up.data() + r * 2 * s.hidden;
      const T* b = a + s.hidden;
      const T* d = dout.data() + r * s.hidden;
      T* da = dgate_up.data() + r * 2 * s.hidden;
      T* db = da + s.hidden;
      for (std::int64_t c = 0; c < s.hidden; ++c) {
        const T sig = sigmoid(a[c]);
        da[c] = d[c] * b[c] * sig * (T(1) + a[c] * (T(1) - sig));
        db[c] = d[c] * a[c] * sig;
      }
    }
  });
}

#define RINGATTN_INSTANTIATE(T)                                                          \
  template void swiglu_forward<T>(std::span<T>, std::span<const T>, const SwigluShape&); \
  template void swiglu_backward<T>(std::span<T>, std::span<const T>, std::span<const T>, \
                                   const SwigluShape&);
RINGATTN_INSTANTIATE(float)
RINGATTN_INSTANTIATE(double)
#undef RINGATTN_INSTANTIATE

}  // namespace ringattn::train::cpu
