// The model's matrix products on the GPU through cuBLASLt: bf16 operands, fp32 accumulation, in
// the CPU twin's conventions (train/op_matmul.hpp): X [rows, in], W [out, in], Y [rows, out], all
// row-major.
//
//   forward          Y  (+)= X W^T      bf16 out (Write::add: the residual stream, Y = Y + X W^T,
//                                       or Y = R + X W^T with a residual R)
//   backward_input   dX (+)= dY W       bf16 out
//   backward_weight  dW (+)= dY^T X     fp32 out (Write::add accumulates over micro-batches)
//
// Write::add: into the fp32 output as cuBLASLt's C (beta = 1); into a bf16 output the product is
// formed in fp32 and added with one rounding (cuBLASLt's bf16 epilogue would round the product
// first).
// One Gemm per stream: it owns a cuBLASLt handle and a workspace, and caches the
// algorithm chosen for each shape. Pointers must be 16-byte aligned and sizes multiples of 8
// (checked, with the argument named).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

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

}  // namespace ringattn::train::cuda
