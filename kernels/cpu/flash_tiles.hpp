// Tiles of the CPU flash block: copies of strided rows into small contiguous buffers and the
// mask arithmetic by global position, shared by the forward and the backward.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ringattn/attention.hpp"
#include "src/mask_rule.hpp"

namespace ringattn::cpu::detail {

// 64 x 64 tiles: a K^T tile of 64 keys x 128 dims in double is 64 KiB, which sits in L2 next
// to the Q tile while every row of the Q tile streams over it.
constexpr std::int64_t kRowsPerTile = 64;
constexpr std::int64_t kKeysPerTile = 64;

// The mask of one batch row in a block's local indices: query row i sits at global position
// q_start + i, key row j at k_start + j (src/mask_rule.hpp has the interval form).
struct BlockMask {
  ringattn::detail::MaskRule rule;
  std::int64_t q_start, k_start, q_len, k_len;

  BlockMask(const Mask& mask, std::int64_t b, std::int64_t q_rows, std::int64_t k_rows)
      : rule(ringattn::detail::MaskRule::of(mask, b)), q_start(mask.q_start),
        k_start(mask.k_start), q_len(q_rows), k_len(k_rows) {}

  // The keys that row i sees.
  ringattn::detail::LocalRange keys_of(std::int64_t i) const {
    return ringattn::detail::local_range(rule.keys_of(q_start + i), k_start, k_len);
  }
  // The keys some row of [row_begin, row_end) sees: from the first row's first to the last
  // row's last (both ends grow with the row).
  ringattn::detail::LocalRange keys_of_rows(std::int64_t row_begin, std::int64_t row_end) const {
    return {keys_of(row_begin).first, keys_of(row_end - 1).last};
  }
  // The rows that see some key of [key_begin, key_end).
  ringattn::detail::LocalRange rows_of_keys(std::int64_t key_begin, std::int64_t key_end) const {
    return {ringattn::detail::local_range(rule.queries_of(k_start + key_begin), q_start, q_len).first,
            ringattn::detail::local_range(rule.queries_of(k_start + key_end - 1), q_start, q_len).last};
  }
  // Every row of [row_begin, row_end) sees every key of [key_begin, key_end).
  bool all_visible(std::int64_t row_begin, std::int64_t row_end, std::int64_t key_begin,
                   std::int64_t key_end) const {
    return rule.all_visible(q_start + row_begin, q_start + row_end - 1, k_start + key_begin,
                            k_start + key_end - 1);
  }
};

// rows x head_dim of a [batch, seq, heads, head_dim] view, row-major into `out`.
template <typename T>
void load_rows(const TensorView& t, std::int64_t b, std::int64_t h, std::int64_t first,
               std::int64_t count, std::int64_t head_dim, T* out) {
  const T* base = t.as<const T>();
  for (std::int64_t r = 0; r < count; ++r) {
    const T* row = base + t.offset(b, first + r, h, 0);
    for (std::int64_t x = 0; x < head_dim; ++x) out[r * head_dim + x] = row[x * t.strides[3]];
  }
}

// The same rows transposed: out[x * count + r], so that dot products with many rows become
// unit-stride multiply-adds over r (vectorised without reassociating sums).
template <typename T>
void load_rows_transposed(const TensorView& t, std::int64_t b, std::int64_t h, std::int64_t first,
                          std::int64_t count, std::int64_t head_dim, T* out) {
  const T* base = t.as<const T>();
  for (std::int64_t r = 0; r < count; ++r) {
    const T* row = base + t.offset(b, first + r, h, 0);
    for (std::int64_t x = 0; x < head_dim; ++x) out[x * count + r] = row[x * t.strides[3]];
  }
}

// scores[r * cols + c] = scale * sum_x a[r * head_dim + x] * bt[x * cols + c]
template <typename T>
void scaled_products(const T* a, const T* bt, std::int64_t rows, std::int64_t cols,
                     std::int64_t head_dim, T scale, T* scores) {
  for (std::int64_t r = 0; r < rows; ++r) {
    T* out = scores + r * cols;
    std::fill(out, out + cols, T(0));
    for (std::int64_t x = 0; x < head_dim; ++x) {
      const T ax = a[r * head_dim + x];
      const T* bx = bt + x * cols;
      for (std::int64_t c = 0; c < cols; ++c) out[c] += ax * bx[c];
    }
    for (std::int64_t c = 0; c < cols; ++c) out[c] *= scale;
  }
}

// out[r * head_dim + :] += sum_c weights[r * cols + c] * rows[c * head_dim + :]
template <typename T>
void accumulate_weighted_rows(const T* weights, const T* rows, std::int64_t out_rows,
                              std::int64_t cols, std::int64_t head_dim, T* out) {
  for (std::int64_t r = 0; r < out_rows; ++r) {
    T* dst = out + r * head_dim;
    for (std::int64_t c = 0; c < cols; ++c) {
      const T w = weights[r * cols + c];
      if (w == T(0)) continue;
      const T* src = rows + c * head_dim;
      for (std::int64_t x = 0; x < head_dim; ++x) dst[x] += w * src[x];
    }
  }
}

}  // namespace ringattn::cpu::detail
