// Argument checks shared by every implementation of the local block (reference, CPU, CUDA), so a
// bad call gets the same message whichever backend it reaches.
#include <cmath>
#include <string>
#include <utility>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"

namespace ringattn {
namespace {

std::string shape_text(const TensorView& t) {
  std::string text = "[";
  for (int i = 0; i < t.rank; ++i) text += (i ? ", " : "") + std::to_string(t.shape[i]);
  return text + "]";
}

const char* memory_name(Memory memory) { return memory == Memory::host ? "host" : "device"; }

}  // namespace

namespace detail {

void check_view(const TensorView& t, const char* name, int rank, Memory memory, const char* where) {
  if (t.rank != rank) {
    detail::fail(where, name, " has rank ", t.rank, " (shape ", shape_text(t), "); expected rank ",
                 rank);
  }
  if (t.memory != memory) {
    detail::fail(where, name, " is in ", memory_name(t.memory), " memory; expected ",
                 memory_name(memory), " memory");
  }
  for (int i = 0; i < rank; ++i) {
    if (t.shape[i] < 0) detail::fail(where, name, " has negative extent ", shape_text(t));
    if (t.shape[i] > 1 && t.strides[i] < 1) {
      detail::fail(where, name, " has stride ", t.strides[i], " on axis ", i, "; expected >= 1");
    }
  }
  if (t.data == nullptr && t.numel() > 0) detail::fail(where, name, " is a null pointer");
}

void check_shape(const TensorView& t, const char* name, std::initializer_list<std::int64_t> expected,
                 const char* what, const char* where) {
  int axis = 0;
  bool same = true;
  std::string text = "[";
  for (std::int64_t extent : expected) {
    same = same && t.shape[axis] == extent;
    text += (axis ? ", " : "") + std::to_string(extent);
    ++axis;
  }
  if (!same) {
    detail::fail(where, name, " has shape ", shape_text(t), "; expected ", text, "] (", what, ")");
  }
}

void check_dtype(const TensorView& t, const char* name, DType expected, const char* what,
                 const char* where) {
  if (t.dtype != expected) {
    detail::fail(where, name, " has dtype ", dtype_name(t.dtype), "; expected ",
                 dtype_name(expected), " (", what, ")");
  }
}

AttentionShape check_attention_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                            double scale, Memory memory, const char* where) {
  check_view(q, "q", 4, memory, where);
  check_view(k, "k", 4, memory, where);
  check_view(v, "v", 4, memory, where);
  AttentionShape s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]};
  if (s.head_dim < 1) detail::fail(where, "q has head_dim ", s.head_dim, "; expected >= 1");
  if (s.kv_heads < 1) detail::fail(where, "k has ", s.kv_heads, " heads; expected >= 1");
  check_shape(k, "k", {s.batch, s.k_len, s.kv_heads, s.head_dim},
              "batch and head_dim of q", where);
  check_shape(v, "v", {s.batch, s.k_len, s.kv_heads, s.head_dim}, "the shape of k", where);
  if (s.q_heads % s.kv_heads != 0) {
    detail::fail(where, "q has ", s.q_heads, " heads, not a multiple of the ", s.kv_heads,
                 " heads of k and v (GQA needs q_heads % kv_heads == 0)");
  }
  check_dtype(k, "k", q.dtype, "the dtype of q", where);
  check_dtype(v, "v", q.dtype, "the dtype of q", where);
  if (!(scale > 0.0) || !std::isfinite(scale)) {
    detail::fail(where, "scale is ", scale, "; expected a finite value > 0 such as 1/sqrt(head_dim)");
  }
  return s;
}

}  // namespace detail

namespace {

using detail::check_dtype;
using detail::check_shape;
using detail::check_view;

void check_row_stats(const TensorView& t, const char* name, const AttentionShape& s, DType acc,
                     Memory memory, const char* where) {
  check_view(t, name, 3, memory, where);
  check_shape(t, name, {s.batch, s.q_heads, s.q_len}, "[batch, q_heads, q_len]", where);
  check_dtype(t, name, acc, "the accumulator dtype of the inputs", where);
}

}  // namespace

AttentionShape check_forward_args(const ForwardArgs& args, Memory memory, const char* where) {
  const AttentionShape s = detail::check_attention_inputs(args.q, args.k, args.v, args.scale, memory, where);
  const DType acc = accumulator_dtype(args.q.dtype);
  check_view(args.o, "o", 4, memory, where);
  check_shape(args.o, "o", {s.batch, s.q_len, s.q_heads, s.head_dim}, "the shape of q", where);
  if (args.combine) {
    check_dtype(args.o, "o", acc, "combine mode keeps the running output in the accumulator dtype",
                where);
  } else {
    check_dtype(args.o, "o", args.q.dtype, "the dtype of q", where);
  }
  check_row_stats(args.lse, "lse", s, acc, memory, where);
  return s;
}

AttentionShape check_backward_args(const BackwardArgs& args, Memory memory, const char* where) {
  const AttentionShape s = detail::check_attention_inputs(args.q, args.k, args.v, args.scale, memory, where);
  const DType acc = accumulator_dtype(args.q.dtype);
  check_view(args.dout, "dout", 4, memory, where);
  check_shape(args.dout, "dout", {s.batch, s.q_len, s.q_heads, s.head_dim}, "the shape of q",
              where);
  check_dtype(args.dout, "dout", args.q.dtype, "the dtype of q", where);
  check_row_stats(args.lse, "lse", s, acc, memory, where);
  check_row_stats(args.delta, "delta", s, acc, memory, where);
  const char* grad_names[] = {"dq", "dk", "dv"};
  const TensorView* grads[] = {&args.dq, &args.dk, &args.dv};
  const TensorView* inputs[] = {&args.q, &args.k, &args.v};
  for (int i = 0; i < 3; ++i) {
    check_view(*grads[i], grad_names[i], 4, memory, where);
    const TensorView& in = *inputs[i];
    check_shape(*grads[i], grad_names[i], {in.shape[0], in.shape[1], in.shape[2], in.shape[3]},
                i == 0 ? "the shape of q" : "the shape of k", where);
    // dK and dV may have the input dtype when overwritten: rounded once (both alike).
    const bool rounded = i > 0 && args.overwrite_key_gradients && args.dk.dtype == args.q.dtype;
    if (rounded) {
      check_dtype(*grads[i], grad_names[i], args.q.dtype,
                  "dk has the dtype of q, so dk and dv are written rounded to it", where);
    } else {
      check_dtype(*grads[i], grad_names[i], acc,
                  i == 0 || !args.overwrite_key_gradients
                      ? "gradients accumulate in the accumulator dtype of the inputs"
                      : "the accumulator dtype, or the dtype of q as overwritten key gradients",
                  where);
    }
  }
  if (args.key_rotation.active()) {
    if (s.head_dim % 2 != 0) {
      detail::fail(where, "key_rotation needs an even head_dim; q has head_dim ", s.head_dim);
    }
    const std::pair<const TensorView*, const char*> tables[] = {
        {&args.key_rotation.cos, "key_rotation.cos"}, {&args.key_rotation.sin, "key_rotation.sin"}};
    for (const auto& [table, name] : tables) {
      check_view(*table, name, 2, memory, where);
      check_shape(*table, name, {s.k_len, s.head_dim / 2}, "[k_len, head_dim / 2]", where);
      check_dtype(*table, name, acc, "the accumulator dtype of the inputs", where);
      if (table->shape[1] > 1 && table->strides[1] != 1) {
        detail::fail(where, name, " has stride ", table->strides[1],
                     " along its last axis; expected 1");
      }
    }
  }
  return s;
}

}  // namespace ringattn
