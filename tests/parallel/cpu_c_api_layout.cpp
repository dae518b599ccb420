// ringattn_layout_chunks (the C API's layouts, since 0.6):
//   - its chunks are call_layout's, the layout the C++ ring lays its calls out with, chunk for
//     chunk, for every rank of N = 1 to 8, lengths from 2N to 2048N, all three layouts and masks
//     drawn per seed (causal or not, windows, log-normal documents, one list or per-batch lists
//     with empty documents, starts past the end, lists further apart than their count);
//   - independently of the library: contiguous and zigzag by their definitions, and every
//     balanced layout holds each position once, S/N tokens a rank, in increasing positions;
//   - the mask reaches the layout: some balanced layouts of the sweep differ from those of the
//     same length without documents, and from zigzag's;
//   - the errors name the field, its value and what was expected (layout code, size, rank, batch,
//     seq_len not a multiple of N or 2N, capacity with the count it needs, null pointers, a
//     negative window, decreasing starts, a struct_size of another version).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/ringattn.h"
#include "tests/common/random.hpp"

namespace {

using ringattn::SequenceChunk;

struct Chunk {
  std::int64_t start = 0, length = 0;
  bool operator==(const Chunk&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Chunk& c) {
  return os << "[" << c.start << ", +" << c.length << ")";
}

// A mask as the C struct takes it: starts holds `lists` lists of `count`, `stride` apart.
struct MaskCase {
  std::string name{};
  bool causal = false;
  std::int64_t window_left = 0, window_right = 0;
  std::vector<std::int64_t> starts{};
  std::int64_t count = 0, stride = 0, batch = 1;

  ringattn::Mask mask() const {
    ringattn::Mask m{causal, 0, 0, window_left, window_right};
    m.documents = {count > 0 ? starts.data() : nullptr, count, stride};
    return m;
  }
};

ringattn_layout_params_t params_of(int32_t layout, int32_t size, int32_t rank, std::int64_t seq_len,
                                   const MaskCase& m) {
  ringattn_layout_params_t p{};
  p.struct_size = sizeof(p);
  p.layout = layout;
  p.size = size;
  p.rank = rank;
  p.causal = m.causal ? 1 : 0;
  p.seq_len = seq_len;
  p.batch = m.batch;
  p.window_left = m.window_left;
  p.window_right = m.window_right;
  p.document_starts = m.count > 0 ? m.starts.data() : nullptr;
  p.num_documents = m.count;
  p.document_batch_stride = m.stride;
  return p;
}

// The chunks from the C function; a failed call fails the test with its message.
std::vector<Chunk> c_chunks(const ringattn_layout_params_t& p) {
  std::vector<std::int64_t> starts(64, -1), lengths(64, -1);
  std::int64_t count = -1;
  const ringattn_status_t status =
      ringattn_layout_chunks(&p, starts.data(), lengths.data(), 64, &count);
  EXPECT_EQ(status, RINGATTN_SUCCESS) << ringattn_last_error();
  if (status != RINGATTN_SUCCESS || count < 0 || count > 64) return {};
  std::vector<Chunk> out;
  for (std::int64_t i = 0; i < count; ++i) out.push_back({starts[i], lengths[i]});
  // Nothing past the count is written.
  for (std::int64_t i = count; i < 64; ++i) {
    EXPECT_EQ(starts[i], -1);
    EXPECT_EQ(lengths[i], -1);
  }
  return out;
}

std::vector<Chunk> cpp_chunks(int32_t layout, int size, int rank, std::int64_t seq_len,
                              const MaskCase& m) {
  std::vector<Chunk> out;
  for (const SequenceChunk& c :
       ringattn::call_layout(static_cast<ringattn::SequenceLayoutKind>(layout), size, rank, seq_len,
                             ringattn::RingMask{m.mask(), m.batch})
           .chunks()) {
    out.push_back({c.global_start, c.length});
  }
  return out;
}

// Document starts of log-normal lengths (sigma 1) around `mean` over [0, seq_len), the first at 0
// or not; sorted, possibly with repeats (empty documents) and one start past the end.
std::vector<std::int64_t> lognormal_starts(std::int64_t mean, std::int64_t seq_len,
                                           std::mt19937_64& rng) {
  std::lognormal_distribution<double> length(std::log(static_cast<double>(mean)) - 0.5, 1.0);
  std::vector<std::int64_t> starts{};
  std::int64_t at = std::uniform_int_distribution<std::int64_t>(0, 1)(rng) * (mean / 3);
  while (at < seq_len) {
    starts.push_back(at);
    at += static_cast<std::int64_t>(std::floor(length(rng)));  // 0: an empty document
  }
  starts.push_back(seq_len + 5);
  return starts;
}

// The masks of one length: none, causal alone, windows, documents in one list and per batch row.
std::vector<MaskCase> masks_for(std::int64_t seq_len, std::mt19937_64& rng) {
  std::vector<MaskCase> masks;
  masks.push_back({.name = "none"});
  masks.push_back({.name = "causal", .causal = true});
  masks.push_back({.name = "causal window",
                   .causal = true,
                   .window_left = std::max<std::int64_t>(1, seq_len / 9)});
  masks.push_back({.name = "two-sided window",
                   .window_left = seq_len / 5 + 1,
                   .window_right = seq_len / 7 + 1});
  for (const bool causal : {true, false}) {
    MaskCase one{.name = causal ? "causal documents" : "documents", .causal = causal};
    one.starts = lognormal_starts(std::max<std::int64_t>(2, seq_len / 6), seq_len, rng);
    one.count = static_cast<std::int64_t>(one.starts.size());
    masks.push_back(one);
  }
  // Per batch row: three lists padded to one count with repeated starts (empty documents), laid
  // out count + 3 apart, the last row one long document from the middle, under a causal window.
  MaskCase rows{
      .name = "causal window, per-batch documents", .causal = true, .window_left = seq_len / 3 + 1};
  std::vector<std::vector<std::int64_t>> lists = {
      lognormal_starts(std::max<std::int64_t>(2, seq_len / 4), seq_len, rng),
      lognormal_starts(std::max<std::int64_t>(2, seq_len / 10), seq_len, rng),
      {0, seq_len / 2}};
  std::size_t count = 0;
  for (const auto& list : lists) count = std::max(count, list.size());
  rows.count = static_cast<std::int64_t>(count);
  rows.stride = rows.count + 3;
  rows.batch = 3;
  for (auto& list : lists) {
    list.resize(count, list.back());
    list.insert(list.end(), 3, -7);  // the gap between lists, never read
    rows.starts.insert(rows.starts.end(), list.begin(), list.end());
  }
  masks.push_back(rows);
  return masks;
}

// Contiguous and zigzag by their definitions (ringattn.h).
std::vector<Chunk> by_definition(int32_t layout, int size, int rank, std::int64_t seq_len) {
  if (layout == RINGATTN_CONTIGUOUS) return {{rank * (seq_len / size), seq_len / size}};
  const std::int64_t c = seq_len / (2 * size);
  return {{rank * c, c}, {(2 * std::int64_t{size} - 1 - rank) * c, c}};
}

TEST(CApiLayout, ChunksAreTheRingsLayout) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  std::mt19937_64 rng = ringattn::test::make_rng(52);
  int balanced_cases = 0, mask_changed = 0, not_zigzag = 0;
  for (int size = 1; size <= 8; ++size) {
    for (const std::int64_t per_chunk : {1, 7, 64, 1024}) {
      const std::int64_t seq_len = 2 * size * per_chunk;
      const std::vector<MaskCase> masks = masks_for(seq_len, rng);
      for (const MaskCase& m : masks) {
        std::vector<std::vector<Chunk>> balanced(static_cast<std::size_t>(size));
        for (int rank = 0; rank < size; ++rank) {
          for (const int32_t layout : {RINGATTN_CONTIGUOUS, RINGATTN_ZIGZAG, RINGATTN_BALANCED}) {
            SCOPED_TRACE(::testing::Message() << "layout " << layout << ", N " << size << ", rank "
                                              << rank << ", S " << seq_len << ", mask " << m.name);
            const std::vector<Chunk> c = c_chunks(params_of(layout, size, rank, seq_len, m));
            EXPECT_EQ(c, cpp_chunks(layout, size, rank, seq_len, m));
            if (layout != RINGATTN_BALANCED) {
              EXPECT_EQ(c, by_definition(layout, size, rank, seq_len));
            } else {
              balanced[static_cast<std::size_t>(rank)] = c;
            }
          }
        }
        // Balanced, from its chunks alone: each position once, S/N a rank, increasing positions.
        SCOPED_TRACE(::testing::Message()
                     << "balanced, N " << size << ", S " << seq_len << ", mask " << m.name);
        std::vector<int> held(static_cast<std::size_t>(seq_len), 0);
        for (int rank = 0; rank < size; ++rank) {
          std::int64_t tokens = 0, previous_end = -1;
          for (const Chunk& c : balanced[static_cast<std::size_t>(rank)]) {
            EXPECT_GT(c.start, previous_end) << "rank " << rank << ": chunks out of order";
            ASSERT_TRUE(c.start >= 0 && c.length >= 1 && c.start + c.length <= seq_len) << c;
            for (std::int64_t i = c.start; i < c.start + c.length; ++i) ++held[i];
            tokens += c.length;
            previous_end = c.start + c.length;
          }
          EXPECT_EQ(tokens, seq_len / size) << "rank " << rank;
        }
        EXPECT_EQ(std::count(held.begin(), held.end(), 1), seq_len) << "positions not held once";
        ++balanced_cases;
        if (m.count > 0 && size > 1) {
          MaskCase without = m;
          without.starts.clear();
          without.count = without.stride = 0;
          bool differs = false;
          for (int rank = 0; rank < size; ++rank) {
            differs |= c_chunks(params_of(RINGATTN_BALANCED, size, rank, seq_len, without)) !=
                       balanced[static_cast<std::size_t>(rank)];
          }
          mask_changed += differs ? 1 : 0;
        }
        if (size > 1) {
          bool other = false;
          for (int rank = 0; rank < size; ++rank) {
            other |= balanced[static_cast<std::size_t>(rank)].size() > 2;
          }
          not_zigzag += other ? 1 : 0;
        }
      }
    }
  }
  EXPECT_EQ(balanced_cases, 8 * 4 * 7);
  // The documents change the balanced layout in some of the sweep's cases, and some layouts hold
  // more than zigzag's two chunks a rank: the comparisons above see layouts of their own.
  EXPECT_GT(mask_changed, 10);
  EXPECT_GT(not_zigzag, 10);
  std::printf("balanced layouts: %d, changed by their documents: %d, beyond 2 chunks a rank: %d\n",
              balanced_cases, mask_changed, not_zigzag);
}

// A call's status and message.
struct Outcome {
  ringattn_status_t status;
  std::string message;
  std::int64_t count;
};

Outcome call(const ringattn_layout_params_t* p, std::int64_t capacity = 8, bool null_arrays = false,
             bool null_count = false) {
  std::int64_t starts[8] = {}, lengths[8] = {}, count = -1;
  const ringattn_status_t status =
      ringattn_layout_chunks(p, null_arrays ? nullptr : starts, null_arrays ? nullptr : lengths,
                             capacity, null_count ? nullptr : &count);
  return {status, ringattn_last_error(), count};
}

TEST(CApiLayout, ErrorsNameTheFieldAndWhatWasExpected) {
  const std::string w = "ringattn_layout_chunks: ";
  const MaskCase none{.name = "none"};
  const auto expect = [&](const ringattn_layout_params_t& p, const std::string& message) {
    const Outcome o = call(&p);
    EXPECT_EQ(o.status, RINGATTN_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(o.message, w + message);
    EXPECT_EQ(o.count, 0) << "count after a failure other than capacity";
  };
  ringattn_layout_params_t p = params_of(3, 2, 0, 8, none);
  expect(p, "params->layout is 3; expected 0 (contiguous), 1 (zigzag) or 2 (balanced)");
  p = params_of(-1, 2, 0, 8, none);
  expect(p, "params->layout is -1; expected 0 (contiguous), 1 (zigzag) or 2 (balanced)");
  expect(params_of(RINGATTN_ZIGZAG, 0, 0, 8, none),
         "params->size is 0; expected the number of ranks, >= 1");
  expect(params_of(RINGATTN_BALANCED, 2, 2, 8, none),
         "params->rank is 2; expected 0 <= rank < size (2)");
  expect(params_of(RINGATTN_CONTIGUOUS, 3, -1, 9, none),
         "params->rank is -1; expected 0 <= rank < size (3)");
  expect(params_of(RINGATTN_BALANCED, 2, 0, 10, none),
         "params->seq_len is 10; expected a positive multiple of 2 * size = 4 (the balanced "
         "layout gives each rank at least 2 equal chunks)");
  expect(params_of(RINGATTN_ZIGZAG, 3, 1, 9, none),
         "params->seq_len is 9; expected a positive multiple of 2 * size = 6 (the zigzag layout "
         "gives each rank 2 of 2 * size equal chunks)");
  expect(params_of(RINGATTN_CONTIGUOUS, 3, 0, 10, none),
         "params->seq_len is 10; expected a positive multiple of size = 3 (the contiguous layout "
         "gives each rank seq_len / size tokens)");
  expect(params_of(RINGATTN_BALANCED, 2, 0, 0, none),
         "params->seq_len is 0; expected a positive multiple of 2 * size = 4 (the balanced "
         "layout gives each rank at least 2 equal chunks)");
  MaskCase one_row = none;
  one_row.batch = 0;
  expect(params_of(RINGATTN_BALANCED, 2, 0, 8, one_row),
         "params->batch is 0; expected the ring calls' batch, >= 1");
  MaskCase window{.name = "negative window", .causal = true, .window_left = -1};
  expect(
      params_of(RINGATTN_BALANCED, 2, 0, 8, window),
      "window_left is -1; expected 0 (no window) or the number of positions a window spans (> 0)");
  MaskCase decreasing{.name = "decreasing",
                      .causal = true,
                      .starts = {0, 6, 4, 3, 5, 7},
                      .count = 3,
                      .stride = 3,
                      .batch = 2};
  expect(params_of(RINGATTN_BALANCED, 2, 1, 8, decreasing),
         "document start 2 of batch row 0 is 4, below start 1 (6); expected non-decreasing "
         "global positions");
  MaskCase null_starts{.name = "null starts"};
  null_starts.count = 2;
  p = params_of(RINGATTN_BALANCED, 2, 0, 8, null_starts);
  expect(p,
         "documents.data (C API: document_starts) is a null pointer with count 2; expected 2 "
         "int64 positions a batch row");

  // Capacity: the count it needs, in the message and in *count.
  p = params_of(RINGATTN_ZIGZAG, 2, 0, 8, none);
  Outcome o = call(&p, 1);
  EXPECT_EQ(o.status, RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(o.message, w + "capacity is 1; rank 0 holds 2 chunks under this layout and mask, so "
                           "starts and lengths need room for 2 (*count says so)");
  EXPECT_EQ(o.count, 2);
  o = call(&p, 0, true);
  EXPECT_EQ(o.status, RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(o.count, 2);
  o = call(&p, 2, true);
  EXPECT_EQ(o.message,
            w + "starts is a null pointer with capacity 2; expected room for 2 int64 values");
  EXPECT_EQ(o.count, 0) << "count after a failure other than capacity";
  o = call(&p, 2);
  EXPECT_EQ(o.status, RINGATTN_SUCCESS) << o.message;
  EXPECT_EQ(o.message, "");
  EXPECT_EQ(o.count, 2);

  // The pointers and the struct itself.
  o = call(&p, 8, false, true);
  EXPECT_EQ(o.message, w + "count (the output) is a null pointer");
  o = call(nullptr);
  EXPECT_EQ(o.message, w + "params is a null pointer");
  p.struct_size = sizeof(p) - 8;
  o = call(&p);
  EXPECT_EQ(o.status, RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(o.message, w + "params->struct_size is " + std::to_string(sizeof(p) - 8) +
                           "; expected sizeof = " + std::to_string(sizeof(p)) +
                           " (set it to sizeof(the struct))");
}

// The struct as ringattn.h documents it: no padding, the mask fields last as in the ring's.
TEST(CApiLayout, ParamsStructLayout) {
  using P = ringattn_layout_params_t;
  EXPECT_EQ(offsetof(P, layout), sizeof(size_t));
  EXPECT_EQ(offsetof(P, seq_len), sizeof(size_t) + 16);
  EXPECT_EQ(offsetof(P, window_left), offsetof(P, batch) + 8);
  EXPECT_EQ(sizeof(P), offsetof(P, document_batch_stride) + 8);
}

}  // namespace
