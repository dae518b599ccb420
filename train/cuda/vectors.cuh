// Vector access for the trainer's CUDA kernels: V consecutive bf16 or fp32 values as fp32 in one
// access (of 2V or 4V bytes; the pointer aligned to it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "train/cuda/ops.hpp"

namespace ringattn::train::cuda::vectors {

__device__ __forceinline__ float bf16_bits_to_float(unsigned bits16) {
  return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ unsigned float_to_bf16_bits(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

// V consecutive bf16 as fp32 (exact), in one access of 2V bytes; p is 2V-byte aligned.
template <int V>
__device__ __forceinline__ void load_bf16(const bf16* p, float (&v)[V]) {
  static_assert(V == 1 || V == 2 || V == 4 || V == 8, "V is 1, 2, 4 or 8");
  if constexpr (V == 1) {
    v[0] = __bfloat162float(*p);
  } else {
    unsigned words[V / 2];
    if constexpr (V == 2) {
      words[0] = *reinterpret_cast<const unsigned*>(p);
    } else if constexpr (V == 4) {
      const uint2 raw = *reinterpret_cast<const uint2*>(p);
      words[0] = raw.x;
      words[1] = raw.y;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      words[0] = raw.x;
      words[1] = raw.y;
      words[2] = raw.z;
      words[3] = raw.w;
    }
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      v[2 * k] = bf16_bits_to_float(words[k] & 0xffffu);
      v[2 * k + 1] = bf16_bits_to_float(words[k] >> 16);
    }
  }
}

// V fp32 values rounded to bf16 (nearest even), stored in one access of 2V bytes.
template <int V>
__device__ __forceinline__ void store_bf16(bf16* p, const float (&v)[V]) {
  static_assert(V == 1 || V == 2 || V == 4 || V == 8, "V is 1, 2, 4 or 8");
  if constexpr (V == 1) {
    *p = __float2bfloat16_rn(v[0]);
  } else {
    unsigned words[V / 2];
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      words[k] = float_to_bf16_bits(v[2 * k]) | (float_to_bf16_bits(v[2 * k + 1]) << 16);
    }
    if constexpr (V == 2) {
      *reinterpret_cast<unsigned*>(p) = words[0];
    } else if constexpr (V == 4) {
      *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

// V consecutive floats; V a multiple of 4 loads float4s (p 16-byte aligned), else scalars.
template <int V>
__device__ __forceinline__ void load_f32(const float* p, float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      const float4 raw = *reinterpret_cast<const float4*>(p + k);
      v[k] = raw.x;
      v[k + 1] = raw.y;
      v[k + 2] = raw.z;
      v[k + 3] = raw.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = p[k];
  }
}

template <int V>
__device__ __forceinline__ void store_f32(float* p, const float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      *reinterpret_cast<float4*>(p + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = v[k];
  }
}

}  // namespace ringattn::train::cuda::vectors
