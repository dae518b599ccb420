#include "train/shard_ranges.hpp"

#include "ringattn/error.hpp"

namespace ringattn::train {

std::string_view layout_name(ShardLayout layout) {
  switch (layout) {
    case ShardLayout::contiguous:
      return "contiguous";
    case ShardLayout::zigzag:
      return "zigzag";
    case ShardLayout::balanced:
      return "balanced";
  }
  return "unknown";
}

int chunk_count(int cp_size, ShardLayout layout) {
  return layout == ShardLayout::contiguous ? cp_size : 2 * cp_size;
}

std::vector<TokenRange> shard_ranges(std::int64_t seq_len, int cp_size, int cp_rank,
                                     ShardLayout layout) {
  if (cp_size < 1) detail::fail("shard_ranges", "cp_size is ", cp_size, "; expected at least 1");
  if (cp_rank < 0 || cp_rank >= cp_size) {
    detail::fail("shard_ranges", "cp_rank is ", cp_rank, "; expected 0 <= cp_rank < ", cp_size);
  }
  if (layout == ShardLayout::balanced) {
    detail::fail("shard_ranges", "the balanced layout follows each batch's documents; expected "
                 "contiguous or zigzag here");
  }
  const int chunks = chunk_count(cp_size, layout);
  if (seq_len < chunks || seq_len % chunks != 0) {
    detail::fail("shard_ranges", "seq_len is ", seq_len, "; the ", layout_name(layout),
                 " layout over ", cp_size, " ranks needs a positive multiple of ", chunks);
  }
  const std::int64_t chunk = seq_len / chunks;
  auto chunk_range = [chunk](std::int64_t index) {
    return TokenRange{index * chunk, (index + 1) * chunk};
  };
  if (layout == ShardLayout::contiguous) return {chunk_range(cp_rank)};
  return {chunk_range(cp_rank), chunk_range(chunks - 1 - cp_rank)};
}

TokenShard take_shard(std::span<const std::int32_t> tokens, std::span<const float> loss_mask,
                      std::span<const TokenRange> ranges) {
  const auto seq_len = static_cast<std::int64_t>(loss_mask.size());
  if (static_cast<std::int64_t>(tokens.size()) != seq_len + 1) {
    detail::fail("take_shard", "tokens has ", tokens.size(),
                 " entries; expected seq_len + 1 = ", seq_len + 1,
                 " (loss_mask has seq_len = ", seq_len, ")");
  }
  TokenShard shard;
  for (const TokenRange& range : ranges) {
    if (range.begin < 0 || range.end > seq_len || range.begin > range.end) {
      detail::fail("take_shard", "range [", range.begin, ", ", range.end,
                   ") is not inside the sequence [0, ", seq_len, ")");
    }
    shard.inputs.insert(shard.inputs.end(), tokens.begin() + range.begin,
                        tokens.begin() + range.end);
    shard.targets.insert(shard.targets.end(), tokens.begin() + range.begin + 1,
                         tokens.begin() + range.end + 1);
    shard.loss_mask.insert(shard.loss_mask.end(), loss_mask.begin() + range.begin,
                           loss_mask.begin() + range.end);
  }
  return shard;
}

}  // namespace ringattn::train
