#pragma once
// How the Hopper backward without a mask shares each key block's query rows between CTAs. Plain
// C++ (no CUDA), so that the host tests check it without a GPU.

#include <algorithm>
#include <cstdint>

namespace ringattn::cuda_detail {

// How many CTAs share each key block's query rows in the Hopper backward without a mask. Its CTAs
// all run equally long, so when their number is just over a multiple of the multiprocessors the
// last wave leaves most of them idle for a whole CTA (4096 CTAs on 132: 3% of the kernel).
// Splitting the rows makes more, shorter CTAs: the fewest splits (up to 8) whose waves are at
// least 98.5% full, else the fullest, keeping 128 steps (row tiles x query heads a KV head) a CTA,
// as a CTA's start and its dK/dV additions cost about what a few steps do. At most max_splits
// (gridDim.z holds batch x splits).
inline int backward_row_splits(std::int64_t ctas, std::int64_t steps, int multiprocessors,
                               int max_splits) {
  int best = 1;
  double best_fill = 0.0;
  for (int splits = 1; splits <= std::min(8, max_splits) && (splits == 1 || steps / splits >= 128);
       ++splits) {
    const std::int64_t n = ctas * splits;
    const std::int64_t waves = (n + multiprocessors - 1) / multiprocessors;
    const double fill = static_cast<double>(n) / static_cast<double>(waves * multiprocessors);
    if (fill > best_fill + 1e-9) best = splits, best_fill = fill;
    if (fill >= 0.985) break;
  }
  return best;
}

}  // namespace ringattn::cuda_detail
