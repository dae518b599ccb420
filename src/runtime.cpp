#include "ringattn/runtime.hpp"

#include "ringattn/config.h"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace ringattn {

bool built_with_cuda() { return RINGATTN_WITH_CUDA != 0; }

int cuda_device_count() {
#if RINGATTN_WITH_CUDA
  int count = 0;
  // No driver or no device is an answer here (zero GPUs), not an error.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

}  // namespace ringattn
