#include "train/documents.hpp"

#include <algorithm>

namespace ringattn::train {

std::vector<std::int64_t> window_document_starts(std::span<const std::int64_t> stream_starts,
                                                 std::int64_t window_begin, std::int64_t seq_len) {
  std::vector<std::int64_t> starts;
  auto it = std::upper_bound(stream_starts.begin(), stream_starts.end(), window_begin);
  for (; it != stream_starts.end() && *it < window_begin + seq_len; ++it) {
    starts.push_back(*it - window_begin);
  }
  return starts;
}

bool document_starts_at(std::span<const std::int64_t> stream_starts, std::int64_t token) {
  return std::binary_search(stream_starts.begin(), stream_starts.end(), token);
}

void mask_document_ends(std::span<const std::int64_t> positions,
                        std::span<const std::int64_t> starts, std::int64_t seq_len,
                        bool next_starts, std::span<float> loss_mask) {
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const std::int64_t target = positions[i] + 1;
    if ((target == seq_len && next_starts) ||
        std::binary_search(starts.begin(), starts.end(), target)) {
      loss_mask[i] = 0.0f;
    }
  }
}

std::vector<std::int64_t> document_positions(std::span<const std::int64_t> positions,
                                             std::span<const std::int64_t> starts) {
  std::vector<std::int64_t> out(positions.size());
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const auto after = std::upper_bound(starts.begin(), starts.end(), positions[i]);
    out[i] = after == starts.begin() ? positions[i] : positions[i] - *(after - 1);
  }
  return out;
}

std::vector<std::int64_t> local_document_starts(std::span<const std::int64_t> positions,
                                                std::span<const std::int64_t> starts) {
  std::vector<std::int64_t> local;
  const auto document = [&](std::int64_t p) {
    return std::upper_bound(starts.begin(), starts.end(), p) - starts.begin();
  };
  for (std::size_t i = 1; i < positions.size(); ++i) {
    if (document(positions[i]) != document(positions[i - 1])) {
      local.push_back(static_cast<std::int64_t>(i));
    }
  }
  return local;
}

DocumentBatch pad_document_lists(std::span<const std::vector<std::int64_t>> rows,
                                 std::int64_t pad) {
  DocumentBatch batch;
  for (const auto& row : rows) {
    batch.count = std::max(batch.count, static_cast<std::int64_t>(row.size()));
  }
  batch.starts.assign(rows.size() * static_cast<std::size_t>(batch.count), pad);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::copy(rows[r].begin(), rows[r].end(),
              batch.starts.begin() + static_cast<std::ptrdiff_t>(r * batch.count));
  }
  return batch;
}

}  // namespace ringattn::train
