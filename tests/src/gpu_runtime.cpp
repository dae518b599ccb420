// The CUDA runtime as ringattn sees it on a GPU machine.
#include "ringattn/runtime.hpp"

#include <gtest/gtest.h>

#include "tests/common/gpu.hpp"

namespace ringattn {
namespace {

TEST(Runtime, SeesTheGpu) {
  RINGATTN_REQUIRE_GPUS(1);
  EXPECT_TRUE(built_with_cuda());
  EXPECT_GE(cuda_device_count(), 1);
}

}  // namespace
}  // namespace ringattn
