// What the library reports about its CUDA backend agrees with the build, GPU or not.
#include "ringattn/runtime.hpp"

#include <gtest/gtest.h>

#include "ringattn/config.h"

namespace ringattn {
namespace {

TEST(Runtime, BuiltWithCudaMatchesConfigHeader) {
  EXPECT_EQ(built_with_cuda(), RINGATTN_WITH_CUDA == 1);
}

// Also on a machine without a driver: no GPU is an answer (0), not an error.
TEST(Runtime, DeviceCountIsZeroWithoutCuda) {
  const int count = cuda_device_count();
  EXPECT_GE(count, 0);
  if (!built_with_cuda()) {
    EXPECT_EQ(count, 0);
  }
}

}  // namespace
}  // namespace ringattn
