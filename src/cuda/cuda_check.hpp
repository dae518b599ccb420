// Checks for CUDA runtime, cuBLAS and NCCL return codes: a throwing form for normal code and a
// logging form for destructors, which must not throw.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>

#include "ringattn/error.hpp"

namespace ringattn::detail {

inline void check_cuda(cudaError_t code, const char* call, const char* where) {
  if (code == cudaSuccess) return;
  fail_as(ErrorKind::library, where, call, " failed: ", cudaGetErrorName(code), " (", cudaGetErrorString(code), ")");
}

inline void log_cuda(cudaError_t code, const char* call, const char* where) noexcept {
  if (code == cudaSuccess) return;
  std::fprintf(stderr, "ringattn: %s: %s failed: %s\n", where, call, cudaGetErrorString(code));
}

inline void check_cublas(cublasStatus_t code, const char* call, const char* where) {
  if (code == CUBLAS_STATUS_SUCCESS) return;
  fail_as(ErrorKind::library, where, call, " failed: ", cublasGetStatusName(code), " (", cublasGetStatusString(code), ")");
}

inline void check_nccl(ncclResult_t code, const char* call, const char* where) {
  if (code == ncclSuccess || code == ncclInProgress) return;
  fail_as(ErrorKind::library, where, call, " failed: ", ncclGetErrorString(code), " (", ncclGetLastError(nullptr), ")");
}

}  // namespace ringattn::detail

#define RINGATTN_CUDA_CHECK(call) ::ringattn::detail::check_cuda((call), #call, __func__)
#define RINGATTN_CUDA_LOG(call) ::ringattn::detail::log_cuda((call), #call, __func__)
// After a kernel launch: the launch's own error (bad configuration, too much shared memory).
#define RINGATTN_CUDA_CHECK_LAUNCH() \
  ::ringattn::detail::check_cuda(cudaGetLastError(), "kernel launch", __func__)
#define RINGATTN_CUBLAS_CHECK(call) ::ringattn::detail::check_cublas((call), #call, __func__)
#define RINGATTN_NCCL_CHECK(call) ::ringattn::detail::check_nccl((call), #call, __func__)
