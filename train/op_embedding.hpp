// The token embedding on the CPU: a gather of table rows by token id, and its backward, a
// scatter-add of the output gradient into the table's gradient. fp32 and fp64.
//
//   tokens [tokens]          int32 ids in [0, vocab)
//   table  [vocab, dim]      row-major
//   out    [tokens, dim]     out[t, :] = table[tokens[t], :]
#pragma once

#include <cstdint>
#include <span>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

struct EmbeddingShape {
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;
  std::int64_t dim = 0;
};

template <typename T>
void embedding_forward(std::span<T> out, std::span<const std::int32_t> tokens,
                       std::span<const T> table, const EmbeddingShape& shape);

// dtable[v, :] (+)= sum over t with tokens[t] == v of dout[t, :], summed in token order: the result
// is bitwise the same whatever the thread count. Write::overwrite zeroes the rows no token uses.
template <typename T>
void embedding_backward(std::span<T> dtable, std::span<const std::int32_t> tokens,
                        std::span<const T> dout, const EmbeddingShape& shape,
                        Write write = Write::overwrite);

}  // namespace ringattn::train::cpu
