// The balanced layout (ringattn/ring.hpp, SequenceLayoutKind::balanced): equal chunks of the
// sequence given to the ranks so that each rank's visible work under a call's mask is even.
//
// A query's work is the number of keys it sees (MaskRule::keys_of, summed over the batch rows
// that have their own documents), so a chunk's work is a difference of prefix sums. Where the
// contiguous split is already even (its most loaded rank at most kEnough x the mean, as under a
// sliding window), it is the layout: one chunk a rank, and a window's K/V travel one hop. Else, for c = 2,
// 4, 8, ... chunks a rank (S % cN == 0, chunks of at least kMinChunk tokens beyond c = 2) the
// chunks are dealt largest first, each to the least loaded rank that still has room for it (ties:
// the earlier chunk, the lower rank), which under a causal mask alone gives zigzag's pairs. The
// first c whose most loaded rank carries at most kEnough x the mean is taken, else the most even
// of those tried. Each rank's chunks are then put in the order of their positions and adjacent
// ones joined, so that a rank's own shard stays one causal block where the mask allows.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "parallel/ring_attention.hpp"
#include "ringattn/error.hpp"
#include "src/mask_rule.hpp"

namespace ringattn {
namespace {

constexpr std::int64_t kMinChunk = 128;  // one key tile of the CUDA block
constexpr double kEnough = 1.05;
constexpr int kMostChunksARank = 64;

// The visible keys of every query position of [0, S), summed over the mask's distinct rows, as
// prefix sums: prefix[i] = the work of positions [0, i).
std::vector<double> work_prefix(std::int64_t total_length, const RingMask& m) {
  const DocumentStarts& documents = m.mask.documents;
  const std::int64_t rows = documents.active() && documents.batch_stride != 0 ? m.batch : 1;
  std::vector<double> prefix(static_cast<std::size_t>(total_length) + 1, 0.0);
  for (std::int64_t b = 0; b < rows; ++b) {
    const detail::MaskRule rule = detail::MaskRule::of(m.mask, b);
    double sum = 0.0;
    for (std::int64_t i = 0; i < total_length; ++i) {
      const detail::PositionInterval keys = rule.keys_of(i);
      sum += static_cast<double>(std::max<std::int64_t>(
          0, std::min(keys.end, total_length) - std::max<std::int64_t>(keys.begin, 0)));
      prefix[static_cast<std::size_t>(i) + 1] += sum;
    }
  }
  return prefix;
}

struct Deal {
  std::vector<std::vector<std::int64_t>> chunks;  // [rank] chunk indices
  double most = 0.0, mean = 0.0;
  double imbalance() const { return mean > 0.0 ? most / mean : 1.0; }
};

// cN chunks of `chunk` tokens, c to each of `world` ranks, largest work first to the least loaded
// rank with room.
Deal deal(const std::vector<double>& prefix, int world, int per_rank, std::int64_t chunk) {
  const std::int64_t count = std::int64_t{world} * per_rank;
  std::vector<double> work(static_cast<std::size_t>(count));
  for (std::int64_t j = 0; j < count; ++j) {
    work[j] = prefix[static_cast<std::size_t>((j + 1) * chunk)] -
              prefix[static_cast<std::size_t>(j * chunk)];
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(count));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t a, std::int64_t b) { return work[a] > work[b]; });
  Deal d;
  d.chunks.resize(static_cast<std::size_t>(world));
  std::vector<double> load(static_cast<std::size_t>(world), 0.0);
  for (const std::int64_t j : order) {
    int best = -1;
    for (int r = 0; r < world; ++r) {
      if (static_cast<int>(d.chunks[r].size()) == per_rank) continue;
      if (best < 0 || load[r] < load[best]) best = r;
    }
    d.chunks[best].push_back(j);
    load[best] += work[j];
  }
  d.most = *std::max_element(load.begin(), load.end());
  d.mean = std::accumulate(load.begin(), load.end(), 0.0) / world;
  return d;
}

}  // namespace

std::shared_ptr<const SequenceLayout::Assignment> balanced_assignment(int world,
                                                                      std::int64_t total_length,
                                                                      const RingMask& mask) {
  constexpr const char* kWhere = "balanced layout";
  if (world < 1) detail::fail(kWhere, "world size N = ", world, "; expected >= 1 ranks");
  if (total_length < 1 || total_length % (2 * std::int64_t{world}) != 0) {
    detail::fail(kWhere, "total length S = ", total_length, " is not a multiple of 2N = ",
                 2 * std::int64_t{world}, " (N = ", world,
                 " ranks, each holding at least 2 equal chunks)");
  }
  if (world == 1) {  // one rank holds the sequence in order
    return std::make_shared<const SequenceLayout::Assignment>(
        SequenceLayout::Assignment{{{0, 0, total_length}}});
  }
  const std::vector<double> prefix = work_prefix(total_length, mask);
  auto assignment = std::make_shared<SequenceLayout::Assignment>(static_cast<std::size_t>(world));
  const std::int64_t shard = total_length / world;
  double most = 0.0;
  for (int r = 0; r < world; ++r) {
    most = std::max(most, prefix[static_cast<std::size_t>((r + 1) * shard)] -
                              prefix[static_cast<std::size_t>(r * shard)]);
  }
  const double mean = prefix.back() / world;
  if (mean <= 0.0 || most <= kEnough * mean) {
    for (int r = 0; r < world; ++r) (*assignment)[r].push_back({0, r * shard, shard});
    return assignment;
  }
  Deal best;
  std::int64_t best_chunk = 0;
  for (int per_rank = 2; per_rank <= kMostChunksARank; per_rank *= 2) {
    const std::int64_t count = std::int64_t{world} * per_rank;
    if (total_length % count != 0) break;
    const std::int64_t chunk = total_length / count;
    if (per_rank > 2 && chunk < kMinChunk) break;
    Deal d = deal(prefix, world, per_rank, chunk);
    if (best_chunk == 0 || d.imbalance() < best.imbalance()) {
      best = std::move(d);
      best_chunk = chunk;
    }
    if (best.imbalance() <= kEnough) break;
  }
  for (int r = 0; r < world; ++r) {
    std::vector<std::int64_t>& mine = best.chunks[r];
    std::sort(mine.begin(), mine.end());
    std::vector<SequenceChunk>& out = (*assignment)[r];
    std::int64_t local = 0;
    for (const std::int64_t j : mine) {
      const std::int64_t start = j * best_chunk;
      if (!out.empty() && out.back().global_start + out.back().length == start) {
        out.back().length += best_chunk;
      } else {
        out.push_back({local, start, best_chunk});
      }
      local += best_chunk;
    }
  }
  return assignment;
}

SequenceLayout balanced_layout(int world, int rank, std::int64_t total_length,
                               const RingMask& mask) {
  return SequenceLayout(rank, total_length, balanced_assignment(world, total_length, mask));
}

SequenceLayout call_layout(SequenceLayoutKind kind, int world, int rank,
                           std::int64_t total_length, const RingMask& mask) {
  if (kind == SequenceLayoutKind::balanced) {
    return balanced_layout(world, rank, total_length, mask);
  }
  return SequenceLayout(kind, world, rank, total_length);
}

}  // namespace ringattn
