// The layout part of the C API (ringattn_layout_chunks): a rank's chunks under any layout, made by
// the functions the ring itself lays its calls out with (call_layout), so that a caller in another
// language never keeps a copy of the layouts, and the balanced one in particular, which follows
// the mask.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/ringattn.h"
#include "src/attention_checks.hpp"
#include "src/c_api_support.hpp"

namespace {
using namespace ringattn;

constexpr detail::StructVersion kLayoutVersions[] = {{sizeof(ringattn_layout_params_t), "0.6"}};

// What the layout needs of the size, rank, batch and length, named by the struct's fields (the
// layouts' own checks would name S and N).
void check_extents(const ringattn_layout_params_t& p, const char* where) {
  if (p.layout != RINGATTN_CONTIGUOUS && p.layout != RINGATTN_ZIGZAG &&
      p.layout != RINGATTN_BALANCED) {
    detail::fail(where, "params->layout is ", p.layout,
                 "; expected 0 (contiguous), 1 (zigzag) or 2 (balanced)");
  }
  if (p.size < 1) {
    detail::fail(where, "params->size is ", p.size, "; expected the number of ranks, >= 1");
  }
  if (p.rank < 0 || p.rank >= p.size) {
    detail::fail(where, "params->rank is ", p.rank, "; expected 0 <= rank < size (", p.size, ")");
  }
  if (p.batch < 1) {
    detail::fail(where, "params->batch is ", p.batch, "; expected the ring calls' batch, >= 1");
  }
  if (p.layout == RINGATTN_CONTIGUOUS) {
    if (p.seq_len < 1 || p.seq_len % p.size != 0) {
      detail::fail(where, "params->seq_len is ", p.seq_len,
                   "; expected a positive multiple of size = ", p.size,
                   " (the contiguous layout gives each rank seq_len / size tokens)");
    }
    return;
  }
  const std::int64_t chunks = 2 * std::int64_t{p.size};
  if (p.seq_len < 1 || p.seq_len % chunks != 0) {
    detail::fail(where, "params->seq_len is ", p.seq_len,
                 "; expected a positive multiple of 2 * size = ", chunks,
                 p.layout == RINGATTN_ZIGZAG
                     ? " (the zigzag layout gives each rank 2 of 2 * size equal chunks)"
                     : " (the balanced layout gives each rank at least 2 equal chunks)");
  }
}

}  // namespace

extern "C" ringattn_status_t ringattn_layout_chunks(const ringattn_layout_params_t* params,
                                                    int64_t* starts, int64_t* lengths,
                                                    int64_t capacity, int64_t* count) {
  constexpr const char* kWhere = "ringattn_layout_chunks";
  return detail::guarded([&] {
    if (count == nullptr) detail::fail(kWhere, "count (the output) is a null pointer");
    *count = 0;
    detail::check_params(params, kWhere, kLayoutVersions);
    const ringattn_layout_params_t& p = *params;
    check_extents(p, kWhere);
    Mask mask{p.causal != 0, 0, 0, p.window_left, p.window_right};
    mask.documents = {p.document_starts, p.num_documents, p.document_batch_stride};
    // The checks of a block call over the whole sequence: windows >= 0, the starts readable and
    // non-decreasing in every batch row.
    detail::check_mask(mask, AttentionShape{p.batch, p.seq_len, p.seq_len, 1, 1, 1, 1},
                       Memory::host, kWhere);
    const std::vector<SequenceChunk> chunks =
        call_layout(static_cast<SequenceLayoutKind>(p.layout), p.size, p.rank, p.seq_len,
                    RingMask{mask, p.batch})
            .chunks();
    const auto needed = static_cast<std::int64_t>(chunks.size());
    if (capacity < needed) {
      *count = needed;  // for the caller's next try
      detail::fail(kWhere, "capacity is ", capacity, "; rank ", p.rank, " holds ", needed,
                   " chunks under this layout and mask, so starts and lengths need room for ",
                   needed, " (*count says so)");
    }
    if (starts == nullptr || lengths == nullptr) {
      detail::fail(kWhere, starts == nullptr ? "starts" : "lengths",
                   " is a null pointer with capacity ", capacity, "; expected room for ", needed,
                   " int64 values");
    }
    for (std::int64_t i = 0; i < needed; ++i) {
      starts[i] = chunks[static_cast<std::size_t>(i)].global_start;
      lengths[i] = chunks[static_cast<std::size_t>(i)].length;
    }
    *count = needed;
  });
}
