// backward_row_splits, the Hopper backward's choice of how many CTAs share a key block's rows
// without a mask: hand-worked cases (the wave counts written out), the launches of the split tests
// in kernels.flash, the gridDim.z cap, and its contract over a sweep of sizes (at most 8 parts and
// max_splits, at least 128 steps a part, the fewest parts whose waves are 98.5% full, else the
// fullest).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>

#include "kernels/cuda/backward_row_splits.hpp"

namespace {

using ringattn::cuda_detail::backward_row_splits;

// How full the last wave leaves the GPU: CTAs / (waves x multiprocessors).
double wave_fill(std::int64_t ctas, int multiprocessors) {
  const std::int64_t waves = (ctas + multiprocessors - 1) / multiprocessors;
  return static_cast<double>(ctas) / static_cast<double>(waves * multiprocessors);
}

TEST(BackwardRowSplits, HandWorkedCases) {
  // 32k keys (256 blocks of 128) x 16 KV heads: 4096 CTAs on 132 multiprocessors are 32 waves of
  // 4224 slots, 97.0% full; two parts make 8192 CTAs in 63 waves (8316 slots), 98.5%.
  EXPECT_EQ(backward_row_splits(4096, 1024, 132, 65535), 2);
  // 8192 CTAs are 63 waves, 98.5% full already.
  EXPECT_EQ(backward_row_splits(8192, 1024, 132, 65535), 1);
  // An exact multiple of the multiprocessors needs no split.
  EXPECT_EQ(backward_row_splits(1320, 4096, 132, 65535), 1);
  // kernels.flash's split cases: 2 CTAs over 257 row tiles x 2 query heads a KV head (514 steps)
  // take 4 parts of 128 steps and more (5 would leave 102); 8 CTAs over 129 x 2 steps take 2.
  EXPECT_EQ(backward_row_splits(2, 514, 132, 65535), 4);
  EXPECT_EQ(backward_row_splits(8, 258, 132, 65535), 2);
  // Short CTAs are not split: 127 steps stay one part however empty the wave.
  EXPECT_EQ(backward_row_splits(1, 127, 132, 65535), 1);
}

TEST(BackwardRowSplits, KeepsToTheCap) {
  // Few CTAs with many steps would take 8 parts; the cap (65535 / batch) bounds them.
  EXPECT_EQ(backward_row_splits(2, 100000, 132, 65535), 8);
  EXPECT_EQ(backward_row_splits(2, 100000, 132, 3), 3);
  EXPECT_EQ(backward_row_splits(2, 100000, 132, 1), 1);
}

TEST(BackwardRowSplits, FollowsItsContractOverASweep) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::int64_t> ctas_of(1, 20000), steps_of(1, 5000);
  std::uniform_int_distribution<int> sms_of(1, 200), cap_of(1, 12);
  for (int trial = 0; trial < 20000; ++trial) {
    const std::int64_t ctas = ctas_of(rng), steps = steps_of(rng);
    const int sms = sms_of(rng), cap = cap_of(rng);
    const int got = backward_row_splits(ctas, steps, sms, cap);
    SCOPED_TRACE(testing::Message() << "ctas " << ctas << ", steps " << steps << ", multiprocessors "
                                    << sms << ", cap " << cap << ": " << got << " parts");
    // The part counts allowed: 1, and up to min(8, cap) while a part keeps 128 steps.
    int allowed = 1;
    while (allowed + 1 <= std::min(8, cap) && steps / (allowed + 1) >= 128) ++allowed;
    ASSERT_GE(got, 1);
    ASSERT_LE(got, allowed);
    int first_full = 0;
    for (int k = 1; k <= allowed && first_full == 0; ++k) {
      if (wave_fill(ctas * k, sms) >= 0.985) first_full = k;
    }
    if (first_full != 0) {
      EXPECT_EQ(got, first_full);
    } else {
      for (int k = 1; k <= allowed; ++k) {
        const double fill = wave_fill(ctas * k, sms), chosen = wave_fill(ctas * got, sms);
        EXPECT_LE(fill, chosen + 1e-9) << k << " parts fill the waves better";
        if (k < got) {
          EXPECT_LT(fill, chosen - 1e-9) << "fewer parts fill them as well";
        }
      }
    }
  }
}

}  // namespace
