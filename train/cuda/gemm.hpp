// The model's matrix products on the GPU through cuBLASLt: bf16 operands, fp32 accumulation, in
// the CPU twin's conventions (train/op_matmul.hpp): X [rows, in], W [out, in], Y [rows, out], all
// row-major.
//
//   forward          Y  (+)= X W^T      bf16 out (Write::add: the residual stream, Y = Y + X W^T,
//                                       or Y = R + X W^T with a residual R)
//   backward_input   dX (+)= dY W       bf16 out
//   backward_weight  dW (+)= dY^T X     fp32 out (Write::add accumulates over micro-batches)
//
// Write::add is cuBLASLt's epilogue with beta = 1 and C = Y (or R), in one pass. Into a bf16
// output that epilogue rounds the fp32 product P to bf16 before adding C and rounds the sum: two
// roundings, within 2^-8 (|P| + |P + C|) (u = 2^-8, bf16's unit roundoff), as a bf16 product
// added in fp32 would be; one rounding of the fp32 sum would be within 2^-8 |P + C|, but that
// variant (P to an fp32 buffer, then an add kernel) moved 384 MiB more per call at 32k tokens.
// One Gemm per stream: it owns a cuBLASLt handle and a workspace, and caches the
// algorithm chosen for each shape. Pointers must be 16-byte aligned and sizes multiples of 8
// (checked, with the argument named).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "train/op_common.hpp"
#include "train/op_matmul.hpp"

namespace ringattn::train::cuda {

class Gemm {
 public:
  explicit Gemm(cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void forward(__nv_bfloat16* y, const __nv_bfloat16* x, const __nv_bfloat16* w,
               const cpu::MatmulShape& shape, Write write = Write::overwrite,
               const __nv_bfloat16* residual = nullptr);
  void backward_input(__nv_bfloat16* dx, const __nv_bfloat16* dy, const __nv_bfloat16* w,
                      const cpu::MatmulShape& shape, Write write = Write::overwrite);
  void backward_weight(float* dw, const __nv_bfloat16* dy, const __nv_bfloat16* x,
                       const cpu::MatmulShape& shape, Write write = Write::overwrite);

  cudaStream_t stream() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The cuBLASLt workspace for a value of RINGATTN_GEMM_WORKSPACE_MIB (null or empty: unset):
// 32 MiB when unset, else that many MiB (0 to 1024; 0 keeps cuBLASLt to algorithms that need
// none); another value throws, naming the variable and the value. Gemm reads the variable once.
std::size_t gemm_workspace_bytes(const char* mib);

}  // namespace ringattn::train::cuda
