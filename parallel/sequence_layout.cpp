#include "parallel/sequence_layout.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"

namespace ringattn {
namespace {

// A [batch, seq, heads, head_dim] view of a rank-4 view itself, or of a rank-3 [batch, heads, seq]
// one (head_dim 1), so that one copy loop serves both.
TensorView sequence_view(const TensorView& t, const char* name, const char* where) {
  if (t.rank != 3 && t.rank != 4) {
    detail::fail(where, name, " has rank ", t.rank,
                 "; expected 4 ([batch, seq, heads, head_dim]) "
                 "or 3 ([batch, heads, seq], e.g. LSE)");
  }
  detail::check_view(t, name, t.rank, Memory::host, where);
  if (t.rank == 4) return t;
  TensorView v = t;
  v.rank = 4;
  v.shape = {t.shape[0], t.shape[2], t.shape[1], 1};
  v.strides = {t.strides[0], t.strides[2], t.strides[1], 1};
  return v;
}

// Rows [from_row, from_row + count) of `from` to rows [to_row, ...) of `to`.
void copy_rows(const TensorView& from, std::int64_t from_row, const TensorView& to,
               std::int64_t to_row, std::int64_t count) {
  const std::size_t size = dtype_size(from.dtype);
  const auto* src = static_cast<const unsigned char*>(from.data);
  auto* dst = static_cast<unsigned char*>(to.data);
  const std::int64_t heads = from.shape[2], dim = from.shape[3];
  const bool rows_contiguous = from.strides[3] == 1 && to.strides[3] == 1;
  for (std::int64_t b = 0; b < from.shape[0]; ++b) {
    for (std::int64_t i = 0; i < count; ++i) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t f = from.offset(b, from_row + i, h), t = to.offset(b, to_row + i, h);
        if (rows_contiguous) {
          std::memcpy(dst + t * size, src + f * size, static_cast<std::size_t>(dim) * size);
          continue;
        }
        for (std::int64_t x = 0; x < dim; ++x) {
          std::memcpy(dst + (t + x * to.strides[3]) * size, src + (f + x * from.strides[3]) * size,
                      size);
        }
      }
    }
  }
}

}  // namespace

std::string_view sequence_layout_name(SequenceLayoutKind kind) {
  switch (kind) {
    case SequenceLayoutKind::contiguous:
      return "contiguous";
    case SequenceLayoutKind::zigzag:
      return "zigzag";
    case SequenceLayoutKind::balanced:
      return "balanced";
  }
  return "unknown";
}

SequenceLayoutKind parse_sequence_layout(std::string_view name) {
  if (name == "contiguous") return SequenceLayoutKind::contiguous;
  if (name == "zigzag") return SequenceLayoutKind::zigzag;
  if (name == "balanced") return SequenceLayoutKind::balanced;
  detail::fail("parse_sequence_layout", "unknown sequence layout '", name,
               "'; expected contiguous, zigzag or balanced");
}

SequenceLayout::SequenceLayout(SequenceLayoutKind kind, int world, int rank,
                               std::int64_t total_length)
    : kind_(kind), world_(world), rank_(rank), total_length_(total_length) {
  constexpr const char* kWhere = "SequenceLayout";
  if (kind == SequenceLayoutKind::balanced) {
    detail::fail(kWhere, "the balanced layout follows a call's mask: make it with "
                 "balanced_layout(world, rank, S, mask), not from its kind alone");
  }
  if (kind != SequenceLayoutKind::contiguous && kind != SequenceLayoutKind::zigzag) {
    detail::fail(kWhere, "layout kind ", static_cast<int>(kind),
                 " is none of contiguous (0), zigzag (1) and balanced (2)");
  }
  if (world < 1) detail::fail(kWhere, "world size N = ", world, "; expected >= 1 ranks");
  if (rank < 0 || rank >= world) {
    detail::fail(kWhere, "rank ", rank, " is out of range for N = ", world, " ranks (0 to ",
                 world - 1, ")");
  }
  if (total_length < 1) {
    detail::fail(kWhere, "total length S = ", total_length, "; expected >= 1 tokens");
  }
  const std::int64_t parts = kind == SequenceLayoutKind::zigzag ? 2 * std::int64_t{world} : world;
  if (total_length % parts != 0) {
    if (kind == SequenceLayoutKind::zigzag) {
      detail::fail(kWhere, "zigzag layout: total length S = ", total_length,
                   " is not a multiple of 2N = ", parts, " (N = ", world,
                   " ranks, each holding 2 of 2N equal chunks)");
    }
    detail::fail(kWhere, "contiguous layout: total length S = ", total_length,
                 " is not a multiple of N = ", world, " ranks (each holds S/N tokens)");
  }
}

SequenceLayout::SequenceLayout(int rank, std::int64_t total_length,
                               std::shared_ptr<const Assignment> chunks)
    : kind_(SequenceLayoutKind::balanced),
      world_(chunks ? static_cast<int>(chunks->size()) : 0),
      rank_(rank),
      total_length_(total_length),
      assignment_(std::move(chunks)) {
  constexpr const char* kWhere = "SequenceLayout (balanced)";
  if (world_ < 1) detail::fail(kWhere, "no ranks' chunks given; expected N >= 1 lists");
  if (rank < 0 || rank >= world_) {
    detail::fail(kWhere, "rank ", rank, " is out of range for N = ", world_, " ranks (0 to ",
                 world_ - 1, ")");
  }
  if (total_length < 1 || total_length % world_ != 0) {
    detail::fail(kWhere, "total length S = ", total_length, "; expected a multiple of N = ",
                 world_, " ranks, >= 1");
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;  // every chunk's [start, end)
  for (int r = 0; r < world_; ++r) {
    std::int64_t local = 0, previous_end = -1;
    for (const SequenceChunk& c : (*assignment_)[r]) {
      if (c.length < 1 || c.global_start < 0 || c.global_start + c.length > total_length ||
          c.local_start != local || c.global_start < previous_end) {
        detail::fail(kWhere, "rank ", r, "'s chunk (local ", c.local_start, ", global ",
                     c.global_start, ", length ", c.length, ") is not the next of increasing, "
                     "non-empty chunks inside S = ", total_length, " from local row ", local);
      }
      spans.emplace_back(c.global_start, c.global_start + c.length);
      local += c.length;
      previous_end = c.global_start + c.length;
    }
    if (local != total_length / world_) {
      detail::fail(kWhere, "rank ", r, " holds ", local, " tokens; expected S/N = ",
                   total_length / world_);
    }
  }
  // N ranks of S/N tokens each: the chunks cover [0, S) once exactly when none overlaps another.
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) {
      detail::fail(kWhere, "positions [", spans[i].first, ", ",
                   std::min(spans[i].second, spans[i - 1].second), ") are held twice");
    }
  }
}

SequenceLayout SequenceLayout::for_rank(int rank) const {
  if (kind_ == SequenceLayoutKind::balanced) {
    SequenceLayout other = *this;
    if (rank < 0 || rank >= world_) {
      detail::fail("SequenceLayout", "rank ", rank, " is out of range for N = ", world_,
                   " ranks (0 to ", world_ - 1, ")");
    }
    other.rank_ = rank;
    return other;
  }
  return SequenceLayout(kind_, world_, rank, total_length_);
}

std::vector<SequenceChunk> SequenceLayout::chunks() const {
  if (kind_ == SequenceLayoutKind::balanced) return (*assignment_)[static_cast<std::size_t>(rank_)];
  if (kind_ == SequenceLayoutKind::contiguous) {
    const std::int64_t length = local_length();
    return {{0, rank_ * length, length}};
  }
  const std::int64_t c = total_length_ / (2 * std::int64_t{world_});
  return {{0, rank_ * c, c}, {c, (2 * std::int64_t{world_} - 1 - rank_) * c, c}};
}

std::vector<std::int64_t> SequenceLayout::global_positions() const {
  std::vector<std::int64_t> positions(static_cast<std::size_t>(local_length()));
  for (const SequenceChunk& chunk : chunks()) {
    for (std::int64_t i = 0; i < chunk.length; ++i) {
      positions[chunk.local_start + i] = chunk.global_start + i;
    }
  }
  return positions;
}

namespace {

void check_pair(const SequenceLayout& layout, const TensorView& full, const TensorView& local,
                const char* where) {
  if (full.rank != local.rank) {
    detail::fail(where, "full has rank ", full.rank, " but local has rank ", local.rank);
  }
  detail::check_dtype(local, "local", full.dtype, "the dtype of full", where);
  const TensorView f = sequence_view(full, "full", where);
  const TensorView l = sequence_view(local, "local", where);
  const int seq_axis = full.rank == 4 ? 1 : 2;
  if (f.shape[1] != layout.total_length()) {
    detail::fail(where, "full has ", f.shape[1], " tokens on axis ", seq_axis, "; the ",
                 layout.describe(), " expects S = ", layout.total_length());
  }
  if (l.shape[1] != layout.local_length() || l.shape[0] != f.shape[0] || l.shape[2] != f.shape[2] ||
      l.shape[3] != f.shape[3]) {
    detail::fail(where, "local has shape ", local.describe(), "; expected the shape of full ",
                 full.describe(), " with ", layout.local_length(), " = S/N tokens on axis ",
                 seq_axis);
  }
}

}  // namespace

void SequenceLayout::shard(const TensorView& full, const TensorView& local) const {
  constexpr const char* kWhere = "SequenceLayout::shard";
  check_pair(*this, full, local, kWhere);
  const TensorView f = sequence_view(full, "full", kWhere),
                   l = sequence_view(local, "local", kWhere);
  for (const SequenceChunk& c : chunks()) copy_rows(f, c.global_start, l, c.local_start, c.length);
}

void SequenceLayout::unshard(const TensorView& local, const TensorView& full) const {
  constexpr const char* kWhere = "SequenceLayout::unshard";
  check_pair(*this, full, local, kWhere);
  const TensorView f = sequence_view(full, "full", kWhere),
                   l = sequence_view(local, "local", kWhere);
  for (const SequenceChunk& c : chunks()) copy_rows(l, c.local_start, f, c.global_start, c.length);
}

std::string SequenceLayout::describe() const {
  std::string chunks;
  if (assignment_) {
    std::size_t count = 0;
    for (const auto& rank_chunks : *assignment_) count += rank_chunks.size();
    chunks = detail::concat(" (", count, " chunks)");
  }
  return detail::concat(sequence_layout_name(kind_), " layout of ", total_length_, " tokens over ",
                        world_, " ranks", chunks, ", rank ", rank_);
}

}  // namespace ringattn
