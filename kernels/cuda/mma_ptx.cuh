// The tensor-core and copy instructions of the local block (sm_80 and later), as inline PTX:
// cp.async for global -> shared copies that bypass registers, ldmatrix for fragment loads and
// mma.sync m16n8k16 with fp32 accumulation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>

namespace ringattn::cuda_detail {

__device__ __forceinline__ std::uint32_t smem_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// One 8-byte store of two floats to shared memory, as one instruction whatever registers hold them.
__device__ __forceinline__ void store_shared_pair(float* smem, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(smem_address(smem)), "f"(x), "f"(y)
               : "memory");
}

// 16-byte copy; with valid == false the destination is zero-filled and global memory untouched.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

// D = A * B + D for a 16x8x16 tile: A 16x16 (4 regs), B 16x8 (2 regs), D 16x8 fp32 (4 regs).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const std::uint32_t (&a)[4],
                                                         std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const std::uint32_t (&a)[4],
                                                  std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats packed into one register of two 16-bit values (low half = first).
template <typename T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}

// The two values of a pack2 register as floats (exact).
template <typename T>
__device__ __forceinline__ float2 unpack2(std::uint32_t packed);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(std::uint32_t packed) {
  return make_float2(__uint_as_float(packed << 16), __uint_as_float(packed & 0xFFFF0000u));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(std::uint32_t packed) {
  return __half22float2(*reinterpret_cast<const __half2*>(&packed));
}

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) {
  return __bfloat162float(value);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half value) {
  return __half2float(value);
}

constexpr float kInfinity = std::numeric_limits<float>::infinity();

// min(max(value, lo), hi) in 64-bit, narrowed to int (the bounds are ints).
__device__ __forceinline__ int clamp_to(std::int64_t value, int lo, int hi) {
  return static_cast<int>(value < lo ? lo : (value > hi ? hi : value));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace ringattn::cuda_detail
