// Definitions of the launchers of flash_launch.hpp, included by the per-instantiation .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "kernels/cuda/backward_row_splits.hpp"
#include "kernels/cuda/flash_backward.cuh"
#include "kernels/cuda/flash_backward_sm90.cuh"
#include "kernels/cuda/flash_backward_sm90_wide.cuh"
#include "kernels/cuda/flash_forward.cuh"
#include "kernels/cuda/flash_forward_sm90.cuh"
#include "kernels/cuda/flash_launch.hpp"
#include "kernels/cuda/tma_descriptor.hpp"
#include "src/cuda/cuda_check.hpp"

namespace ringattn::cuda_detail {

template <DType kDtype>
struct CudaType;
template <>
struct CudaType<DType::bf16> {
  using type = __nv_bfloat16;
};
template <>
struct CudaType<DType::f16> {
  using type = __half;
};

// Raises the kernel's dynamic shared memory limit (needed above 48 KiB) and launches it.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, int threads, int smem_bytes, cudaStream_t stream,
            const Args&... args) {
  RINGATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

// Calls launch_one(first, second) with both flags as std::bool_constant, so that the caller
// names one kernel instantiation per combination in a single expression.
template <typename LaunchOne>
void with_flags(bool first, bool second, LaunchOne&& launch_one) {
  if (first) {
    if (second) launch_one(std::true_type{}, std::true_type{});
    else launch_one(std::true_type{}, std::false_type{});
  } else {
    if (second) launch_one(std::false_type{}, std::true_type{});
    else launch_one(std::false_type{}, std::false_type{});
  }
}

// The current device's multiprocessors, asked of the runtime once a device.
inline int multiprocessor_count() {
  static std::atomic<int> known[64];
  int device = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < 64;
  int count = cached ? known[device].load(std::memory_order_relaxed) : 0;
  if (count == 0) {
    RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    if (cached) known[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// The pairs that a causal grid's group takes (causal_grid_place): the least power of two from
// which the group's work, spread over the multiprocessors, is at least half the longest block's
// (the group's last CTAs are then short ones), at most `pairs`. work(i): the work of a pair's
// i-th block in launch order (longest first), i < blocks.
// Under packed documents a block's work follows its place in its document, so the launch order
// is longest first only within each document, and the longest blocks of a late long document
// would start near the grid's end: there every pair goes in one group, so that each document's
// blocks start together for every pair, longest first. (bench/schedule_model.py, 32k tokens of
// log-normal documents of mean 2k and 8k, 16 pairs on 132 SMs, longest blocks early or late: a
// tail of 4-8% of the grid's time with the group of one pair, under 0.5% with all of them.)
template <typename Work>
int causal_schedule_group(const FlashParams& p, int blocks, std::int64_t pairs, Work&& work) {
  if (p.local && p.rule.has_documents()) return static_cast<int>(std::max<std::int64_t>(pairs, 1));
  std::int64_t total = 0, longest = 0;
  for (int i = 0; i < blocks; ++i) {
    const std::int64_t w = work(i);
    total += w;
    longest = std::max(longest, w);
  }
  if (total == 0) return 1;
  const double wanted = 0.5 * static_cast<double>(longest) * multiprocessor_count() /
                        static_cast<double>(total);
  std::int64_t group = 1;
  while (group < wanted && group < pairs) group *= 2;
  return static_cast<int>(std::min(group, pairs));
}

// The head dims of flash_backward_sm90_kernel (d_qk == d_v up to 128; 32 and 96 as zero-padded
// 64-column panels); the others (192, 256, 192/128: dK and dV of 64 keys would not fit in one
// warpgroup's registers) take flash_backward_sm90_wide_kernel.
template <int kHeadDim, int kValueDim>
inline constexpr bool kHopperBackwardHeadDims = kHeadDim == kValueDim && kHeadDim <= 128;

// The causal schedule group of a Hopper backward grid of key blocks of kKeys keys: block i of a
// pair is key block i, with the steps of its visible row tiles (kRows rows) and one for its keys.
template <int kKeys, int kRows>
int backward_causal_group(const FlashParams& p, int key_blocks) {
  const int row_tiles = (p.q_len + kRows - 1) / kRows;
  return causal_schedule_group(
      p, key_blocks, static_cast<std::int64_t>(p.kv_heads) * p.batch, [&](int i) {
        const std::int64_t first_row =
            std::clamp<std::int64_t>(std::int64_t{i} * kKeys - p.shift, 0, p.q_len);
        return (row_tiles - first_row / kRows) * std::int64_t{p.group} + 1;
      });
}

template <DType kDtype, int kHeadDim, int kValueDim>
void launch_forward_sm80(const FlashParams& p, bool combine, cudaStream_t stream) {
  using T = typename CudaType<kDtype>::type;
  using Tiles = ForwardTiles<kHeadDim, kValueDim>;
  const dim3 grid((p.q_len + Tiles::kRows - 1) / Tiles::kRows, p.q_heads, p.batch);
  with_flags(p.causal, combine, [&](auto causal, auto merge) {
    launch(flash_forward_kernel<T, kHeadDim, kValueDim, causal.value, merge.value>, grid,
           Tiles::kThreads, Tiles::kSmemBytes, stream, p);
  });
}

// The Hopper forward, where the driver can describe the views as tensor maps; false (nothing
// launched) where it cannot.
template <DType kDtype, int kHeadDim, int kValueDim>
bool launch_forward_hopper(const FlashParams& p, bool combine, cudaStream_t stream) {
  using T = typename CudaType<kDtype>::type;
  using HopperTiles = HopperForwardTiles<kHeadDim, kValueDim>;
  CUtensorMap q_map, k_map, v_map;
  if (make_row_tile_map(q_map, "q", p.q, p.q_strides, p.batch, p.q_len, p.q_heads, kHeadDim,
                        HopperTiles::kRows) &&
      make_row_tile_map(k_map, "k", p.k, p.k_strides, p.batch, p.k_len, p.kv_heads, kHeadDim,
                        HopperTiles::kKeys) &&
      make_row_tile_map(v_map, "v", p.v, p.v_strides, p.batch, p.k_len, p.kv_heads, kValueDim,
                        HopperTiles::kKeys)) {
    const int row_blocks = (p.q_len + HopperTiles::kRows - 1) / HopperTiles::kRows;
    const dim3 grid(row_blocks, p.q_heads, p.batch);
    FlashParams hp = p;
    if (p.causal) {
      // Block i of a pair is row block row_blocks - 1 - i: its key tiles, and one for its rows.
      hp.schedule_group = causal_schedule_group(
          p, row_blocks, static_cast<std::int64_t>(p.q_heads) * p.batch, [&](int i) {
            const std::int64_t last_row =
                std::min<std::int64_t>((row_blocks - i) * HopperTiles::kRows, p.q_len) - 1;
            const std::int64_t keys = std::clamp<std::int64_t>(last_row + p.shift + 1, 0, p.k_len);
            return (keys + HopperTiles::kKeys - 1) / HopperTiles::kKeys + 1;
          });
    }
    with_flags(p.causal, combine, [&](auto causal, auto merge) {
      launch(flash_forward_sm90_kernel<T, kHeadDim, kValueDim, causal.value, merge.value>, grid,
             HopperTiles::kThreads, HopperTiles::kSmemBytes, stream, hp, q_map, k_map, v_map);
    });
    return true;
  }
  return false;
}

template <DType kDtype, int kHeadDim, int kValueDim>
void launch_forward(const FlashParams& p, bool combine, bool hopper, cudaStream_t stream) {
  if (hopper && launch_forward_hopper<kDtype, kHeadDim, kValueDim>(p, combine, stream)) return;
  launch_forward_sm80<kDtype, kHeadDim, kValueDim>(p, combine, stream);
}

template <DType kDtype, int kHeadDim, int kValueDim>
void launch_backward_prepare(const FlashParams& p, cudaStream_t stream) {
  using T = typename CudaType<kDtype>::type;
  constexpr int kThreads = 256, kRowThreads = prepare_row_lanes(kHeadDim, kValueDim);
  const std::int64_t row_threads = static_cast<std::int64_t>(p.q_len) * kRowThreads;
  const dim3 grid(static_cast<unsigned>((row_threads + kThreads - 1) / kThreads),
                  static_cast<unsigned>(p.q_heads), static_cast<unsigned>(p.batch));
  flash_backward_prepare_kernel<T, kHeadDim, kValueDim><<<grid, kThreads, 0, stream>>>(p);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

// dK = dV = 0 (pairs of fp32, unit stride along head_dim, even strides): ahead of a call asked to
// overwrite them whose CTAs share keys and so can only add.
template <int kHeadDim>
__global__ void zero_key_gradients_kernel(const FlashParams p) {
  constexpr int pairs_per_row = kHeadDim / 2;
  const std::int64_t pairs =
      static_cast<std::int64_t>(p.batch) * p.k_len * p.kv_heads * pairs_per_row;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < pairs; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t column = 2 * (i % pairs_per_row), head_row = i / pairs_per_row;
    const std::int64_t head = head_row % p.kv_heads, token = head_row / p.kv_heads;
    const std::int64_t key = token % p.k_len, batch = token / p.k_len;
    *reinterpret_cast<float2*>(static_cast<float*>(p.dk) + batch * p.dk_strides[0] +
                               key * p.dk_strides[1] + head * p.dk_strides[2] + column) =
        make_float2(0.f, 0.f);
    *reinterpret_cast<float2*>(static_cast<float*>(p.dv) + batch * p.dv_strides[0] +
                               key * p.dv_strides[1] + head * p.dv_strides[2] + column) =
        make_float2(0.f, 0.f);
  }
}

// RINGATTN_DQ_ATOMIC=1 in the environment keeps the Hopper backward's dQ on atomics (to compare
// with the TMA reductions, or to rule them out).
inline bool dq_atomics_forced() {
  const char* value = std::getenv("RINGATTN_DQ_ATOMIC");
  return value != nullptr && std::string_view(value) == "1";
}

template <DType kDtype, int kHeadDim, int kValueDim>
void launch_backward_sm80(const FlashParams& p, bool deterministic, cudaStream_t stream) {
  using T = typename CudaType<kDtype>::type;
  using Tiles = BackwardTiles<kHeadDim, kValueDim>;
  const dim3 grid((p.k_len + Tiles::kKeys - 1) / Tiles::kKeys, p.kv_heads, p.batch);
  with_flags(p.causal, !deterministic, [&](auto causal, auto atomic_dq) {
    launch(flash_backward_kernel<T, kHeadDim, kValueDim, causal.value, atomic_dq.value>, grid,
           Tiles::kThreads, Tiles::kSmemBytes, stream, p);
  });
}

// The Hopper backward's main kernel, where the driver can describe the views as tensor maps;
// false (nothing launched) where it cannot.
template <DType kDtype, int kHeadDim>
bool launch_backward_hopper(const FlashParams& params, bool deterministic, cudaStream_t stream) {
  using T = typename CudaType<kDtype>::type;
  FlashParams p = params;
  using HopperTiles = HopperBackwardTiles<kHeadDim>;
  CUtensorMap k_map, v_map, q_map, do_map, dq_map{};
  const bool tma = make_row_tile_map(k_map, "k", p.k, p.k_strides, p.batch, p.k_len, p.kv_heads,
                                     kHeadDim, HopperTiles::kKeys) &&
                   make_row_tile_map(v_map, "v", p.v, p.v_strides, p.batch, p.k_len, p.kv_heads,
                                     kHeadDim, HopperTiles::kKeys) &&
                   make_row_tile_map(q_map, "q", p.q, p.q_strides, p.batch, p.q_len, p.q_heads,
                                     kHeadDim, HopperTiles::kRows) &&
                   make_row_tile_map(do_map, "dout", p.dout, p.dout_strides, p.batch, p.q_len,
                                     p.q_heads, kHeadDim, HopperTiles::kRows);
  // The default mode adds dQ by TMA reductions where the driver can describe dQ, else with
  // atomics; the deterministic one leaves it to flash_dq_kernel.
  const bool tma_dq = tma && !deterministic && !dq_atomics_forced() &&
                      make_fp32_row_tile_map(dq_map, p.dq, p.dq_strides, p.batch, p.q_len,
                                             p.q_heads, kHeadDim, HopperTiles::kRows);
  if (!tma) return false;
  auto main_kernel = [&](auto causal, auto atomic_dq) {
    const int key_blocks = (p.k_len + HopperTiles::kKeys - 1) / HopperTiles::kKeys;
    const int row_tiles = (p.q_len + HopperTiles::kRows - 1) / HopperTiles::kRows;
    const dim3 grid(key_blocks, p.kv_heads, p.batch);
    if (causal.value) {
      p.schedule_group = backward_causal_group<HopperTiles::kKeys, HopperTiles::kRows>(p, key_blocks);
    }
    if constexpr (atomic_dq.value) {
      if (!causal.value && tma_dq) {
        // Rounded key gradients are written once, by the CTA that owns the keys: no splits.
        p.row_splits = p.round_key_gradients ? 1 : backward_row_splits(
            static_cast<std::int64_t>(key_blocks) * p.kv_heads * p.batch,
            static_cast<std::int64_t>(row_tiles) * p.group, multiprocessor_count(),
            65535 / p.batch);
        // The row-split instantiation also takes long rows unsplit: at 2048-4096 row tiles it
        // ran 8-9% faster than the plain one on an H200 (45.6 against 49.6 ms per 32k x 32k
        // at 16 heads), at 512 row tiles 1.4%.
        if (p.row_splits > 1 || row_tiles >= 512) {
          if (p.overwrite_key_gradients && p.row_splits > 1) {  // the splits add: zero first
            zero_key_gradients_kernel<kHeadDim><<<4 * multiprocessor_count(), 256, 0, stream>>>(p);
            RINGATTN_CUDA_CHECK_LAUNCH();
            p.overwrite_key_gradients = false;
          }
          launch(flash_backward_sm90_kernel<T, kHeadDim, false, true, true, true>,
                 dim3(key_blocks, p.kv_heads, p.batch * p.row_splits), HopperTiles::kThreads,
                 HopperBackwardTiles<kHeadDim, true>::kSmemBytes, stream, p, k_map, v_map,
                 q_map, do_map, dq_map);
          return;
        }
      }
      if (tma_dq) {
        launch(flash_backward_sm90_kernel<T, kHeadDim, causal.value, true, true>, grid,
               HopperTiles::kThreads, HopperBackwardTiles<kHeadDim, true>::kSmemBytes, stream,
               p, k_map, v_map, q_map, do_map, dq_map);
        return;
      }
    }
    launch(flash_backward_sm90_kernel<T, kHeadDim, causal.value, atomic_dq.value, false>, grid,
           HopperTiles::kThreads, HopperTiles::kSmemBytes, stream, p, k_map, v_map, q_map,
           do_map, dq_map);
  };
  with_flags(p.causal, !deterministic, main_kernel);
  return true;
}

// flash_backward_sm90_wide_kernel (head dims 192, 256, 192/128), where the driver can describe
// the views as tensor maps; false (nothing launched) where it cannot.
template <DType kDtype, int kHeadDim, int kValueDim>
bool launch_backward_hopper_wide(const FlashParams& params, bool deterministic,
                                 cudaStream_t stream) {
  using T = typename CudaType<kDtype>::type;
  using Tiles = HopperWideBackwardTiles<kHeadDim, kValueDim>;
  using TmaTiles = HopperWideBackwardTiles<kHeadDim, kValueDim, true>;
  FlashParams p = params;
  CUtensorMap k_map, v_map, q_map, do_map, dq_map{};
  const bool tma = make_row_tile_map(k_map, "k", p.k, p.k_strides, p.batch, p.k_len, p.kv_heads,
                                     kHeadDim, Tiles::kKeys) &&
                   make_row_tile_map(v_map, "v", p.v, p.v_strides, p.batch, p.k_len, p.kv_heads,
                                     kValueDim, Tiles::kKeys) &&
                   make_row_tile_map(q_map, "q", p.q, p.q_strides, p.batch, p.q_len, p.q_heads,
                                     kHeadDim, Tiles::kRows) &&
                   make_row_tile_map(do_map, "dout", p.dout, p.dout_strides, p.batch, p.q_len,
                                     p.q_heads, kValueDim, Tiles::kRows);
  if (!tma) return false;
  // TMA reductions for dQ where a step's fp32 block fits beside the tiles (not at 256).
  const bool tma_dq = TmaTiles::kFits && !deterministic && !dq_atomics_forced() &&
                      make_fp32_row_tile_map(dq_map, p.dq, p.dq_strides, p.batch, p.q_len,
                                             p.q_heads, kHeadDim, Tiles::kRows);
  const int key_blocks = (p.k_len + Tiles::kKeys - 1) / Tiles::kKeys;
  if (p.causal) p.schedule_group = backward_causal_group<Tiles::kKeys, Tiles::kRows>(p, key_blocks);
  const dim3 grid(key_blocks, p.kv_heads, p.batch);
  with_flags(p.causal, !deterministic, [&](auto causal, auto atomic_dq) {
    if constexpr (atomic_dq.value && TmaTiles::kFits) {
      if (tma_dq) {
        launch(flash_backward_sm90_wide_kernel<T, kHeadDim, kValueDim, causal.value, true, true>,
               grid, Tiles::kThreads, TmaTiles::kSmemBytes, stream, p, k_map, v_map, q_map,
               do_map, dq_map);
        return;
      }
    }
    launch(flash_backward_sm90_wide_kernel<T, kHeadDim, kValueDim, causal.value, atomic_dq.value,
                                           false>,
           grid, Tiles::kThreads, Tiles::kSmemBytes, stream, p, k_map, v_map, q_map, do_map,
           dq_map);
  });
  return true;
}

template <DType kDtype, int kHeadDim, int kValueDim>
void launch_backward(const FlashParams& p, bool deterministic, bool hopper, cudaStream_t stream) {
  using T = typename CudaType<kDtype>::type;
  bool launched = false;
  if constexpr (kHopperBackwardHeadDims<kHeadDim, kValueDim>) {
    launched = hopper && launch_backward_hopper<kDtype, kHeadDim>(p, deterministic, stream);
  } else {
    launched =
        hopper && launch_backward_hopper_wide<kDtype, kHeadDim, kValueDim>(p, deterministic, stream);
  }
  if (!launched) launch_backward_sm80<kDtype, kHeadDim, kValueDim>(p, deterministic, stream);
  if (deterministic) {
    using Dq = DqTiles<kHeadDim, kValueDim>;
    const dim3 dq_grid((p.q_len + Dq::kRows - 1) / Dq::kRows, p.q_heads, p.batch);
    if (p.causal) {
      launch(flash_dq_kernel<T, kHeadDim, kValueDim, true>, dq_grid, Dq::kThreads, Dq::kSmemBytes,
             stream, p);
    } else {
      launch(flash_dq_kernel<T, kHeadDim, kValueDim, false>, dq_grid, Dq::kThreads,
             Dq::kSmemBytes, stream, p);
    }
  }
}

}  // namespace ringattn::cuda_detail

// One line per instantiation file: RINGATTN_INSTANTIATE_FLASH(ringattn::DType::bf16, 128) for
// d_v == d_qk, RINGATTN_INSTANTIATE_FLASH_VALUE_DIM(ringattn::DType::bf16, 192, 128) for a V of
// its own width.
#define RINGATTN_INSTANTIATE_FLASH_VALUE_DIM(dtype, head_dim, value_dim)                     \
  template void ringattn::cuda_detail::launch_forward<dtype, head_dim, value_dim>(           \
      const ::ringattn::cuda_detail::FlashParams&, bool, bool, cudaStream_t);                \
  template void ringattn::cuda_detail::launch_backward_prepare<dtype, head_dim, value_dim>(  \
      const ::ringattn::cuda_detail::FlashParams&, cudaStream_t);                            \
  template void ringattn::cuda_detail::launch_backward<dtype, head_dim, value_dim>(          \
      const ::ringattn::cuda_detail::FlashParams&, bool, bool, cudaStream_t)
#define RINGATTN_INSTANTIATE_FLASH(dtype, head_dim) \
  RINGATTN_INSTANTIATE_FLASH_VALUE_DIM(dtype, head_dim, head_dim)
