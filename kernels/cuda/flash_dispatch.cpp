// Host side of the CUDA flash block: every check that can be made before a launch, then one
// dispatch table over (dtype, head_dim, v_head_dim). Causal, combine, deterministic and the kernel
// family (sm_80 or Hopper, use_hopper_family) are picked inside the launchers.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>
#include <string_view>

#include "kernels/block_checks.hpp"
#include "kernels/cuda/flash_launch.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "ringattn/error.hpp"
#include "src/attention_checks.hpp"
#include "src/cuda/cuda_check.hpp"

namespace ringattn::cuda {
namespace {

using cuda_detail::FlashParams;

struct KernelSet {
  DType dtype;
  int head_dim;    // of Q and K
  int v_head_dim;  // of V and O
  void (*forward)(const FlashParams&, bool, bool, cudaStream_t);
  void (*prepare)(const FlashParams&, cudaStream_t);
  void (*backward)(const FlashParams&, bool, bool, cudaStream_t);
};

template <DType kDtype, int kHeadDim, int kValueDim = kHeadDim>
constexpr KernelSet kernel_set() {
  return {kDtype, kHeadDim, kValueDim, &cuda_detail::launch_forward<kDtype, kHeadDim, kValueDim>,
          &cuda_detail::launch_backward_prepare<kDtype, kHeadDim, kValueDim>,
          &cuda_detail::launch_backward<kDtype, kHeadDim, kValueDim>};
}

// The head dims of this build (RINGATTN_CUDA_HEAD_DIM_<d> in ringattn/config.h): a set for one
// left out would name kernels that no file instantiated. The pairs of a V of its own width
// (detail::kCudaBlockValueDimPairs) come with their head_dim.
#define RINGATTN_KERNEL_SETS(head_dim) \
  kernel_set<DType::bf16, head_dim>(), kernel_set<DType::f16, head_dim>(),
#define RINGATTN_VALUE_DIM_KERNEL_SETS(head_dim, value_dim) \
  kernel_set<DType::bf16, head_dim, value_dim>(), kernel_set<DType::f16, head_dim, value_dim>(),
constexpr KernelSet kKernels[] = {
#if RINGATTN_CUDA_HEAD_DIM_32
    RINGATTN_KERNEL_SETS(32)
#endif
#if RINGATTN_CUDA_HEAD_DIM_64
    RINGATTN_KERNEL_SETS(64)
#endif
#if RINGATTN_CUDA_HEAD_DIM_96
    RINGATTN_KERNEL_SETS(96)
#endif
#if RINGATTN_CUDA_HEAD_DIM_128
    RINGATTN_KERNEL_SETS(128)
#endif
#if RINGATTN_CUDA_HEAD_DIM_192
    RINGATTN_KERNEL_SETS(192)
    RINGATTN_VALUE_DIM_KERNEL_SETS(192, 128)
#endif
#if RINGATTN_CUDA_HEAD_DIM_256
    RINGATTN_KERNEL_SETS(256)
#endif
};
#undef RINGATTN_VALUE_DIM_KERNEL_SETS
#undef RINGATTN_KERNEL_SETS

// The sets of kKernels for dtype, head_dim and v_head_dim.
constexpr int count_sets(DType dtype, std::int64_t head_dim, std::int64_t v_head_dim) {
  int sets = 0;
  for (const KernelSet& set : kKernels) {
    sets += set.dtype == dtype && set.head_dim == head_dim && set.v_head_dim == v_head_dim;
  }
  return sets;
}

// One set for each dtype and each head dim of detail::kCudaBlockHeadDims (v_head_dim equal to it)
// and each pair of detail::kCudaBlockValueDimPairs, and no other: the head dims that every entry
// point checks and names (detail::check_block_dtype) are the table's.
constexpr bool table_has_the_checked_head_dims() {
  for (const DType dtype : {DType::bf16, DType::f16}) {
    for (const std::int64_t head_dim : detail::kCudaBlockHeadDims) {
      if (count_sets(dtype, head_dim, head_dim) != 1) return false;
    }
    for (const detail::HeadDimPair& pair : detail::kCudaBlockValueDimPairs) {
      if (count_sets(dtype, pair.head_dim, pair.v_head_dim) != 1) return false;
    }
  }
  return std::size(kKernels) ==
         2 * (std::size(detail::kCudaBlockHeadDims) + std::size(detail::kCudaBlockValueDimPairs));
}
static_assert(table_has_the_checked_head_dims(),
              "kKernels must hold one kernel set per dtype and head dim of kCudaBlockHeadDims and "
              "per dtype and pair of kCudaBlockValueDimPairs");

// Refuses (ErrorKind::unsupported) a dtype or head dims without kernels, a v_head_dim other than
// head_dim outside kCudaBlockValueDimPairs included, before anything touches the GPU.
const KernelSet& find_kernels(DType dtype, std::int64_t head_dim, std::int64_t v_head_dim,
                              const char* where) {
  detail::check_block_dtype(dtype, head_dim, v_head_dim, Memory::device, where);
  for (const KernelSet& set : kKernels) {
    if (set.dtype == dtype && set.head_dim == head_dim && set.v_head_dim == v_head_dim) {
      return set;
    }
  }
  detail::fail_as(ErrorKind::unsupported, where, "no kernels were built for ", dtype_name(dtype),
                  " with head_dim ", head_dim, " and v_head_dim ", v_head_dim);
}

// The prepare's kernels: for O and dO of v_head_dim and, with a dQ to zero, dQ of head_dim (the
// pair's checks and messages), else any set of this dtype whose V has O's width (the square one
// first, which a build without it may lack where a pair has it).
const KernelSet& find_prepare_kernels(DType dtype, std::int64_t v_head_dim,
                                      const TensorView* dq_to_zero, const char* where) {
  if (dq_to_zero != nullptr) return find_kernels(dtype, dq_to_zero->shape[3], v_head_dim, where);
  if (detail::cuda_block_takes_head_dim(v_head_dim)) {
    return find_kernels(dtype, v_head_dim, v_head_dim, where);
  }
  for (const KernelSet& set : kKernels) {
    if (set.dtype == dtype && set.v_head_dim == v_head_dim) return set;
  }
  return find_kernels(dtype, v_head_dim, v_head_dim, where);  // refuses, naming the head dim
}

// The kernel family: the Hopper one (wgmma) on a compute capability 9.0 GPU when the
// library was built for sm_90a, the sm_80 one (mma.sync) otherwise. RINGATTN_FLASH_FAMILY=sm80 in
// the environment keeps the sm_80 family on a Hopper GPU (to compare the two, or to test both).
bool use_hopper_family() {
#if RINGATTN_WITH_SM90A
  const char* family = std::getenv("RINGATTN_FLASH_FAMILY");
  if (family != nullptr && std::string_view(family) == "sm80") return false;
  int device = 0, major = 0, minor = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

void check_device(const char* where) {
  int device = 0, major = 0, minor = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major < 8) {
    detail::fail_as(ErrorKind::unsupported, where, "GPU ", device, " has compute capability ", major, ".", minor,
                 "; the CUDA block needs 8.0 (Ampere) or newer");
  }
}

// The pointer must be device (or managed) memory: host memory would fault inside the kernel.
void check_device_pointer(const void* data, const char* name, const char* where) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, data);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    detail::fail(where, name, " (", data, ") is not a pointer CUDA knows: ", cudaGetErrorString(status));
  }
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    detail::fail(where, name, " (", data, ") points to ",
                 attributes.type == cudaMemoryTypeHost ? "pinned host" : "host",
                 " memory; expected device memory");
  }
}

void check_layout(const TensorView& t, const char* name, const char* where) {
  if (t.numel() > 0) check_device_pointer(t.data, name, where);
  detail::check_block_layout(t, name, where);
}

void check_sizes(const AttentionShape& s, const char* where) {
  constexpr std::int64_t kMaxLen = INT_MAX - 256;  // row indices are 32-bit inside the kernels
  constexpr std::int64_t kMaxGrid = 65535;         // heads and batch are grid dimensions
  if (s.q_len > kMaxLen || s.k_len > kMaxLen) {
    detail::fail(where, "sequence lengths ", s.q_len, " (q) and ", s.k_len, " (k) exceed ", kMaxLen);
  }
  if (s.batch > kMaxGrid || s.q_heads > kMaxGrid) {
    detail::fail(where, "batch ", s.batch, " and q_heads ", s.q_heads, " must be at most ", kMaxGrid);
  }
}

// The first three strides: batch, row, head of a [batch, len, heads, head_dim] view, or batch,
// head, row of a [batch, heads, len] one (its only three).
void copy_strides(const TensorView& t, std::int64_t (&out)[3]) {
  for (int axis = 0; axis < 3; ++axis) out[axis] = t.strides[axis];
}

// The kernels read the document starts on the device.
void check_mask_memory(const Mask& mask, const char* where) {
  if (mask.documents.active()) check_device_pointer(mask.documents.data, "the document starts", where);
}

FlashParams make_params(const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionShape& s, double scale, const Mask& mask) {
  FlashParams p;
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  copy_strides(q, p.q_strides);
  copy_strides(k, p.k_strides);
  copy_strides(v, p.v_strides);
  p.batch = static_cast<int>(s.batch);
  p.q_len = static_cast<int>(s.q_len);
  p.k_len = static_cast<int>(s.k_len);
  p.q_heads = static_cast<int>(s.q_heads);
  p.kv_heads = static_cast<int>(s.kv_heads);
  p.head_dim = static_cast<int>(s.head_dim);
  p.group = static_cast<int>(s.q_heads / s.kv_heads);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = mask.causal;
  p.shift = mask.q_start - mask.k_start;
  if (mask.local()) {  // the kCausal kernels of the sm_80 family serve windows and documents
    p.causal = true;
    p.local = true;
    p.rule = detail::MaskRule::of(mask);
    p.document_stride = mask.documents.batch_stride;
    p.q_start = mask.q_start;
    p.k_start = mask.k_start;
  }
  return p;
}

}  // namespace

void flash_forward(const ForwardArgs& args, void* stream) {
  constexpr const char* kWhere = "cuda::flash_forward";
  const AttentionShape s = check_forward_args(args, Memory::device, kWhere);
  const KernelSet& kernels = find_kernels(args.q.dtype, s.head_dim, s.v_head_dim, kWhere);
  check_sizes(s, kWhere);
  check_device(kWhere);
  check_layout(args.q, "q", kWhere);
  check_layout(args.k, "k", kWhere);
  check_layout(args.v, "v", kWhere);
  check_layout(args.o, "o", kWhere);
  check_layout(args.lse, "lse", kWhere);
  check_mask_memory(args.mask, kWhere);
  if (s.q_len == 0 || s.batch == 0) return;
  FlashParams p = make_params(args.q, args.k, args.v, s, args.scale, args.mask);
  p.o = args.o.data;
  copy_strides(args.o, p.o_strides);
  p.lse = static_cast<float*>(args.lse.data);
  copy_strides(args.lse, p.lse_strides);
  kernels.forward(p, args.combine, use_hopper_family(), static_cast<cudaStream_t>(stream));
}

void flash_backward_prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
                            void* stream, const TensorView* dq_to_zero) {
  constexpr const char* kWhere = "cuda::flash_backward_prepare";
  detail::check_view(o, "o", 4, Memory::device, kWhere);
  detail::check_view(dout, "dout", 4, Memory::device, kWhere);
  detail::check_view(delta, "delta", 3, Memory::device, kWhere);
  detail::check_shape(dout, "dout", {o.shape[0], o.shape[1], o.shape[2], o.shape[3]},
                      "the shape of o", kWhere);
  detail::check_shape(delta, "delta", {o.shape[0], o.shape[2], o.shape[1]},
                      "[batch, heads, len] of o", kWhere);
  detail::check_dtype(dout, "dout", o.dtype, "the dtype of o", kWhere);
  detail::check_dtype(delta, "delta", DType::f32, "the accumulator dtype", kWhere);
  // dq has the head_dim of q (d_qk), o that of v (d_v): the pair must have kernels.
  if (dq_to_zero != nullptr) {
    detail::check_view(*dq_to_zero, "dq", 4, Memory::device, kWhere);
    if (dq_to_zero->shape[3] != o.shape[3] &&
        !detail::cuda_block_takes_value_dim(dq_to_zero->shape[3], o.shape[3])) {
      const std::string pairs = detail::cuda_block_value_dims_text();
      detail::fail_as(ErrorKind::unsupported, kWhere, "dq has head_dim ", dq_to_zero->shape[3],
                      " but o has ", o.shape[3],
                      "; the CUDA block takes one head_dim for q, k and v (",
                      detail::cuda_block_head_dims_text(), ")",
                      pairs.empty() ? "" : ", or " + pairs);
    }
  }
  const KernelSet& kernels = find_prepare_kernels(o.dtype, o.shape[3], dq_to_zero, kWhere);
  check_sizes({o.shape[0], o.shape[1], o.shape[1], o.shape[2], o.shape[2], o.shape[3]}, kWhere);
  check_device(kWhere);
  check_layout(o, "o", kWhere);
  check_layout(dout, "dout", kWhere);
  check_layout(delta, "delta", kWhere);
  if (dq_to_zero != nullptr) {
    detail::check_shape(*dq_to_zero, "dq",
                        {o.shape[0], o.shape[1], o.shape[2], dq_to_zero->shape[3]},
                        "the batch, length and heads of o", kWhere);
    detail::check_dtype(*dq_to_zero, "dq", DType::f32, "the accumulator dtype", kWhere);
    check_layout(*dq_to_zero, "dq", kWhere);
  }
  if (o.numel() == 0) return;
  FlashParams p;
  p.o = o.data;
  copy_strides(o, p.o_strides);
  p.dout = dout.data;
  copy_strides(dout, p.dout_strides);
  p.delta = static_cast<float*>(delta.data);
  copy_strides(delta, p.delta_strides);
  if (dq_to_zero != nullptr) {
    p.dq = static_cast<float*>(dq_to_zero->data);
    copy_strides(*dq_to_zero, p.dq_strides);
  }
  p.batch = static_cast<int>(o.shape[0]);
  p.q_len = static_cast<int>(o.shape[1]);
  p.q_heads = static_cast<int>(o.shape[2]);
  p.head_dim = kernels.head_dim;
  kernels.prepare(p, static_cast<cudaStream_t>(stream));
}

void flash_backward(const BackwardArgs& args, void* stream) {
  constexpr const char* kWhere = "cuda::flash_backward";
  const AttentionShape s = check_backward_args(args, Memory::device, kWhere);
  const KernelSet& kernels = find_kernels(args.q.dtype, s.head_dim, s.v_head_dim, kWhere);
  check_sizes(s, kWhere);
  check_device(kWhere);
  const char* names[] = {"q", "k", "v", "dout", "lse", "delta", "dq", "dk", "dv"};
  const TensorView* views[] = {&args.q,   &args.k,     &args.v,  &args.dout, &args.lse,
                               &args.delta, &args.dq, &args.dk, &args.dv};
  for (int i = 0; i < 9; ++i) check_layout(*views[i], names[i], kWhere);
  check_mask_memory(args.mask, kWhere);
  if (s.batch == 0 || s.q_len == 0 || s.k_len == 0) return;
  FlashParams p = make_params(args.q, args.k, args.v, s, args.scale, args.mask);
  p.dout = args.dout.data;
  copy_strides(args.dout, p.dout_strides);
  p.lse = static_cast<float*>(args.lse.data);
  copy_strides(args.lse, p.lse_strides);
  p.delta = static_cast<float*>(args.delta.data);
  copy_strides(args.delta, p.delta_strides);
  p.dq = static_cast<float*>(args.dq.data);
  p.dk = args.dk.data;
  p.dv = args.dv.data;
  copy_strides(args.dq, p.dq_strides);
  copy_strides(args.dk, p.dk_strides);
  copy_strides(args.dv, p.dv_strides);
  p.overwrite_key_gradients = args.overwrite_key_gradients;
  p.round_key_gradients = args.dk.dtype == args.q.dtype;  // checked: only when overwriting
  if (args.key_rotation.active()) {
    const KeyRotation& rotation = args.key_rotation;
    check_device_pointer(rotation.cos.data, "key_rotation.cos", kWhere);
    check_device_pointer(rotation.sin.data, "key_rotation.sin", kWhere);
    p.key_cos = static_cast<const float*>(rotation.cos.data);
    p.key_sin = static_cast<const float*>(rotation.sin.data);
    p.key_cos_stride = rotation.cos.strides[0];
    p.key_sin_stride = rotation.sin.strides[0];
  }
  kernels.backward(p, args.deterministic, use_hopper_family(), static_cast<cudaStream_t>(stream));
}

}  // namespace ringattn::cuda
