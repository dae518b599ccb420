// Token embedding. The backward is a scatter-add where many tokens may hit one row; instead of
// atomics or per-thread copies of the table, each task owns a slice of the embedding columns and
// walks all tokens in order, so no two tasks write one element and every sum has a fixed order.
#include "train/op_embedding.hpp"

#include <algorithm>

#include "src/thread_pool.hpp"

namespace ringattn::train::cpu {
namespace {

// Columns per backward task: 64 floats = 4 cache lines of each row, 16 tasks at dim 1024.
constexpr std::int64_t kColumnsPerTask = 64;

void check_args(std::string_view where, std::span<const std::int32_t> tokens,
                const EmbeddingShape& s) {
  detail::check_positive(where, "shape.tokens", s.tokens);
  detail::check_positive(where, "shape.vocab", s.vocab);
  detail::check_positive(where, "shape.dim", s.dim);
  detail::check_size(where, "tokens", tokens, s.tokens, "tokens");
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    if (tokens[t] < 0 || tokens[t] >= s.vocab) {
      ringattn::detail::fail(where, "tokens[", t, "] is ", tokens[t], "; expected an id in [0, ",
                             s.vocab, ")");
    }
  }
}

}  // namespace

template <typename T>
void embedding_forward(std::span<T> out, std::span<const std::int32_t> tokens,
                       std::span<const T> table, const EmbeddingShape& s) {
  constexpr const char* kWhere = "train::cpu::embedding_forward";
  check_args(kWhere, tokens, s);
  detail::check_size(kWhere, "out", out, s.tokens * s.dim, "tokens * dim");
  detail::check_size(kWhere, "table", table, s.vocab * s.dim, "vocab * dim");
  detail::parallel_rows(s.tokens, s.dim, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t t = begin; t < end; ++t) {
      const T* row = table.data() + tokens[t] * s.dim;
      std::copy(row, row + s.dim, out.data() + t * s.dim);
    }
  });
}

template <typename T>
void embedding_backward(std::span<T> dtable, std::span<const std::int32_t> tokens,
                        std::span<const T> dout, const EmbeddingShape& s, Write write) {
  constexpr const char* kWhere = "train::cpu::embedding_backward";
  check_args(kWhere, tokens, s);
  detail::check_size(kWhere, "dtable", dtable, s.vocab * s.dim, "vocab * dim");
  detail::check_size(kWhere, "dout", dout, s.tokens * s.dim, "tokens * dim");
  const std::int64_t tasks = (s.dim + kColumnsPerTask - 1) / kColumnsPerTask;
  ringattn::detail::parallel_for(tasks, [&](std::int64_t task) {
    const std::int64_t begin = task * kColumnsPerTask;
    const std::int64_t width = std::min(kColumnsPerTask, s.dim - begin);
    if (write == Write::overwrite) {
      for (std::int64_t v = 0; v < s.vocab; ++v) {
        std::fill_n(dtable.data() + v * s.dim + begin, width, T(0));
      }
    }
    for (std::int64_t t = 0; t < s.tokens; ++t) {
      T* dst = dtable.data() + tokens[t] * s.dim + begin;
      const T* src = dout.data() + t * s.dim + begin;
      for (std::int64_t c = 0; c < width; ++c) dst[c] += src[c];
    }
  });
}

#define RINGATTN_INSTANTIATE(T)                                                    \
  template void embedding_forward<T>(std::span<T>, std::span<const std::int32_t>,  \
                                     std::span<const T>, const EmbeddingShape&);   \
  template void embedding_backward<T>(std::span<T>, std::span<const std::int32_t>, \
                                      std::span<const T>, const EmbeddingShape&, Write);
RINGATTN_INSTANTIATE(float)
RINGATTN_INSTANTIATE(double)
#undef RINGATTN_INSTANTIATE

}  // namespace ringattn::train::cpu
