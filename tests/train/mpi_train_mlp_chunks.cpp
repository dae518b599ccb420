// ringattn-mpi-ranks: 1 2
// The feed-forward block in chunks of tokens (train.mlp_chunk_tokens): 20 steps of the tiny CPU
// trainer with the block over 7 or 50 tokens at a time (uneven chunks of a rank's 256 / N tokens)
// follow the untiled run's losses within 1e-6 relative (fp32: the weights' gradients are summed
// chunk by chunk, in another order), in every recompute mode; at one chunk size the recompute
// modes give bitwise the same losses (each makes the same chunks' hidden activations again in the
// backward). And the loss falls.
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"
#include "ringattn/ring.hpp"
#include "tests/train/trainer_runs.hpp"
#include "train/config.hpp"

namespace ringattn::train {
namespace {

TrainConfig tiny_config(int cp) {
  TrainConfig c = test::tiny_retrieval_config();
  c.parallel.cp = cp;
  return c;
}

TEST(MlpChunks, TiledLossesFollowTheUntiledRun) {
  std::shared_ptr<Communicator> world = mpi_world_communicator();
  const int size = communicator_size(*world);
  TrainConfig untiled = tiny_config(size);
  untiled.train.mlp_chunk_tokens = 0;  // without recompute: every token at once
  const std::vector<double> reference = test::losses_of(untiled, world);
  ASSERT_EQ(reference.size(), 20u);
  EXPECT_LT(reference.back(), reference.front() - 0.5) << "the loss did not fall";
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (const int chunk : {7, 50}) {
    std::vector<double> first_mode;
    for (const int mode : {0, 1, 2}) {
      TrainConfig tiled = untiled;
      tiled.train.mlp_chunk_tokens = chunk;
      tiled.train.recompute = mode >= 1;
      tiled.train.recompute_attention = mode == 2;
      const std::string what = "chunks of " + std::to_string(chunk) + " tokens, " +
                               (mode == 0   ? "no recompute"
                                : mode == 1 ? "recompute"
                                            : "recompute with attention") +
                               ", cp = " + std::to_string(size);
      const std::vector<double> losses = test::losses_of(tiled, world);
      ASSERT_EQ(losses.size(), reference.size()) << what;
      double worst = 0.0;
      for (std::size_t i = 0; i < losses.size(); ++i) {
        ASSERT_TRUE(std::isfinite(losses[i])) << what << ": step " << i + 1;
        worst = std::max(worst, std::abs(losses[i] - reference[i]) / std::abs(reference[i]));
        EXPECT_LE(std::abs(losses[i] - reference[i]), 1e-6 * std::abs(reference[i]))
            << what << ": step " << i + 1 << " loss " << losses[i] << " vs untiled "
            << reference[i];
      }
      if (rank == 0) {
        std::printf("%s: largest relative loss difference to the untiled run %.3g\n",
                    what.c_str(), worst);
      }
      if (mode == 0) {
        first_mode = losses;
      } else {
        EXPECT_EQ(losses, first_mode) << what << ": not bitwise the losses without recompute";
      }
    }
  }
}

}  // namespace
}  // namespace ringattn::train
