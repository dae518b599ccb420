// One blocked GEMM engine, C[m, n] (+)= sum_p A(m, p) B(p, n), serves the three products of a
// linear layer: A and B are read through (row, column) strides, so X W^T, dY W and dY^T X differ
// only in the strides handed to it. The structure is the classic one (Goto; BLIS):
//
//   slab (kSlabRows x kSlabCols of C)
//     depth slice (kDepth)              A and B slices packed once into contiguous micro-panels,
//                                       the packing spread over the pool, then shared read-only
//       C block (kBlockRows x kBlockCols)  one task of the pool; tasks never share output elements
//         micro-tile (kMicroRows x NR)  NR = 64 bytes of T, held in registers over the slice
//
// The micro-kernel is an outer-product update acc[i][j] += a[i] * b[j] over unit-stride panels: it
// vectorises along j without reassociating any sum, so every element of C is summed over the
// inner dimension in order, whatever the thread count. (Packing inside each block task instead
// re-packed B once per row block and cost a third of the time.)
#include "train/op_matmul.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "src/thread_pool.hpp"

namespace ringattn::train::cpu {
namespace {

// A micro-tile of 6 x (64 bytes) is 12 AVX registers of accumulators, leaving 4 of the 16 for the
// B row and the broadcast A element: no spills.
constexpr std::int64_t kMicroRows = 6;
template <typename T>
constexpr std::int64_t kMicroCols = 64 / sizeof(T);

// A depth slice of 256: the B micro-panel (256 x 64 bytes = 16 KiB) stays in L1 while the A
// micro-panels of the block stream past it; the packed A block (96 x 256 x 4 bytes = 96 KiB) and
// B block (256 x 256 x 4 bytes = 256 KiB) fit in L2. The block sizes are multiples of the
// micro-tile for both element types.
constexpr std::int64_t kDepth = 256;
constexpr std::int64_t kBlockRows = 96;
constexpr std::int64_t kBlockCols = 256;

// A slab of 2048 rows or columns bounds each packed slice to 2048 x 256 elements (2 MiB of
// float, 4 MiB of double): the slices stay in L3 while every block of the slab reads them.
constexpr std::int64_t kSlabRows = 2048;
constexpr std::int64_t kSlabCols = 2048;

// A(i, j) = data[i * row_stride + j * col_stride].
template <typename T>
struct Operand {
  const T* data;
  std::int64_t row_stride;
  std::int64_t col_stride;
};

template <typename T>
struct Gemm {
  std::int64_t m, n, depth;
  Operand<T> a;  // m x depth
  Operand<T> b;  // depth x n
  T* c;          // m x n, row-major
  Write write;
};

// c[i * ldc + j] (+)= sum_p a[p * MR + i] * b[p * NR + j] for a full MR x NR tile of C, added
// to C's previous values when `add`, else written over them.
template <typename T>
using MicroKernel = void (*)(std::int64_t depth, const T* a, const T* b, T* c, std::int64_t ldc,
                             bool add);

// Written with GCC vector types (32 bytes: two per micro-tile row) because the auto-vectoriser
// picks the wrong loop of the plain triple loop; on a target without 32-byte registers each
// vector operation becomes two. The accumulators start from C (or zero), so an element's sum is
// ((c + a_0 b_0) + a_1 b_1) + ... across the depth slices, in the same order for every element.
template <typename T>
[[gnu::always_inline]] inline void micro_kernel_body(std::int64_t depth, const T* __restrict a,
                                                     const T* __restrict b, T* __restrict c,
                                                     std::int64_t ldc, bool add) {
  using Vec [[gnu::vector_size(32)]] = T;
  constexpr std::int64_t kLanes = 32 / sizeof(T);
  static_assert(kMicroCols<T> == 2 * kLanes);
  Vec acc[kMicroRows][2] = {};
  if (add) {
    for (std::int64_t i = 0; i < kMicroRows; ++i) {
      std::memcpy(&acc[i][0], c + i * ldc, sizeof(Vec));
      std::memcpy(&acc[i][1], c + i * ldc + kLanes, sizeof(Vec));
    }
  }
  for (std::int64_t p = 0; p < depth; ++p) {
    Vec b0, b1;
    std::memcpy(&b0, b + p * 2 * kLanes, sizeof(Vec));
    std::memcpy(&b1, b + p * 2 * kLanes + kLanes, sizeof(Vec));
    const T* ap = a + p * kMicroRows;
    for (std::int64_t i = 0; i < kMicroRows; ++i) {
      acc[i][0] += b0 * ap[i];
      acc[i][1] += b1 * ap[i];
    }
  }
  for (std::int64_t i = 0; i < kMicroRows; ++i) {
    std::memcpy(c + i * ldc, &acc[i][0], sizeof(Vec));
    std::memcpy(c + i * ldc + kLanes, &acc[i][1], sizeof(Vec));
  }
}

template <typename T>
void micro_kernel_generic(std::int64_t depth, const T* a, const T* b, T* c, std::int64_t ldc,
                          bool add) {
  micro_kernel_body(depth, a, b, c, ldc, add);
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same code compiled for AVX2 + FMA (the baseline build targets plain x86-64), chosen at run
// time when the CPU has them. FMA rounds once per multiply-add, so results differ in the last
// bits from the generic path (between machines, never between runs on one machine).
template <typename T>
[[gnu::target("avx2,fma")]] void micro_kernel_avx2(std::int64_t depth, const T* a, const T* b, T* c,
                                                   std::int64_t ldc, bool add) {
  micro_kernel_body(depth, a, b, c, ldc, add);
}
#endif

template <typename T>
MicroKernel<T> select_micro_kernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return &micro_kernel_avx2<T>;
  }
#endif
  return &micro_kernel_generic<T>;
}

// One micro-panel: out[p * width + i] = base[i * along_i + p * along_p] for i < count (rows of A
// or columns of B) and p < depth; lanes count..width are zero. The loops run along whichever
// stride is 1, so the reads are contiguous.
template <typename T>
void pack_panel(const T* base, std::int64_t along_i, std::int64_t along_p, std::int64_t count,
                std::int64_t width, std::int64_t depth, T* out) {
  if (count < width) std::fill(out, out + depth * width, T(0));
  if (along_i == 1) {
    for (std::int64_t p = 0; p < depth; ++p) {
      for (std::int64_t i = 0; i < count; ++i) out[p * width + i] = base[p * along_p + i];
    }
  } else {
    for (std::int64_t i = 0; i < count; ++i) {
      for (std::int64_t p = 0; p < depth; ++p) out[p * width + i] = base[i * along_i + p * along_p];
    }
  }
}

// The C tiles of one block (kBlockRows x kBlockCols at (row0, col0), relative to the packed
// slices) over one depth slice.
template <typename T>
void compute_block(const Gemm<T>& g, MicroKernel<T> kernel, const T* a_packed, const T* b_packed,
                   std::int64_t depth, bool add, std::int64_t row0, std::int64_t rows,
                   std::int64_t col0, std::int64_t cols, std::int64_t c_row0, std::int64_t c_col0) {
  constexpr std::int64_t kCols = kMicroCols<T>;
  T tile[kMicroRows * kCols];
  for (std::int64_t j0 = col0; j0 < col0 + cols; j0 += kCols) {
    const T* b_panel = b_packed + j0 * depth;
    const std::int64_t valid_cols = std::min(kCols, col0 + cols - j0);
    for (std::int64_t i0 = row0; i0 < row0 + rows; i0 += kMicroRows) {
      const T* a_panel = a_packed + i0 * depth;
      const std::int64_t valid_rows = std::min(kMicroRows, row0 + rows - i0);
      T* c = g.c + (c_row0 + i0) * g.n + c_col0 + j0;
      if (valid_rows == kMicroRows && valid_cols == kCols) {
        kernel(depth, a_panel, b_panel, c, g.n, add);
        continue;
      }
      // An edge tile goes through a full-size copy (the same arithmetic, in the same order).
      std::fill(tile, tile + kMicroRows * kCols, T(0));
      for (std::int64_t i = 0; i < valid_rows && add; ++i) {
        std::copy_n(c + i * g.n, valid_cols, tile + i * kCols);
      }
      kernel(depth, a_panel, b_panel, tile, kCols, add);
      for (std::int64_t i = 0; i < valid_rows; ++i) {
        std::copy_n(tile + i * kCols, valid_cols, c + i * g.n);
      }
    }
  }
}

// For each (row slab, column slab, depth slice): pack the slab's A and B slices once, spread over
// the pool by micro-panel, then compute its C blocks, spread over the pool by block. Every task
// of the pool reads the same packed slices.
template <typename T>
void run_gemm(const Gemm<T>& g) {
  static const MicroKernel<T> kernel = select_micro_kernel<T>();
  constexpr std::int64_t kCols = kMicroCols<T>;
  // The caller's packing buffers, kept for the thread's lifetime: allocating megabytes per call
  // would go to mmap and munmap each time. (Lambdas below use the pointers: in a worker thread
  // the names would denote that thread's own buffers.)
  thread_local std::vector<T> a_buffer, b_buffer;
  constexpr std::int64_t kPaddedRows = (kSlabRows + kMicroRows - 1) / kMicroRows * kMicroRows;
  constexpr std::int64_t kPaddedCols = (kSlabCols + kCols - 1) / kCols * kCols;
  a_buffer.resize(std::max<std::size_t>(a_buffer.size(), kPaddedRows * kDepth));
  b_buffer.resize(std::max<std::size_t>(b_buffer.size(), kPaddedCols * kDepth));
  T* const a_packed = a_buffer.data();
  T* const b_packed = b_buffer.data();

  for (std::int64_t slab_row0 = 0; slab_row0 < g.m; slab_row0 += kSlabRows) {
    const std::int64_t rows = std::min(kSlabRows, g.m - slab_row0);
    const std::int64_t a_panels = (rows + kMicroRows - 1) / kMicroRows;
    for (std::int64_t slab_col0 = 0; slab_col0 < g.n; slab_col0 += kSlabCols) {
      const std::int64_t cols = std::min(kSlabCols, g.n - slab_col0);
      const std::int64_t b_panels = (cols + kCols - 1) / kCols;
      const std::int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
      const std::int64_t col_blocks = (cols + kBlockCols - 1) / kBlockCols;
      for (std::int64_t p0 = 0; p0 < g.depth; p0 += kDepth) {
        const std::int64_t depth = std::min(kDepth, g.depth - p0);
        ringattn::detail::parallel_for(a_panels + b_panels, [&](std::int64_t panel) {
          if (panel < a_panels) {
            const std::int64_t row = slab_row0 + panel * kMicroRows;
            pack_panel(g.a.data + row * g.a.row_stride + p0 * g.a.col_stride, g.a.row_stride,
                       g.a.col_stride, std::min(kMicroRows, g.m - row), kMicroRows, depth,
                       a_packed + panel * kMicroRows * depth);
          } else {
            const std::int64_t col = slab_col0 + (panel - a_panels) * kCols;
            pack_panel(g.b.data + p0 * g.b.row_stride + col * g.b.col_stride, g.b.col_stride,
                       g.b.row_stride, std::min(kCols, g.n - col), kCols, depth,
                       b_packed + (panel - a_panels) * kCols * depth);
          }
        });
        const bool add = p0 > 0 || g.write == Write::add;
        ringattn::detail::parallel_for(row_blocks * col_blocks, [&](std::int64_t block) {
          const std::int64_t row0 = block / col_blocks * kBlockRows;
          const std::int64_t col0 = block % col_blocks * kBlockCols;
          compute_block(g, kernel, a_packed, b_packed, depth, add, row0,
                        std::min(kBlockRows, rows - row0), col0, std::min(kBlockCols, cols - col0),
                        slab_row0, slab_col0);
        });
      }
    }
  }
}

void check_shape(std::string_view where, const MatmulShape& s) {
  detail::check_positive(where, "shape.rows", s.rows);
  detail::check_positive(where, "shape.in_features", s.in_features);
  detail::check_positive(where, "shape.out_features", s.out_features);
}

}  // namespace

template <typename T>
void matmul_forward(std::span<T> y, std::span<const T> x, std::span<const T> w,
                    const MatmulShape& s, Write write) {
  constexpr const char* kWhere = "train::cpu::matmul_forward";
  check_shape(kWhere, s);
  detail::check_size(kWhere, "y", y, s.rows * s.out_features, "rows * out_features");
  detail::check_size(kWhere, "x", x, s.rows * s.in_features, "rows * in_features");
  detail::check_size(kWhere, "w", w, s.out_features * s.in_features, "out_features * in_features");
  // Y[r, o] = sum_i X[r, i] W[o, i]: B(i, o) = W[o * in + i].
  run_gemm<T>({.m = s.rows,
               .n = s.out_features,
               .depth = s.in_features,
               .a = {x.data(), s.in_features, 1},
               .b = {w.data(), 1, s.in_features},
               .c = y.data(),
               .write = write});
}

template <typename T>
void matmul_backward_input(std::span<T> dx, std::span<const T> dy, std::span<const T> w,
                           const MatmulShape& s, Write write) {
  constexpr const char* kWhere = "train::cpu::matmul_backward_input";
  check_shape(kWhere, s);
  detail::check_size(kWhere, "dx", dx, s.rows * s.in_features, "rows * in_features");
  detail::check_size(kWhere, "dy", dy, s.rows * s.out_features, "rows * out_features");
  detail::check_size(kWhere, "w", w, s.out_features * s.in_features, "out_features * in_features");
  // dX[r, i] = sum_o dY[r, o] W[o, i].
  run_gemm<T>({.m = s.rows,
               .n = s.in_features,
               .depth = s.out_features,
               .a = {dy.data(), s.out_features, 1},
               .b = {w.data(), s.in_features, 1},
               .c = dx.data(),
               .write = write});
}

template <typename T>
void matmul_backward_weight(std::span<T> dw, std::span<const T> dy, std::span<const T> x,
                            const MatmulShape& s, Write write) {
  constexpr const char* kWhere = "train::cpu::matmul_backward_weight";
  check_shape(kWhere, s);
  detail::check_size(kWhere, "dw", dw, s.out_features * s.in_features,
                     "out_features * in_features");
  detail::check_size(kWhere, "dy", dy, s.rows * s.out_features, "rows * out_features");
  detail::check_size(kWhere, "x", x, s.rows * s.in_features, "rows * in_features");
  // dW[o, i] = sum_r dY[r, o] X[r, i]: A(o, r) = dY[r * out + o].
  run_gemm<T>({.m = s.out_features,
               .n = s.in_features,
               .depth = s.rows,
               .a = {dy.data(), 1, s.out_features},
               .b = {x.data(), s.in_features, 1},
               .c = dw.data(),
               .write = write});
}

#define RINGATTN_INSTANTIATE(T)                                                                 \
  template void matmul_forward<T>(std::span<T>, std::span<const T>, std::span<const T>,         \
                                  const MatmulShape&, Write);                                   \
  template void matmul_backward_input<T>(std::span<T>, std::span<const T>, std::span<const T>,  \
                                         const MatmulShape&, Write);                            \
  template void matmul_backward_weight<T>(std::span<T>, std::span<const T>, std::span<const T>, \
                                          const MatmulShape&, Write);
RINGATTN_INSTANTIATE(float)
RINGATTN_INSTANTIATE(double)
#undef RINGATTN_INSTANTIATE

}  // namespace ringattn::train::cpu
