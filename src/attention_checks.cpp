// Argument checks shared by every implementation of the local block (reference, CPU, CUDA), so a
// bad call gets the same message whichever backend it reaches.
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"
#include "src/checked_size.hpp"

namespace ringattn {
namespace {

std::string shape_text(const TensorView& t) {
  return detail::extents_text(t.shape.data(), t.rank);
}

const char* memory_name(Memory memory) { return memory == Memory::host ? "host" : "device"; }

// Where a view's bytes may lie: within [begin, end), and within runs of run_bytes contiguous
// bytes that start at begin plus multiples of period_bytes (0: one run). The run is the dense
// innermost part of the layout (an element, a row of head_dim elements, a row of all heads); the
// period is the gcd of the byte strides of the other axes.
struct Footprint {
  std::uintptr_t begin = 0, end = 0;
  std::int64_t run_bytes = 0, period_bytes = 0;
};

Footprint footprint(const TensorView& t, const char* name, const char* where) {
  Footprint f;
  const std::int64_t span = detail::span_bytes(t, name, where);
  if (span == 0) return f;
  f.begin = reinterpret_cast<std::uintptr_t>(t.data);
  f.end = f.begin + static_cast<std::uintptr_t>(span);  // check_view: within the address space
  const std::int64_t element_bytes = static_cast<std::int64_t>(dtype_size(t.dtype));
  // The run grows by each axis whose stride is the run so far; every product below is at most
  // the span, which fits in int64.
  bool in_run[TensorView::kMaxRank] = {};
  f.run_bytes = element_bytes;
  for (bool grew = true; grew;) {
    grew = false;
    for (int i = 0; i < t.rank; ++i) {
      if (!in_run[i] && t.shape[i] > 1 && t.strides[i] * element_bytes == f.run_bytes) {
        in_run[i] = grew = true;
        f.run_bytes *= t.shape[i];
      }
    }
  }
  for (int i = 0; i < t.rank; ++i) {
    if (!in_run[i] && t.shape[i] > 1) {
      f.period_bytes = std::gcd(f.period_bytes, t.strides[i] * element_bytes);
    }
  }
  return f;
}

// Whether two footprints may share a byte. Past their ranges, each view's bytes lie, modulo the
// gcd G of the two periods, on an arc of its run's length starting at its begin; arcs apart on
// the circle of G bytes mean views apart (the layout of interleaved packed tensors).
bool may_overlap(const Footprint& a, const Footprint& b) {
  if (a.begin == a.end || b.begin == b.end) return false;
  if (a.end <= b.begin || b.end <= a.begin) return false;
  const auto period = static_cast<std::uintptr_t>(std::gcd(a.period_bytes, b.period_bytes));
  const auto run_a = static_cast<std::uintptr_t>(a.run_bytes);
  const auto run_b = static_cast<std::uintptr_t>(b.run_bytes);
  if (period == 0 || run_a + run_b > period) return true;
  const std::uintptr_t offset = (b.begin % period + period - a.begin % period) % period;
  return offset < run_a || offset + run_b > period;
}

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
  const std::int64_t elements = checked_elements(t.shape.data(), rank, name, where);
  if (elements == 0) return;  // no memory is touched, whatever the pointer and strides
  for (int i = 0; i < rank; ++i) {
    if (t.shape[i] > 1 && t.strides[i] < 1) {
      detail::fail(where, name, " has stride ", t.strides[i], " on axis ", i, "; expected >= 1");
    }
  }
  if (t.data == nullptr) detail::fail(where, name, " is a null pointer");
  const std::int64_t span = span_bytes(t, name, where);
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data);
  if (static_cast<std::uintptr_t>(span) > UINTPTR_MAX - begin) {
    detail::fail(where, name, " at ", t.data, " spans ", span, " bytes (shape ", shape_text(t),
                 ", strides ", extents_text(t.strides.data(), t.rank),
                 "), past the end of the address space");
  }
}

void check_extent_limits(const TensorView& t, const char* name, const char* where) {
  struct Limit {
    const char* what;
    std::int64_t most;
    const char* why;
  };
  static constexpr Limit kLimits[] = {
      {"batch", kMaxBatch, "a CUDA grid dimension"},
      {"rows", kMaxRows, "32-bit row indices in the kernels"},
      {"heads", kMaxHeads, "a CUDA grid dimension"},
      {"head_dim", kMaxHeadDim, "a 32-bit int in the kernels' parameters"},
  };
  for (int axis = 0; axis < 4; ++axis) {
    if (t.shape[axis] > kLimits[axis].most) {
      detail::fail(where, name, " has ", kLimits[axis].what, " ", t.shape[axis], " (axis ", axis,
                   " of shape ", shape_text(t), "); the kernels take at most ", kLimits[axis].most,
                   " (", kLimits[axis].why, ")");
    }
  }
}

std::int64_t span_bytes(const TensorView& t, const char* name, const char* where) {
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 0) return 0;
  }
  std::int64_t last = 0;  // offset of the last element, in elements
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 1) continue;
    const std::int64_t reach = checked_mul(t.shape[i] - 1, t.strides[i], where, "the span of ",
                                           name, " along axis ", i, " ((extent - 1) x stride)");
    last = checked_add(last, reach, where, "the span of ", name, " in elements");
  }
  const std::int64_t elements = checked_add(last, 1, where, "the span of ", name, " in elements");
  return checked_mul(elements, static_cast<std::int64_t>(dtype_size(t.dtype)), where,
                     "the span of ", name, " in bytes");
}

void check_no_overlap(std::initializer_list<NamedTensor> outputs,
                      std::initializer_list<NamedTensor> inputs, const char* where) {
  auto check_pair = [&](const NamedTensor& out, const NamedTensor& other) {
    const Footprint a = footprint(*out.view, out.name, where);
    const Footprint b = footprint(*other.view, other.name, where);
    if (!may_overlap(a, b)) return;
    auto at = [](std::uintptr_t address) { return reinterpret_cast<const void*>(address); };
    detail::fail(where, out.name, " overlaps ", other.name, " (", out.name, " [", at(a.begin), ", ",
                 at(a.end), "), ", other.name, " [", at(b.begin), ", ", at(b.end),
                 ")); outputs may share no memory with inputs or other outputs");
  };
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (const NamedTensor& in : inputs) check_pair(*out, in);
    for (auto other = outputs.begin(); other != out; ++other) check_pair(*out, *other);
  }
}

void check_prepare_views(const TensorView& o, const TensorView& dout, const TensorView& delta,
                         const char* where) {
  check_view(o, "o", 4, o.memory, where);
  check_view(dout, "dout", 4, o.memory, where);
  check_view(delta, "delta", 3, o.memory, where);
  check_extent_limits(o, "o", where);
  check_shape(dout, "dout", {o.shape[0], o.shape[1], o.shape[2], o.shape[3]}, "the shape of o",
              where);
  check_shape(delta, "delta", {o.shape[0], o.shape[2], o.shape[1]}, "[batch, heads, len] of o",
              where);
  check_no_overlap({{"delta", &delta}}, {{"o", &o}, {"dout", &dout}}, where);
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
  AttentionShape s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                   v.shape[3]};
  if (s.head_dim < 1) detail::fail(where, "q has head_dim ", s.head_dim, "; expected >= 1");
  if (s.v_head_dim < 1) detail::fail(where, "v has head_dim ", s.v_head_dim, "; expected >= 1");
  if (s.kv_heads < 1) detail::fail(where, "k has ", s.kv_heads, " heads; expected >= 1");
  check_extent_limits(q, "q", where);
  check_extent_limits(k, "k", where);
  check_extent_limits(v, "v", where);
  check_shape(k, "k", {s.batch, s.k_len, s.kv_heads, s.head_dim},
              "batch and head_dim of q", where);
  // V's head dim is d_v, its own: only its other extents must be those of k.
  check_shape(v, "v", {s.batch, s.k_len, s.kv_heads, s.v_head_dim},
              "batch, k_len and kv_heads of k", where);
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

void check_mask(const Mask& mask, const AttentionShape& s, Memory documents_memory,
                const char* where) {
  const auto check_rows = [&](std::int64_t start, std::int64_t len, const char* name,
                              const char* rows, const char* len_name) {
    std::int64_t end = 0;
    if (__builtin_add_overflow(start, len, &end)) {
      detail::fail(where, name, " is ", start, ": the positions of the ", len, " ", rows,
                   " rows pass int64 (", name, " + ", len_name, " must be at most ",
                   std::numeric_limits<std::int64_t>::max(), ")");
    }
  };
  check_rows(mask.q_start, s.q_len, "q_start", "query", "q_len");
  check_rows(mask.k_start, s.k_len, "k_start", "key", "k_len");
  // The distances from the first key to one past the last query, and from one past the last key
  // to the first query: every i + shift and j - shift of the blocks lies between them.
  std::int64_t farthest = 0, nearest = 0;
  if (__builtin_sub_overflow(mask.q_start + s.q_len, mask.k_start, &farthest) ||
      __builtin_sub_overflow(mask.q_start, mask.k_start + s.k_len, &nearest)) {
    detail::fail(where, "q_start ", mask.q_start, " and k_start ", mask.k_start,
                 " are too far apart: a query position minus a key position overflows int64");
  }
  const auto check_window = [&](std::int64_t window, const char* name) {
    if (window < 0) {
      detail::fail(where, name, " is ", window,
                   "; expected 0 (no window) or the number of positions a window spans (> 0)");
    }
  };
  check_window(mask.window_left, "window_left");
  check_window(mask.window_right, "window_right");
  const DocumentStarts& docs = mask.documents;
  if (docs.count < 0) {
    detail::fail(where, "documents.count (C API: num_documents) is ", docs.count,
                 "; expected 0 (one document) or more");
  }
  if (docs.count == 0) return;
  if (docs.data == nullptr) {
    detail::fail(where, "documents.data (C API: document_starts) is a null pointer with count ",
                 docs.count, "; expected ", docs.count, " int64 positions a batch row");
  }
  if (docs.batch_stride < 0) {
    detail::fail(where, "documents.batch_stride (C API: document_batch_stride) is ",
                 docs.batch_stride,
                 "; expected 0 (one list for every batch row) or the elements between the lists");
  }
  if (documents_memory != Memory::host) return;  // device lists are the caller's to keep sorted
  for (std::int64_t b = 0; b < (docs.batch_stride == 0 ? 1 : s.batch); ++b) {
    const std::int64_t* starts = docs.data + b * docs.batch_stride;
    for (std::int64_t n = 1; n < docs.count; ++n) {
      if (starts[n] < starts[n - 1]) {
        detail::fail(where, "document start ", n, " of batch row ", b, " is ", starts[n],
                     ", below start ", n - 1, " (", starts[n - 1],
                     "); expected non-decreasing global positions");
      }
    }
  }
}

void check_value_shape(const TensorView& t, const char* name, std::int64_t batch,
                       std::int64_t len, std::int64_t heads, const AttentionShape& s,
                       const char* what, const char* where) {
  if (t.shape[0] == batch && t.shape[1] == len && t.shape[2] == heads &&
      t.shape[3] != s.v_head_dim) {
    detail::fail(where, name, " has head_dim ", t.shape[3], " (shape ", shape_text(t),
                 "); expected ", s.v_head_dim, ", the head_dim of v (q and k have head_dim ",
                 s.head_dim, ")");
  }
  check_shape(t, name, {batch, len, heads, s.v_head_dim}, what, where);
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
  detail::check_mask(args.mask, s, memory, where);
  const DType acc = accumulator_dtype(args.q.dtype);
  check_view(args.o, "o", 4, memory, where);
  detail::check_value_shape(args.o, "o", s.batch, s.q_len, s.q_heads, s,
                            "batch, q_len and q_heads of q, head_dim of v", where);
  if (args.combine) {
    check_dtype(args.o, "o", acc, "combine mode keeps the running output in the accumulator dtype",
                where);
  } else {
    check_dtype(args.o, "o", args.q.dtype, "the dtype of q", where);
  }
  check_row_stats(args.lse, "lse", s, acc, memory, where);
  // combine reads and writes o and lse, each in place (the contract of ForwardArgs).
  detail::check_no_overlap({{"o", &args.o}, {"lse", &args.lse}},
                           {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}}, where);
  return s;
}

AttentionShape check_backward_args(const BackwardArgs& args, Memory memory, const char* where) {
  const AttentionShape s = detail::check_attention_inputs(args.q, args.k, args.v, args.scale, memory, where);
  detail::check_mask(args.mask, s, memory, where);
  const DType acc = accumulator_dtype(args.q.dtype);
  check_view(args.dout, "dout", 4, memory, where);
  detail::check_value_shape(args.dout, "dout", s.batch, s.q_len, s.q_heads, s,
                            "batch, q_len and q_heads of q, head_dim of v", where);
  check_dtype(args.dout, "dout", args.q.dtype, "the dtype of q", where);
  check_row_stats(args.lse, "lse", s, acc, memory, where);
  check_row_stats(args.delta, "delta", s, acc, memory, where);
  const char* grad_names[] = {"dq", "dk", "dv"};
  const TensorView* grads[] = {&args.dq, &args.dk, &args.dv};
  const TensorView* inputs[] = {&args.q, &args.k, &args.v};
  const char* input_shapes[] = {"the shape of q", "the shape of k", "the shape of v"};
  for (int i = 0; i < 3; ++i) {
    check_view(*grads[i], grad_names[i], 4, memory, where);
    const TensorView& in = *inputs[i];
    if (i == 2) {
      detail::check_value_shape(args.dv, "dv", s.batch, s.k_len, s.kv_heads, s, input_shapes[i],
                                where);
    } else {
      check_shape(*grads[i], grad_names[i], {in.shape[0], in.shape[1], in.shape[2], in.shape[3]},
                  input_shapes[i], where);
    }
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
  // dq, dk and dv are added into (or dk and dv overwritten), each in place; lse and delta may be
  // one tensor (both are read).
  const std::initializer_list<detail::NamedTensor> outputs = {
      {"dq", &args.dq}, {"dk", &args.dk}, {"dv", &args.dv}};
  detail::check_no_overlap(outputs,
                           {{"q", &args.q},
                            {"k", &args.k},
                            {"v", &args.v},
                            {"dout", &args.dout},
                            {"lse", &args.lse},
                            {"delta", &args.delta}},
                           where);
  if (args.key_rotation.active()) {
    detail::check_no_overlap(outputs,
                             {{"key_rotation.cos", &args.key_rotation.cos},
                              {"key_rotation.sin", &args.key_rotation.sin}},
                             where);
  }
  return s;
}

}  // namespace ringattn
