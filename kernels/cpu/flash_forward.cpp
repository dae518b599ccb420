// CPU flash forward: Q row tiles stream over K/V tiles with an online softmax, so memory stays
// O(tile) per task, exactly the algorithm of the CUDA kernel. One task per (batch, head, row tile).
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/flash_tiles.hpp"
#include "ringattn/error.hpp"
#include "src/thread_pool.hpp"

namespace ringattn::cpu {
namespace {

using detail::kKeysPerTile;
using detail::kRowsPerTile;

template <typename T>
void forward_tile(const ForwardArgs& args, const AttentionShape& s, std::int64_t b, std::int64_t h,
                  std::int64_t row_begin) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const std::int64_t d = s.head_dim, dv = s.v_head_dim;  // scores over d, outputs over dv
  const std::int64_t kv_h = h / (s.q_heads / s.kv_heads);
  const std::int64_t rows = std::min(kRowsPerTile, s.q_len - row_begin);
  const detail::BlockMask mask(args.mask, b, s.q_len, s.k_len);
  const auto [key_first, key_end] = mask.keys_of_rows(row_begin, row_begin + rows);

  std::vector<T> q(rows * d), kt(d * kKeysPerTile), v(kKeysPerTile * dv);
  std::vector<T> p(rows * kKeysPerTile), acc(rows * dv, T(0));
  std::vector<T> row_max(rows, kNegInf), row_sum(rows, T(0));
  detail::load_rows(args.q, b, h, row_begin, rows, d, q.data());

  for (std::int64_t key_begin = key_first; key_begin < key_end; key_begin += kKeysPerTile) {
    const std::int64_t keys = std::min(kKeysPerTile, key_end - key_begin);
    detail::load_rows_transposed(args.k, b, kv_h, key_begin, keys, d, kt.data());
    detail::load_rows(args.v, b, kv_h, key_begin, keys, dv, v.data());
    detail::scaled_products(q.data(), kt.data(), rows, keys, d, static_cast<T>(args.scale),
                            p.data());
    const bool masked = !mask.all_visible(row_begin, row_begin + rows, key_begin, key_begin + keys);
    for (std::int64_t r = 0; r < rows; ++r) {
      T* pr = p.data() + r * keys;
      if (masked) {
        const auto [seen_first, seen_last] = mask.keys_of(row_begin + r);
        for (std::int64_t c = 0; c < keys; ++c) {
          if (key_begin + c < seen_first || key_begin + c >= seen_last) pr[c] = kNegInf;
        }
      }
      T tile_max = kNegInf;
      for (std::int64_t c = 0; c < keys; ++c) tile_max = std::max(tile_max, pr[c]);
      const T new_max = std::max(row_max[r], tile_max);
      if (new_max == kNegInf) {  // nothing visible yet in this row
        std::fill(pr, pr + keys, T(0));
        continue;
      }
      // Rescale what was accumulated under the old maximum (exp(-inf) = 0 on the first tile).
      const T correction = std::exp(row_max[r] - new_max);
      T tile_sum = 0;
      for (std::int64_t c = 0; c < keys; ++c) {
        pr[c] = std::exp(pr[c] - new_max);
        tile_sum += pr[c];
      }
      row_sum[r] = row_sum[r] * correction + tile_sum;
      row_max[r] = new_max;
      if (correction != T(1)) {
        for (std::int64_t x = 0; x < dv; ++x) acc[r * dv + x] *= correction;
      }
    }
    detail::accumulate_weighted_rows(p.data(), v.data(), rows, keys, dv, acc.data());
  }

  T* o = args.o.as<T>();
  T* lse = args.lse.as<T>();
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = row_begin + r;
    const T tile_lse = row_sum[r] > T(0) ? row_max[r] + std::log(row_sum[r]) : kNegInf;
    T* out = o + args.o.offset(b, i, h, 0);
    T& out_lse = lse[args.lse.offset(b, h, i)];
    if (!args.combine) {
      const T inv = row_sum[r] > T(0) ? T(1) / row_sum[r] : T(0);
      for (std::int64_t x = 0; x < dv; ++x) out[x * args.o.strides[3]] = acc[r * dv + x] * inv;
      out_lse = tile_lse;
      continue;
    }
    // Merge (acc / row_sum, tile_lse) into the running pair (out, out_lse).
    if (tile_lse == kNegInf) continue;
    const T merged = out_lse == kNegInf
                         ? tile_lse
                         : std::max(out_lse, tile_lse) +
                               std::log1p(std::exp(-std::fabs(out_lse - tile_lse)));
    const T keep = std::exp(out_lse - merged);
    const T add = std::exp(tile_lse - merged) / row_sum[r];
    for (std::int64_t x = 0; x < dv; ++x) {
      T& value = out[x * args.o.strides[3]];
      value = value * keep + acc[r * dv + x] * add;
    }
    out_lse = merged;
  }
}

template <typename T>
void forward(const ForwardArgs& args, const AttentionShape& s) {
  const std::int64_t tiles = (s.q_len + kRowsPerTile - 1) / kRowsPerTile;
  ringattn::detail::parallel_for(s.batch * s.q_heads * tiles, [&](std::int64_t task) {
    const std::int64_t tile = task % tiles, bh = task / tiles;
    forward_tile<T>(args, s, bh / s.q_heads, bh % s.q_heads, tile * kRowsPerTile);
  });
}

}  // namespace

void flash_forward(const ForwardArgs& args) {
  constexpr const char* kWhere = "cpu::flash_forward";
  const AttentionShape s = check_forward_args(args, Memory::host, kWhere);
  switch (args.q.dtype) {
    case DType::f32: return forward<float>(args, s);
    case DType::f64: return forward<double>(args, s);
    default:
      ringattn::detail::fail(kWhere, "q has dtype ", dtype_name(args.q.dtype),
                             "; the CPU block takes f32 or f64 (bf16 and f16 run on CUDA)");
  }
}

}  // namespace ringattn::cpu
