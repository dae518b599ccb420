// CPU flash backward with recomputation. P is rebuilt tile by tile from the saved LSE, never
// stored. Two passes keep every output owned by one task, so the result is bitwise the same on
// any thread count: pass 1 runs one task per (batch, kv head, key tile) and sums dK, dV over all
// query rows and query heads of the group; pass 2 runs one task per (batch, q head, row tile)
// and sums dQ over all key tiles. Pass 2 recomputes P and dP once more, the price of no atomics.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/flash_tiles.hpp"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"
#include "src/thread_pool.hpp"

namespace ringattn::cpu {
namespace {

using detail::kKeysPerTile;
using detail::kRowsPerTile;

// Everything one (row tile, key tile) pair needs, gathered into contiguous buffers.
// Q and K rows have d (d_qk) elements, dO and V rows dv (d_v).
template <typename T>
struct PairTiles {
  std::int64_t d, dv;
  std::vector<T> q, dout, kt, vt, p, ds, lse, delta;
  PairTiles(std::int64_t head_dim, std::int64_t v_head_dim)
      : d(head_dim), dv(v_head_dim), q(kRowsPerTile * d), dout(kRowsPerTile * dv),
        kt(d * kKeysPerTile), vt(dv * kKeysPerTile), p(kRowsPerTile * kKeysPerTile),
        ds(kRowsPerTile * kKeysPerTile), lse(kRowsPerTile), delta(kRowsPerTile) {}

  void load_rows(const BackwardArgs& a, std::int64_t b, std::int64_t h, std::int64_t first,
                 std::int64_t rows) {
    detail::load_rows(a.q, b, h, first, rows, d, q.data());
    detail::load_rows(a.dout, b, h, first, rows, dv, dout.data());
    for (std::int64_t r = 0; r < rows; ++r) {
      lse[r] = a.lse.as<const T>()[a.lse.offset(b, h, first + r)];
      delta[r] = a.delta.as<const T>()[a.delta.offset(b, h, first + r)];
    }
  }
  void load_keys(const BackwardArgs& a, std::int64_t b, std::int64_t kv_h, std::int64_t first,
                 std::int64_t keys) {
    detail::load_rows_transposed(a.k, b, kv_h, first, keys, d, kt.data());
    detail::load_rows_transposed(a.v, b, kv_h, first, keys, dv, vt.data());
  }

  // P = exp(scale * Q K^T - LSE) (0 where masked) and dS = P * (dO V^T - delta).
  void recompute(const detail::BlockMask& mask, T scale, std::int64_t row_first, std::int64_t rows,
                 std::int64_t key_first, std::int64_t keys) {
    detail::scaled_products(q.data(), kt.data(), rows, keys, d, scale, p.data());
    detail::scaled_products(dout.data(), vt.data(), rows, keys, dv, T(1), ds.data());
    const bool masked = !mask.all_visible(row_first, row_first + rows, key_first, key_first + keys);
    for (std::int64_t r = 0; r < rows; ++r) {
      T* pr = p.data() + r * keys;
      T* dsr = ds.data() + r * keys;
      // A row with LSE = -inf sees no key anywhere: its P row is zero.
      const bool empty_row = lse[r] == -std::numeric_limits<T>::infinity();
      const auto [seen_first, seen_last] =
          masked ? mask.keys_of(row_first + r) : ringattn::detail::LocalRange{0, mask.k_len};
      for (std::int64_t c = 0; c < keys; ++c) {
        const bool seen = !empty_row && key_first + c >= seen_first && key_first + c < seen_last;
        pr[c] = seen ? std::exp(pr[c] - lse[r]) : T(0);
        dsr[c] = pr[c] * (dsr[c] - delta[r]);
      }
    }
  }
};

// out[c * d + :] += sum_r weights[r * keys + c] * rows[r * d + :]  (a transposed product)
template <typename T>
void accumulate_transposed(const T* weights, const T* rows, std::int64_t row_count,
                           std::int64_t keys, std::int64_t d, T* out) {
  for (std::int64_t r = 0; r < row_count; ++r) {
    const T* src = rows + r * d;
    for (std::int64_t c = 0; c < keys; ++c) {
      const T w = weights[r * keys + c];
      if (w == T(0)) continue;
      T* dst = out + c * d;
      for (std::int64_t x = 0; x < d; ++x) dst[x] += w * src[x];
    }
  }
}

template <typename T>
void add_rows(const TensorView& t, std::int64_t b, std::int64_t h, std::int64_t first,
              std::int64_t count, std::int64_t d, const T* values, bool overwrite = false) {
  T* base = t.as<T>();
  for (std::int64_t r = 0; r < count; ++r) {
    T* row = base + t.offset(b, first + r, h, 0);
    for (std::int64_t x = 0; x < d; ++x) {
      T& out = row[x * t.strides[3]];
      out = overwrite ? values[r * d + x] : out + values[r * d + x];
    }
  }
}

// The gradients of K rows key_first.. (count rows of d, in `rows`) with respect to the keys before
// their rotation: each pair (i, i + d / 2) by the transpose of its rotation.
template <typename T>
void rotate_back(const KeyRotation& rotation, std::int64_t key_first, std::int64_t count,
                 std::int64_t d, T* rows) {
  const std::int64_t half = d / 2;
  for (std::int64_t r = 0; r < count; ++r) {
    const T* c = rotation.cos.as<T>() + (key_first + r) * rotation.cos.strides[0];
    const T* s = rotation.sin.as<T>() + (key_first + r) * rotation.sin.strides[0];
    T* lo = rows + r * d;
    T* hi = lo + half;
    for (std::int64_t i = 0; i < half; ++i) {
      const T x = lo[i], y = hi[i];
      lo[i] = x * c[i] + y * s[i];
      hi[i] = y * c[i] - x * s[i];
    }
  }
}

template <typename T>
void key_tile_gradients(const BackwardArgs& a, const AttentionShape& s, std::int64_t b,
                        std::int64_t kv_h, std::int64_t key_first) {
  const std::int64_t d = s.head_dim, d_v = s.v_head_dim, group = s.q_heads / s.kv_heads;
  const std::int64_t keys = std::min(kKeysPerTile, s.k_len - key_first);
  const detail::BlockMask mask(a.mask, b, s.q_len, s.k_len);
  const auto [rows_first, rows_end] = mask.rows_of_keys(key_first, key_first + keys);
  const T scale = static_cast<T>(a.scale);
  PairTiles<T> t(d, d_v);
  std::vector<T> dk(keys * d, T(0)), dv(keys * d_v, T(0));
  t.load_keys(a, b, kv_h, key_first, keys);
  for (std::int64_t h = kv_h * group; h < (kv_h + 1) * group; ++h) {
    for (std::int64_t row_first = rows_first; row_first < rows_end; row_first += kRowsPerTile) {
      const std::int64_t rows = std::min(kRowsPerTile, rows_end - row_first);
      t.load_rows(a, b, h, row_first, rows);
      t.recompute(mask, scale, row_first, rows, key_first, keys);
      accumulate_transposed(t.p.data(), t.dout.data(), rows, keys, d_v, dv.data());
      accumulate_transposed(t.ds.data(), t.q.data(), rows, keys, d, dk.data());
    }
  }
  for (T& value : dk) value *= scale;
  if (a.key_rotation.active()) rotate_back(a.key_rotation, key_first, keys, d, dk.data());
  add_rows(a.dk, b, kv_h, key_first, keys, d, dk.data(), a.overwrite_key_gradients);
  add_rows(a.dv, b, kv_h, key_first, keys, d_v, dv.data(), a.overwrite_key_gradients);
}

template <typename T>
void row_tile_gradients(const BackwardArgs& a, const AttentionShape& s, std::int64_t b,
                        std::int64_t h, std::int64_t row_first) {
  const std::int64_t d = s.head_dim, kv_h = h / (s.q_heads / s.kv_heads);
  const std::int64_t rows = std::min(kRowsPerTile, s.q_len - row_first);
  const detail::BlockMask mask(a.mask, b, s.q_len, s.k_len);
  const T scale = static_cast<T>(a.scale);
  PairTiles<T> t(d, s.v_head_dim);
  std::vector<T> k(kKeysPerTile * d), dq(rows * d, T(0));
  t.load_rows(a, b, h, row_first, rows);
  const auto [keys_first, key_end] = mask.keys_of_rows(row_first, row_first + rows);
  for (std::int64_t key_first = keys_first; key_first < key_end; key_first += kKeysPerTile) {
    const std::int64_t keys = std::min(kKeysPerTile, key_end - key_first);
    t.load_keys(a, b, kv_h, key_first, keys);
    detail::load_rows(a.k, b, kv_h, key_first, keys, d, k.data());
    t.recompute(mask, scale, row_first, rows, key_first, keys);
    detail::accumulate_weighted_rows(t.ds.data(), k.data(), rows, keys, d, dq.data());
  }
  for (T& value : dq) value *= scale;
  add_rows(a.dq, b, h, row_first, rows, d, dq.data());
}

template <typename T>
void backward(const BackwardArgs& a, const AttentionShape& s) {
  const std::int64_t key_tiles = (s.k_len + kKeysPerTile - 1) / kKeysPerTile;
  ringattn::detail::parallel_for(s.batch * s.kv_heads * key_tiles, [&](std::int64_t task) {
    const std::int64_t tile = task % key_tiles, bh = task / key_tiles;
    key_tile_gradients<T>(a, s, bh / s.kv_heads, bh % s.kv_heads, tile * kKeysPerTile);
  });
  const std::int64_t row_tiles = (s.q_len + kRowsPerTile - 1) / kRowsPerTile;
  ringattn::detail::parallel_for(s.batch * s.q_heads * row_tiles, [&](std::int64_t task) {
    const std::int64_t tile = task % row_tiles, bh = task / row_tiles;
    row_tile_gradients<T>(a, s, bh / s.q_heads, bh % s.q_heads, tile * kRowsPerTile);
  });
}

template <typename T>
void prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
             const TensorView* dq) {
  const std::int64_t batch = o.shape[0], len = o.shape[1], heads = o.shape[2], d = o.shape[3];
  ringattn::detail::parallel_for(batch * heads, [&](std::int64_t task) {
    const std::int64_t b = task / heads, h = task % heads;
    for (std::int64_t i = 0; i < len; ++i) {
      const T* o_row = o.as<const T>() + o.offset(b, i, h, 0);
      const T* g_row = dout.as<const T>() + dout.offset(b, i, h, 0);
      T sum = 0;
      for (std::int64_t x = 0; x < d; ++x) sum += o_row[x * o.strides[3]] * g_row[x * dout.strides[3]];
      delta.as<T>()[delta.offset(b, h, i)] = sum;
      if (dq != nullptr) {  // d_qk wide, which may differ from o's d
        T* dq_row = dq->as<T>() + dq->offset(b, i, h, 0);
        for (std::int64_t x = 0; x < dq->shape[3]; ++x) dq_row[x * dq->strides[3]] = T(0);
      }
    }
  });
}

}  // namespace

void flash_backward_prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
                            const TensorView* dq_to_zero) {
  constexpr const char* kWhere = "cpu::flash_backward_prepare";
  ringattn::detail::check_view(o, "o", 4, Memory::host, kWhere);
  ringattn::detail::check_view(dout, "dout", 4, Memory::host, kWhere);
  ringattn::detail::check_view(delta, "delta", 3, Memory::host, kWhere);
  ringattn::detail::check_shape(dout, "dout", {o.shape[0], o.shape[1], o.shape[2], o.shape[3]},
                                "the shape of o", kWhere);
  ringattn::detail::check_shape(delta, "delta", {o.shape[0], o.shape[2], o.shape[1]},
                                "[batch, heads, len] of o", kWhere);
  ringattn::detail::check_dtype(dout, "dout", o.dtype, "the dtype of o", kWhere);
  ringattn::detail::check_dtype(delta, "delta", o.dtype, "the dtype of o", kWhere);
  if (dq_to_zero != nullptr) {
    ringattn::detail::check_view(*dq_to_zero, "dq", 4, Memory::host, kWhere);
    // dq is [B, S, H, d_qk]: o's extents but its head_dim, which prepare cannot know (d_v != d_qk
    // is allowed); flash_backward checks it against q.
    ringattn::detail::check_shape(*dq_to_zero, "dq",
                                  {o.shape[0], o.shape[1], o.shape[2], dq_to_zero->shape[3]},
                                  "batch, len and heads of o", kWhere);
    ringattn::detail::check_dtype(*dq_to_zero, "dq", o.dtype, "the dtype of o", kWhere);
  }
  switch (o.dtype) {
    case DType::f32: return prepare<float>(o, dout, delta, dq_to_zero);
    case DType::f64: return prepare<double>(o, dout, delta, dq_to_zero);
    default:
      ringattn::detail::fail(kWhere, "o has dtype ", dtype_name(o.dtype),
                             "; the CPU block takes f32 or f64");
  }
}

void flash_backward(const BackwardArgs& args) {
  constexpr const char* kWhere = "cpu::flash_backward";
  const AttentionShape s = check_backward_args(args, Memory::host, kWhere);
  switch (args.q.dtype) {
    case DType::f32: return backward<float>(args, s);
    case DType::f64: return backward<double>(args, s);
    default:
      ringattn::detail::fail(kWhere, "q has dtype ", dtype_name(args.q.dtype),
                             "; the CPU block takes f32 or f64 (bf16 and f16 run on CUDA)");
  }
}

}  // namespace ringattn::cpu
