// GPU tests skip, with the reason, where the GPUs they need are not there:
//
//   TEST(NcclRing, MatchesOneDevice) {
//     RINGATTN_REQUIRE_GPUS(2);
//     ...
//   }
//
// Also usable in a fixture's SetUp(). ctest reports a gpu binary whose tests all skipped as
// skipped (tests/CMakeLists.txt).
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "ringattn/runtime.hpp"

namespace ringattn::test {

// Why a test that needs `count` GPUs cannot run in this process, or "" when it can.
inline std::string missing_gpus_reason(int count) {
  if (!built_with_cuda()) return "ringattn was built without CUDA";
  const int found = cuda_device_count();
  if (found == 0) return "no CUDA GPU visible";
  if (found < count) {
    return "needs " + std::to_string(count) + " GPUs, found " + std::to_string(found);
  }
  return {};
}

}  // namespace ringattn::test

#define RINGATTN_REQUIRE_GPUS(count)                                                        \
  do {                                                                                      \
    const std::string ringattn_missing_gpus = ::ringattn::test::missing_gpus_reason(count); \
    if (!ringattn_missing_gpus.empty()) GTEST_SKIP() << ringattn_missing_gpus;              \
  } while (false)
