// Hopper's warpgroup MMA (wgmma, sm_90a) as inline PTX: shared-memory matrix descriptors for tiles
// in the 128-byte swizzle, the fence / commit / wait protocol, and the two instruction forms the
// local block uses. A warpgroup is 4 consecutive warps; each wgmma multiplies a 64-row A (warp w
// of the group owns rows 16w..16w+15) by a 16 x N B tile into fp32 accumulators laid out per warp
// exactly as mma.sync m16n8's: d[j] covers columns 8j..8j+7, d[j][0..1] row g, d[j][2..3] row g+8
// (g = lane / 4), columns 2 * (lane % 4) + {0, 1}. A in registers has mma.sync m16n8k16's A layout.
//
// Shared-memory tiles (PanelSwizzle below): a [rows, head_dim] tile of 16-bit values is stored
// as head_dim / 64 panels of [rows, 64]; each 128-byte panel row r keeps its 16-byte chunk c at
// chunk c ^ (r % 8). Relative to a 1024-byte aligned base this is the 128-byte swizzle wgmma
// reads, for operands whose contiguous dimension is K (K-major: Q and K in Q K^T) and for those
// whose contiguous dimension is N (MN-major: V in P V) alike.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/mma_ptx.cuh"

namespace ringattn::cuda_detail {

// Element offset of (row, col) in a panel-swizzled [kRows, kHeadDim] tile (a Layout for
// load_tile_async).
template <int kRows, int kHeadDim>
struct PanelSwizzle {
  static_assert(kHeadDim % 64 == 0, "panels are 64 columns wide");
  __device__ __forceinline__ int operator()(int row, int col) const {
    return (col / 64) * (kRows * 64) + row * 64 + ((((col % 64) / 8) ^ (row % 8)) * 8) + (col % 8);
  }
};

// A matrix descriptor in the 128-byte swizzle mode. Offsets are in bytes; K-major operands use
// only `stride` (between 8-row groups: 1024), MN-major ones also `leading` (between 64-column
// panels).
__device__ __forceinline__ std::uint64_t wgmma_descriptor(const void* smem, std::uint32_t leading,
                                                          std::uint32_t stride) {
  const std::uint64_t address = smem_address(smem);
  return ((address & 0x3FFFF) >> 4) | (static_cast<std::uint64_t>((leading & 0x3FFFF) >> 4) << 16) |
         (static_cast<std::uint64_t>((stride & 0x3FFFF) >> 4) << 32) | (std::uint64_t{1} << 62);
}

constexpr std::uint32_t kPanelRowBytes = 128;      // one row of a 64-column panel
constexpr std::uint32_t kSwizzleAtomBytes = 1024;  // 8 panel rows: the swizzle's period

// A panel-swizzled operand whose contiguous dimension is K (the descriptor's leading offset is
// unused there), starting at `tile`.
__device__ __forceinline__ std::uint64_t k_major_descriptor(const void* tile) {
  return wgmma_descriptor(tile, 16, kSwizzleAtomBytes);
}
// A panel-swizzled operand whose contiguous dimension is M or N, with `panel_rows` rows per
// 64-column panel (the panels' distance), starting at `tile`.
__device__ __forceinline__ std::uint64_t mn_major_descriptor(const void* tile, int panel_rows) {
  return wgmma_descriptor(tile, panel_rows * kPanelRowBytes, kSwizzleAtomBytes);
}

// The descriptor of the operand `bytes` (a multiple of 16) further into shared memory than
// `descriptor`'s: its start-address field (bits 0-13, the address / 16) plus bytes / 16, the other
// fields unchanged. Exact while the address stays within the field's 256 KiB, as every address
// of a CTA's shared memory does. A loop of MMAs builds its descriptors once and steps them so,
// with constant offsets, instead of encoding each address again.
__device__ __forceinline__ std::uint64_t descriptor_plus(std::uint64_t descriptor,
                                                         std::uint32_t bytes) {
  // A 32-bit add of the low word: the field cannot carry into the high one.
  const std::uint32_t low = static_cast<std::uint32_t>(descriptor) + (bytes >> 4);
  return (descriptor & 0xFFFFFFFF00000000ull) | low;
}

// `descriptor` as a value the compiler knows to be the same across the warp (a broadcast from lane
// 0; every lane must hold the same): wgmma takes its descriptors in uniform registers, and one
// computed from the thread index (a warpgroup's own rows) would otherwise be moved there again
// for every instruction.
__device__ __forceinline__ std::uint64_t uniform_descriptor(std::uint64_t descriptor) {
  const auto low = static_cast<std::uint32_t>(descriptor);
  const auto high = static_cast<std::uint32_t>(descriptor >> 32);
  return (static_cast<std::uint64_t>(__shfl_sync(0xffffffffu, high, 0)) << 32) |
         __shfl_sync(0xffffffffu, low, 0);
}

// Orders this thread's earlier register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async included) visible to the
// async proxy that wgmma reads through; a barrier must follow before another thread's wgmma.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// D (64 x N) = A (64 x 16, K-major in shared memory) * B (16 x N, K-major in shared memory)
// + (accumulate ? D : 0).
template <int kN, typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 8][4], std::uint64_t a, std::uint64_t b,
                                         int accumulate);
// D (64 x N) = A (64 x 16, registers) * B (16 x N, MN-major in shared memory) + (accumulate ? D : 0).
template <int kN, typename T>
__device__ __forceinline__ void wgmma_rs_mn(float (&d)[kN / 8][4], const std::uint32_t (&a)[4],
                                            std::uint64_t b, int accumulate);

// D (64 x N) = A (64 x 16, M-major in shared memory) * B (16 x N, MN-major in shared memory)
// + (accumulate ? D : 0).
template <int kN, typename T>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[kN / 8][4], std::uint64_t a,
                                            std::uint64_t b, int accumulate);

// D (64 x kN) = A B^T, contracted over kHeadDim columns: A is 64 rows of a panel-swizzled tile
// whose panels hold kAPanelRows rows (starting at row `a_rows`), B the kN rows of one whose panels
// hold kBPanelRows (starting at `b_rows`); both K-major. k-step `step` reads columns
// [16 step, 16 step + 16), 32 bytes into its panel. The caller fences and commits.
// The same from the descriptors of A's and B's first rows (k_major_descriptor).
template <int kN, int kHeadDim, int kAPanelRows, int kBPanelRows, typename T>
__device__ __forceinline__ void wgmma_rows_times_rows(float (&d)[kN / 8][4], std::uint64_t a0,
                                                      std::uint64_t b0) {
#pragma unroll
  for (int step = 0; step < kHeadDim / 16; ++step) {
    const int panel = step / 4, offset = (step % 4) * 16;
    const std::uint64_t a = descriptor_plus(a0, (panel * kAPanelRows * 64 + offset) * sizeof(T));
    const std::uint64_t b = descriptor_plus(b0, (panel * kBPanelRows * 64 + offset) * sizeof(T));
    wgmma_ss<kN, T>(d, a, b, step > 0 ? 1 : 0);
  }
}
template <int kN, int kHeadDim, int kAPanelRows, int kBPanelRows, typename T>
__device__ __forceinline__ void wgmma_rows_times_rows(float (&d)[kN / 8][4], const T* a_rows,
                                                      const T* b_rows) {
  wgmma_rows_times_rows<kN, kHeadDim, kAPanelRows, kBPanelRows, T>(d, k_major_descriptor(a_rows),
                                                                   k_major_descriptor(b_rows));
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// One definition per (form, N), instantiated for both 16-bit types.
// The fp32 accumulators of an m64nN tile (N / 2 a thread: d[0..N/8)[0..3]) as asm operands, and
// their names %0 .. %(N/2 - 1), built from groups of 16 (4 n-tiles of 8 columns).
#define RINGATTN_WGMMA_ACC(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define RINGATTN_WGMMA_ACC4(j) \
  RINGATTN_WGMMA_ACC(j), RINGATTN_WGMMA_ACC(j + 1), RINGATTN_WGMMA_ACC(j + 2), \
  RINGATTN_WGMMA_ACC(j + 3)
#define RINGATTN_WGMMA_NAMES0 \
  "%0, %1, %2, %3, %4, %5, %6, %7, " \
  "%8, %9, %10, %11, %12, %13, %14, %15"
#define RINGATTN_WGMMA_NAMES1 \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define RINGATTN_WGMMA_NAMES2 \
  "%32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47"
#define RINGATTN_WGMMA_NAMES3 \
  "%48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define RINGATTN_WGMMA_NAMES4 \
  "%64, %65, %66, %67, %68, %69, %70, %71, " \
  "%72, %73, %74, %75, %76, %77, %78, %79"
#define RINGATTN_WGMMA_NAMES5 \
  "%80, %81, %82, %83, %84, %85, %86, %87, " \
  "%88, %89, %90, %91, %92, %93, %94, %95"
#define RINGATTN_WGMMA_NAMES6 \
  "%96, %97, %98, %99, %100, %101, %102, %103, " \
  "%104, %105, %106, %107, %108, %109, %110, %111"
#define RINGATTN_WGMMA_NAMES7 \
  "%112, %113, %114, %115, %116, %117, %118, %119, " \
  "%120, %121, %122, %123, %124, %125, %126, %127"
#define RINGATTN_WGMMA_D32_NAMES RINGATTN_WGMMA_NAMES0
#define RINGATTN_WGMMA_D32_OPERANDS RINGATTN_WGMMA_ACC4(0)
#define RINGATTN_WGMMA_D64_NAMES RINGATTN_WGMMA_D32_NAMES ", " RINGATTN_WGMMA_NAMES1
#define RINGATTN_WGMMA_D64_OPERANDS RINGATTN_WGMMA_D32_OPERANDS, RINGATTN_WGMMA_ACC4(4)
#define RINGATTN_WGMMA_D128_NAMES \
  RINGATTN_WGMMA_D64_NAMES ", " RINGATTN_WGMMA_NAMES2 ", " RINGATTN_WGMMA_NAMES3
#define RINGATTN_WGMMA_D128_OPERANDS \
  RINGATTN_WGMMA_D64_OPERANDS, RINGATTN_WGMMA_ACC4(8), RINGATTN_WGMMA_ACC4(12)
#define RINGATTN_WGMMA_D192_NAMES \
  RINGATTN_WGMMA_D128_NAMES ", " RINGATTN_WGMMA_NAMES4 ", " RINGATTN_WGMMA_NAMES5
#define RINGATTN_WGMMA_D192_OPERANDS \
  RINGATTN_WGMMA_D128_OPERANDS, RINGATTN_WGMMA_ACC4(16), RINGATTN_WGMMA_ACC4(20)
#define RINGATTN_WGMMA_D256_NAMES \
  RINGATTN_WGMMA_D192_NAMES ", " RINGATTN_WGMMA_NAMES6 ", " RINGATTN_WGMMA_NAMES7
#define RINGATTN_WGMMA_D256_OPERANDS \
  RINGATTN_WGMMA_D192_OPERANDS, RINGATTN_WGMMA_ACC4(24), RINGATTN_WGMMA_ACC4(28)

// One specialization of FUNC<N, T> with both operands in shared memory (a, b descriptors) or with
// A from registers (a[4]); the operands' indices follow the 4 N / 8 accumulators' (A_B_P: those
// of a, b and the accumulate predicate), and TRANS is the transpose flags' tail of the instruction.
#define RINGATTN_WGMMA_SS(FUNC, N, T, TYPE, NAMES, OPERANDS, A, B, P, TRANS)                     \
  template <>                                                                                     \
  __device__ __forceinline__ void FUNC<N, T>(float (&d)[N / 8][4], std::uint64_t a,              \
                                             std::uint64_t b, int accumulate) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {"               \
                 NAMES "}, %" A ", %" B ", p, 1, 1, " TRANS ";\n}\n"                                 \
                 : OPERANDS                                                                        \
                 : "l"(a), "l"(b), "r"(accumulate));                                              \
  }
#define RINGATTN_WGMMA_RS(FUNC, N, T, TYPE, NAMES, OPERANDS, A, B, P, TRANS)                     \
  template <>                                                                                     \
  __device__ __forceinline__ void FUNC<N, T>(float (&d)[N / 8][4], const std::uint32_t (&a)[4],  \
                                             std::uint64_t b, int accumulate) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {"               \
                 NAMES "}, {" A "}, %" B ", p, 1, 1, " TRANS ";\n}\n"                                \
                 : OPERANDS                                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));          \
  }
// Every product the kernels use, for one 16-bit type.
#define RINGATTN_WGMMA_ALL(T, TYPE)                                                               \
  RINGATTN_WGMMA_SS(wgmma_ss, 64, T, TYPE, RINGATTN_WGMMA_D64_NAMES, RINGATTN_WGMMA_D64_OPERANDS, \
                    "32", "33", "34", "0, 0")                                                     \
  RINGATTN_WGMMA_SS(wgmma_ss, 128, T, TYPE, RINGATTN_WGMMA_D128_NAMES,                            \
                    RINGATTN_WGMMA_D128_OPERANDS, "64", "65", "66", "0, 0")                       \
  RINGATTN_WGMMA_SS(wgmma_ss_mn, 32, T, TYPE, RINGATTN_WGMMA_D32_NAMES,                           \
                    RINGATTN_WGMMA_D32_OPERANDS, "16", "17", "18", "1, 1")                        \
  RINGATTN_WGMMA_SS(wgmma_ss_mn, 64, T, TYPE, RINGATTN_WGMMA_D64_NAMES,                           \
                    RINGATTN_WGMMA_D64_OPERANDS, "32", "33", "34", "1, 1")                        \
  RINGATTN_WGMMA_RS(wgmma_rs_mn, 64, T, TYPE, RINGATTN_WGMMA_D64_NAMES,                           \
                    RINGATTN_WGMMA_D64_OPERANDS, "%32, %33, %34, %35", "36", "37", "1")           \
  RINGATTN_WGMMA_RS(wgmma_rs_mn, 128, T, TYPE, RINGATTN_WGMMA_D128_NAMES,                         \
                    RINGATTN_WGMMA_D128_OPERANDS, "%64, %65, %66, %67", "68", "69", "1")          \
  RINGATTN_WGMMA_RS(wgmma_rs_mn, 192, T, TYPE, RINGATTN_WGMMA_D192_NAMES,                         \
                    RINGATTN_WGMMA_D192_OPERANDS, "%96, %97, %98, %99", "100", "101", "1")        \
  RINGATTN_WGMMA_RS(wgmma_rs_mn, 256, T, TYPE, RINGATTN_WGMMA_D256_NAMES,                         \
                    RINGATTN_WGMMA_D256_OPERANDS, "%128, %129, %130, %131", "132", "133", "1")

RINGATTN_WGMMA_ALL(__nv_bfloat16, "bf16")
RINGATTN_WGMMA_ALL(__half, "f16")

#undef RINGATTN_WGMMA_ACC
#undef RINGATTN_WGMMA_ACC4
#undef RINGATTN_WGMMA_NAMES0
#undef RINGATTN_WGMMA_NAMES1
#undef RINGATTN_WGMMA_NAMES2
#undef RINGATTN_WGMMA_NAMES3
#undef RINGATTN_WGMMA_NAMES4
#undef RINGATTN_WGMMA_NAMES5
#undef RINGATTN_WGMMA_NAMES6
#undef RINGATTN_WGMMA_NAMES7
#undef RINGATTN_WGMMA_D32_NAMES
#undef RINGATTN_WGMMA_D32_OPERANDS
#undef RINGATTN_WGMMA_D64_NAMES
#undef RINGATTN_WGMMA_D64_OPERANDS
#undef RINGATTN_WGMMA_D128_NAMES
#undef RINGATTN_WGMMA_D128_OPERANDS
#undef RINGATTN_WGMMA_D192_NAMES
#undef RINGATTN_WGMMA_D192_OPERANDS
#undef RINGATTN_WGMMA_D256_NAMES
#undef RINGATTN_WGMMA_D256_OPERANDS
#undef RINGATTN_WGMMA_SS
#undef RINGATTN_WGMMA_RS
#undef RINGATTN_WGMMA_ALL
#endif  // sm_90a

}  // namespace ringattn::cuda_detail
