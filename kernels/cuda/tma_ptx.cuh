// Hopper's asynchronous copies (TMA, sm_90) and the barriers that order them, as inline PTX.
//
// A tensor map (CUtensorMap, made on the host by tma_descriptor.hpp) describes a strided
// [batch, heads, len, head_dim] view; one cp.async.bulk.tensor copies a box of it into shared
// memory and reports the bytes to an mbarrier. Rows past the view's end arrive as zeros.
//
// mbarrier protocol: a "full" barrier per buffer counts one arrival (the producer's, which also
// announces the bytes to expect) plus the copied bytes; an "empty" barrier counts one arrival per
// consumer warp that has finished reading the buffer. Waiting on parity P returns once the phase
// with that parity has completed; the phase before the first counts as completed, so the
// producer's first wait on an empty barrier (parity 1) passes at once.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/cuda/mma_ptx.cuh"

namespace ringattn::cuda_detail {

__device__ __forceinline__ void mbarrier_init(std::uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(barrier)),
               "r"(arrivals)
               : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA); a CTA barrier follows.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(barrier))
               : "memory");
}

// The producer's arrival: the current phase also waits for `bytes` of asynchronous copies.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(std::uint64_t* barrier, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   smem_address(barrier)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_wait(std::uint64_t* barrier, int parity) {
  const std::uint32_t address = smem_address(barrier);
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
}

// Copies the box at element coordinates (col, row, head, batch) of `map` into `destination`
// (1024-byte aligned for the 128-byte swizzle) and reports its bytes to `barrier`.
__device__ __forceinline__ void tma_load_box(void* destination, const CUtensorMap* map, int col,
                                             int row, int head, int batch,
                                             std::uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_address(destination)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(batch),
      "r"(smem_address(barrier))
      : "memory");
}

// Adds the box at `source` (1024-byte aligned for the 128-byte swizzle) into the box at element
// coordinates (col, row, head, batch) of `map` in global memory, element-wise in the map's type;
// elements outside the tensor are dropped. The writes to `source` must be made visible to the
// async proxy first (fence_proxy_async_shared by every writer, then a barrier). Asynchronous:
// bulk_commit_group closes a group of these, bulk_wait_group_read waits until at most kPending
// groups still read their shared memory, bulk_wait_group until at most kPending are unfinished.
__device__ __forceinline__ void tma_reduce_add_box(const CUtensorMap* map, const void* source,
                                                   int col, int row, int head, int batch) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(reinterpret_cast<std::uint64_t>(map)),
      "r"(col), "r"(row), "r"(head), "r"(batch), "r"(smem_address(source))
      : "memory");
}
__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// bulk_wait_group_read with a count known only once a loop is unrolled, 0 to 5 (a larger count
// waits as for 5: longer than needed, never shorter). The dQ warpgroup's reductions at head dim
// 192 leave up to 4 groups pending.
__device__ __forceinline__ void bulk_wait_group_read_at_most(int pending) {
  switch (pending) {
    case 0: bulk_wait_group_read<0>(); break;
    case 1: bulk_wait_group_read<1>(); break;
    case 2: bulk_wait_group_read<2>(); break;
    case 3: bulk_wait_group_read<3>(); break;
    case 4: bulk_wait_group_read<4>(); break;
    default: bulk_wait_group_read<5>(); break;
  }
}

// Named barriers among a subset of the CTA's warps (id 0 is __syncthreads'): `arrive` signals
// without waiting, `sync` waits until `threads` threads have arrived or synced.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Moves registers between warpgroups: every warp of the warpgroup executes it. A producer
// warpgroup gives most of its registers back so that the consumers can hold more.
template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Keeps the compiler from moving reads or writes of wgmma accumulators across the wait that
// completes them (the asm statements that issue a wgmma do not say when it writes).
template <int kTiles>
__device__ __forceinline__ void pin_registers(float (&d)[kTiles][4]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[t][e])::"memory");
  }
}

}  // namespace ringattn::cuda_detail
