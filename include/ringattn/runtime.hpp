// What this copy of ringattn can run on: the CUDA backend and the GPUs the process can see.
#pragma once

namespace ringattn {

// True when the library was built with its CUDA backend (RINGATTN_WITH_CUDA in config.h says the
// same at compile time; this call answers for the library that is actually loaded).
bool built_with_cuda();

// The number of CUDA devices this process can use, after CUDA_VISIBLE_DEVICES. Returns 0 when the
// library was built without CUDA, and when the CUDA runtime reports no usable device (no driver,
// no device, none visible); throws Error naming the CUDA error for any other failure, so that a
// broken GPU machine is reported instead of looking like a machine without GPUs.
int cuda_device_count();

}  // namespace ringattn
