// Rotary position embedding (RoPE) on the CPU, in place on q or k. fp32 and fp64.
//
// Layout: element (t, h, i) of a [tokens, heads, head_dim] view is x[t * token_stride +
// h * head_dim + i], so q and k can be rotated where they sit inside a packed QKV row
// (token_stride = (q_heads + kv_heads) * head_dim + kv_heads * v_head_dim: V's heads may be of
// another width, which the rotation never reads).
//
// Pairs are half-split (the GPT-NeoX / Llama convention): dimension i is rotated with dimension
// i + head_dim / 2, for i < head_dim / 2, by the angle
//
//   positions[t] * theta^(-2 i / head_dim)
//
// where positions[t] is the token's GLOBAL position in its sequence. Under context parallelism a
// rank holds non-contiguous positions (zigzag chunks), and a token's rotation depends only on its
// position, never on where it sits in the local buffer.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "train/op_common.hpp"

namespace ringattn::train::cpu {

struct RopeShape {
  std::int64_t tokens = 0;
  std::int64_t heads = 0;
  std::int64_t head_dim = 0;      // even
  std::int64_t token_stride = 0;  // elements between tokens, >= heads * head_dim
};

// The checks of a RopeShape that both backends make: tokens, heads and head_dim positive,
// head_dim even, token_stride >= heads * head_dim; a failure names the field, its value and what
// was expected, after `where`.
void check_rope_shape(std::string_view where, const RopeShape& shape);

// x[t, h, :] = R(positions[t]) x[t, h, :]; positions [tokens] >= 0; theta > 0 (e.g. 10000).
template <typename T>
void rope_forward(std::span<T> x, std::span<const std::int64_t> positions, const RopeShape& shape,
                  double theta);

// dx[t, h, :] = R(positions[t])^T dx[t, h, :]: the rotation's gradient is its inverse.
template <typename T>
void rope_backward(std::span<T> dx, std::span<const std::int64_t> positions, const RopeShape& shape,
                   double theta);

}  // namespace ringattn::train::cpu
