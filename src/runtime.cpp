#include "ringattn/runtime.hpp"

#include "ringattn/config.h"
#include "ringattn/error.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace ringattn {

bool built_with_cuda() { return RINGATTN_WITH_CUDA != 0; }

int cuda_device_count() {
#if RINGATTN_WITH_CUDA
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  (void)cudaGetLastError();
  // No driver or no device is an answer (zero GPUs); anything else is a broken GPU machine.
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) return 0;
  if (status != cudaSuccess) {
    detail::fail_as(ErrorKind::library, "cuda_device_count", "cudaGetDeviceCount failed: ",
                    cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
  }
  return count;
#else
  return 0;
#endif
}

}  // namespace ringattn
