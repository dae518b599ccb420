// The mask of ringattn/attention.hpp as intervals of global positions, for host and device code.
//
// Every term of the mask bounds the keys a query sees by an interval whose ends never decrease as
// the query moves right: causal [-inf, i], window [i - window_left + 1, i + window_right - 1],
// the document [start of i's document, end of it). Their intersection is one interval
// keys_of(i) = [lo(i), hi(i)), with lo and hi non-decreasing in i. The same holds the other way
// round: the queries that see key j form queries_of(j) = [qlo(j), qhi(j)), non-decreasing in j.
// Every interval holds the diagonal (query j sees key j), so for a block of queries [qa, qb] and
// keys [ka, kb]:
//   some pair is visible   iff  [ka, kb] meets [lo(qa), hi(qb))
//   every pair is visible  iff  lo(qb) <= ka and kb < hi(qa)
// which is what the kernels use to skip tiles and to drop the mask arithmetic of full tiles.
// An empty interval has lo >= hi. All arithmetic saturates at the int64 limits.
#pragma once

#include <cstdint>
#include <limits>

#include "ringattn/attention.hpp"

#if defined(__CUDACC__)
#define RINGATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RINGATTN_HOST_DEVICE inline
#endif

namespace ringattn::detail {

struct PositionInterval {
  std::int64_t begin, end;  // [begin, end)

  RINGATTN_HOST_DEVICE bool empty() const { return begin >= end; }
  RINGATTN_HOST_DEVICE bool contains(std::int64_t p) const { return begin <= p && p < end; }
};

constexpr std::int64_t kPositionMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kPositionMin = std::numeric_limits<std::int64_t>::min();

// a + b and a - b for b >= 0, held at the int64 limits.
RINGATTN_HOST_DEVICE std::int64_t saturating_add(std::int64_t a, std::int64_t b) {
  return a > kPositionMax - b ? kPositionMax : a + b;
}
RINGATTN_HOST_DEVICE std::int64_t saturating_sub(std::int64_t a, std::int64_t b) {
  return a < kPositionMin + b ? kPositionMin : a - b;
}
RINGATTN_HOST_DEVICE std::int64_t max64(std::int64_t a, std::int64_t b) { return a > b ? a : b; }
RINGATTN_HOST_DEVICE std::int64_t min64(std::int64_t a, std::int64_t b) { return a < b ? a : b; }

// The rows [first, last) of a block whose row r sits at global position start + r (0 <= r < len)
// that lie in `global`; empty when first == last. start + len must fit int64 (check_mask).
struct LocalRange {
  std::int64_t first, last;

  RINGATTN_HOST_DEVICE bool empty() const { return first >= last; }
};
RINGATTN_HOST_DEVICE LocalRange local_range(PositionInterval global, std::int64_t start,
                                            std::int64_t len) {
  const std::int64_t first = global.begin <= start ? 0
                             : global.begin >= start + len ? len
                                                           : global.begin - start;
  const std::int64_t last = global.end <= start ? 0
                            : global.end >= start + len ? len
                                                        : global.end - start;
  return {first, last > first ? last : first};
}

// What a block of positions on one side (a tile of queries, or of keys) reaches on the other, in
// the other side's local indices: `some`, the indices that some member sees (a tile outside is
// skipped), and `every`, those that every member sees (a tile inside needs no mask; empty when
// none). The ends of the members' intervals grow with the position, so the first member's and the
// last member's intervals (as local ranges) give both: `some` from the first's first to the
// last's last, `every` from the last's first to the first's last.
struct BlockReach {
  LocalRange some, every;
};
RINGATTN_HOST_DEVICE BlockReach block_reach(LocalRange first_member, LocalRange last_member) {
  return {{first_member.first, last_member.last}, {last_member.first, first_member.last}};
}

// The mask of one batch row, by global position. Trivially copyable: kernels take it by value.
struct MaskRule {
  bool causal = false;
  std::int64_t window_left = 0, window_right = 0;  // 0: no limit
  const std::int64_t* starts = nullptr;            // this batch row's document starts
  std::int64_t count = 0;

  // The rule of batch row b of `mask` (the starts must be readable where the rule is used).
  static MaskRule of(const Mask& mask, std::int64_t b = 0) {
    MaskRule rule;
    rule.causal = mask.causal;
    rule.window_left = mask.window_left;
    rule.window_right = mask.window_right;
    if (mask.documents.active()) {
      rule.starts = mask.documents.data + b * mask.documents.batch_stride;
      rule.count = mask.documents.count;
    }
    return rule;
  }
  // The same rule for another batch row of the same documents.
  RINGATTN_HOST_DEVICE MaskRule for_batch(std::int64_t b, std::int64_t batch_stride) const {
    MaskRule rule = *this;
    if (rule.starts != nullptr) rule.starts += b * batch_stride;
    return rule;
  }

  RINGATTN_HOST_DEVICE bool has_documents() const { return count > 0; }
  RINGATTN_HOST_DEVICE bool local() const {
    return window_left > 0 || window_right > 0 || count > 0;
  }

  // The number of starts <= p (the document index of p), by binary search.
  RINGATTN_HOST_DEVICE std::int64_t starts_at_or_before(std::int64_t p) const {
    std::int64_t lo = 0, hi = count;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (starts[mid] <= p) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  }
  // [first position, one past the last) of the document of p.
  RINGATTN_HOST_DEVICE PositionInterval document_of(std::int64_t p) const {
    if (count == 0) return {kPositionMin, kPositionMax};
    const std::int64_t index = starts_at_or_before(p);
    return {index == 0 ? kPositionMin : starts[index - 1],
            index == count ? kPositionMax : starts[index]};
  }

  // The keys the query at position i sees.
  RINGATTN_HOST_DEVICE PositionInterval keys_of(std::int64_t i) const {
    PositionInterval r = document_of(i);
    if (causal) r.end = min64(r.end, saturating_add(i, 1));
    if (window_left > 0) r.begin = max64(r.begin, saturating_sub(i, window_left - 1));
    if (window_right > 0) r.end = min64(r.end, saturating_add(i, window_right));
    return r;
  }
  // The queries that see the key at position j.
  RINGATTN_HOST_DEVICE PositionInterval queries_of(std::int64_t j) const {
    PositionInterval r = document_of(j);
    if (causal) r.begin = max64(r.begin, j);
    if (window_right > 0) r.begin = max64(r.begin, saturating_sub(j, window_right - 1));
    if (window_left > 0) r.end = min64(r.end, saturating_add(j, window_left));
    return r;
  }
  RINGATTN_HOST_DEVICE bool visible(std::int64_t i, std::int64_t j) const {
    return keys_of(i).contains(j);
  }

  // Keys [ka, kb] against queries [qa, qb] (inclusive): does any query see any key? Each key j
  // is seen by the query at j itself, so queries_of(j) is never empty; its ends grow with j, so
  // the keys seen by some query of [qa, qb] are exactly [lo(qa), hi(qb)).
  RINGATTN_HOST_DEVICE bool any_visible(std::int64_t qa, std::int64_t qb, std::int64_t ka,
                                        std::int64_t kb) const {
    return max64(ka, keys_of(qa).begin) < min64(saturating_add(kb, 1), keys_of(qb).end);
  }
  // Every query of [qa, qb] sees every key of [ka, kb].
  RINGATTN_HOST_DEVICE bool all_visible(std::int64_t qa, std::int64_t qb, std::int64_t ka,
                                        std::int64_t kb) const {
    return keys_of(qb).begin <= ka && kb < keys_of(qa).end;
  }

};

}  // namespace ringattn::detail
