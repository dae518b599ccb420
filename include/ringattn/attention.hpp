// The local attention block: its arguments, the fp64 reference and the CPU flash block.
//
// Layouts (strides in elements, any order, so packed QKV buffers are views):
//   Q, dQ          [batch, q_len,  q_heads,  head_dim]
//   K, dK          [batch, k_len,  kv_heads, head_dim]     q_heads % kv_heads == 0 (GQA/MQA)
//   V, dV          [batch, k_len,  kv_heads, v_head_dim]
//   O, dO          [batch, q_len,  q_heads,  v_head_dim]
//   LSE, delta     [batch, q_heads, q_len]                 accumulator dtype
// The value head dim d_v (v_head_dim) may differ from the query/key head dim d_qk (head_dim), as
// in multi-head latent attention (192/128): scores are Q K^T over d_qk, outputs P V over d_v. The
// CPU block and the oracle take any pair; the CUDA block takes equal ones and 192/128 (cuda::).
// The accumulator dtype is f64 for f64 inputs and f32 for every other input dtype.
#pragma once

#include <cmath>
#include <cstdint>

#include "ringattn/tensor.hpp"

namespace ringattn {

// Packed documents: the global start positions of the documents of a sequence (cu_seqlens
// style, without the final end). The document of position p is the number of starts <= p, so
// a position before the first start lies in document 0 and a start repeated, or one past the
// sequence, makes an empty document (the padding of a batch row with fewer documents).
//   data          int64 [batch, count] (or one list for every batch row), non-decreasing along
//                 count, in the memory of the attention's tensors (device memory for the CUDA
//                 block); nullptr with count 0: the whole sequence is one document
//   batch_stride  elements between the lists of consecutive batch rows; 0: one list for all
// The list covers the whole sequence, not one chunk of it: every block of a ring takes the same.
struct DocumentStarts {
  const std::int64_t* data = nullptr;
  std::int64_t count = 0;
  std::int64_t batch_stride = 0;

  bool active() const { return count > 0; }
};

// Which keys a query sees, by global position: Q row i sits at position q_start + i, K row j at
// k_start + j. The query at position i sees the key at position j when all of these hold:
//   causal        j <= i
//   window_left   i - j < window_left   (0: no limit; 1 with causal: only itself)
//   window_right  j - i < window_right  (0: no limit; it changes nothing under causal)
//   documents     i and j lie in the same document (DocumentStarts)
// The default (all false, zero and empty) sees every key. A caller that holds one chunk of a
// longer sequence passes the chunk's global starts, so the same block serves every (Q chunk,
// K/V chunk) pair of a ring. The keys a query sees always form one interval of positions, and
// both of its ends grow with the query's position (ringattn::detail::MaskRule), which is what lets
// every kernel skip key tiles nobody sees and run fully visible ones without mask arithmetic.
struct Mask {
  bool causal = false;
  std::int64_t q_start = 0;
  std::int64_t k_start = 0;
  std::int64_t window_left = 0;
  std::int64_t window_right = 0;
  DocumentStarts documents{};

  // Anything beyond causality by position: a window or documents.
  bool local() const { return window_left > 0 || window_right > 0 || documents.active(); }
};

// The extents of one call. head_dim is d_qk (the last extent of Q and K), v_head_dim d_v (the
// last extent of V and O). The checks below always set both; in a shape written by hand,
// v_head_dim 0 means d_v = head_dim (value_dim()), so {B, Sq, Sk, Hq, Hkv, D} reads as before.
struct AttentionShape {
  std::int64_t batch = 0, q_len = 0, k_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t v_head_dim = 0;

  constexpr std::int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};

// Forward of one block: O = softmax(Q K^T * scale + mask) V and LSE = log(sum(exp(scores))).
//   combine = false: O has the dtype of Q and is overwritten; LSE is overwritten.
//   combine = true:  O and LSE are a running fp32 (f64 for f64 inputs) pair of earlier blocks
//                    over other keys; the block's result is merged into them, never rounded to
//                    the input dtype. Start a running pair at O = 0, LSE = -inf.
// A row that sees no key gets O = 0 and LSE = -inf (and leaves a running pair unchanged).
struct ForwardArgs {
  TensorView q, k, v;
  TensorView o;
  TensorView lse;
  double scale = 0.0;  // > 0, typically 1/sqrt(head_dim) (d_qk, whatever d_v)
  Mask mask;
  bool combine = false;
};

// Backward of one block with recomputation. O and LSE are the *final* ones of the whole row (for a
// ring: after all blocks); delta = rowsum(dO * O) comes from backward_prepare. dQ, dK and dV are
// accumulator-dtype buffers that the block adds into, so blocks over other keys (or other query
// heads of a GQA group) sum without rounding. With overwrite_key_gradients, dK and dV receive this
// block's gradients instead (their old contents are never read: no zeroing needed beforehand);
// dQ is still added into. Overwritten dK and dV may also have the dtype of the inputs (both):
// each key's gradients are then rounded once, which spares a caller that wants them in that
// dtype a pass over fp32 buffers.
//
// key_rotation: K holds keys rotated by RoPE, and dK is to receive (or have added) the gradient
// with respect to the keys before their rotation. The rotation pairs elements i and i + D / 2 of
// each head (D = head_dim, even): k'_i = k_i c - k_{i+D/2} s, k'_{i+D/2} = k_i s + k_{i+D/2} c,
// with c = cos[j, i] and s = sin[j, i] for K row j; each key's gradient is rotated back (by the
// transpose) before it is written or added. This spares a caller that rotates its keys a pass
// over dK. cos and sin: [k_len, D / 2] in the accumulator dtype and the inputs' memory, unit
// stride along the last axis; a default (rank 0) pair means no rotation.
struct KeyRotation {
  TensorView cos, sin;
  bool active() const { return cos.rank != 0 || sin.rank != 0; }
};

struct BackwardArgs {
  TensorView q, k, v;
  TensorView dout;
  TensorView lse;
  TensorView delta;
  TensorView dq, dk, dv;
  double scale = 0.0;
  Mask mask;
  bool deterministic = false;  // bitwise-reproducible gradients (the CPU block always is)
  bool overwrite_key_gradients = false;
  KeyRotation key_rotation{};
};

// Reads the shapes from the views and checks everything a kernel relies on (ranks, matching
// sizes, GQA divisibility, dtypes, memory kind, non-null pointers, scale); throws Error naming the
// argument otherwise. `where` names the calling function in the message. d_v is read from v; a
// tensor of d_v (o, dout, dv) whose last extent differs is named with both head dims.
AttentionShape check_forward_args(const ForwardArgs& args, Memory memory, const char* where);
AttentionShape check_backward_args(const BackwardArgs& args, Memory memory, const char* where);

inline double default_scale(std::int64_t head_dim) {
  return 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// The oracle: naive attention in fp64 with materialised scores, on host tensors of any dtype
// (converted to fp64 on the way in, rounded to the output dtype on the way out).
namespace reference {
// o [B, Sq, Hq, Dv]; lse [B, Hq, Sq] may have data == nullptr to skip it.
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const Mask& mask, double scale, const TensorView& o, const TensorView& lse);
// Textbook backward (P, dP = dO V^T, dS = P * (dP - rowsum(P * dP))); dq, dk, dv are overwritten.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& dout, const Mask& mask, double scale,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv);
}  // namespace reference

// The local block on the backend of the tensors' memory: host tensors (f32, f64) run the CPU block
// below, device tensors (bf16, f16) the CUDA block; `stream` is a cudaStream_t, unused on the host.
void flash_forward(const ForwardArgs& args, void* stream = nullptr);
// flash_backward_prepare: delta = rowsum(dO * O) for flash_backward; with dq_to_zero (the
// accumulator [B, Sq, Hq, D] flash_backward will add dQ into; O and dO are [B, Sq, Hq, Dv]), also
// dq = 0 in the same pass.
void flash_backward_prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
                            void* stream = nullptr, const TensorView* dq_to_zero = nullptr);
void flash_backward(const BackwardArgs& args, void* stream = nullptr);

// The CPU flash block: the same tiled algorithm and contract as the CUDA kernel, on host memory,
// for f32 and f64 inputs, multithreaded over (batch, head, row block).
namespace cpu {
void flash_forward(const ForwardArgs& args);
// delta[b, h, i] = sum_d dout[b, i, h, d] * o[b, i, h, d], in the accumulator dtype; dq_to_zero
// has the batch, length and heads of o and any head_dim (d_qk).
void flash_backward_prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
                            const TensorView* dq_to_zero = nullptr);
void flash_backward(const BackwardArgs& args);

// Worker threads of the CPU backend: RINGATTN_NUM_THREADS, else the CPUs the process may run on
// (its affinity mask: one core for a rank that mpirun bound to a core; else the hardware's count).
int num_threads();
void set_num_threads(int threads);
}  // namespace cpu

// The CUDA flash block (tensor cores, sm_80 and later): the same contract on device memory.
// Inputs f16 or bf16; head_dim 32, 64, 96, 128, 192 or 256 (those of RINGATTN_CUDA_HEAD_DIMS), the
// same for Q, K and V, or head_dim 192 with v_head_dim 128 (multi-head latent attention: Q, K, dQ,
// dK of 192, V, O, dO, dV of 128; built with head_dim 192).
// Any other v_head_dim is refused as ErrorKind::unsupported, naming both head dims and the pairs
// taken. Every tensor in device memory; Q, K, V, O and dO with unit stride along head_dim, other
// strides multiples of 8 elements and 16-byte aligned data; the fp32 buffers (running O, dQ, dK,
// dV) with unit stride along head_dim and even strides. Every mask of Mask: the document starts in
// device memory (host memory is refused), kept non-decreasing by the caller (the host checks only
// host lists). Both kernel families (wgmma on Hopper: the forward at every head_dim, the backward
// up to 128; mma.sync otherwise) skip key tiles that no row sees and run fully visible ones without mask arithmetic.
// `stream` is a cudaStream_t (nullptr: the default stream); the calls are asynchronous to the
// host. Everything is checked before any launch; a library built without CUDA throws Error.
namespace cuda {
void flash_forward(const ForwardArgs& args, void* stream = nullptr);
// delta = rowsum(dO * O) in fp32, for flash_backward; dq_to_zero (fp32) as above, of O's head_dim
// or, for O of 128, of 192.
void flash_backward_prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
                            void* stream = nullptr, const TensorView* dq_to_zero = nullptr);
// dQ is summed with fp32 atomics, or in a second pass over the keys when args.deterministic
// (bitwise-reproducible, at the cost of recomputing P and dP once more).
void flash_backward(const BackwardArgs& args, void* stream = nullptr);

// Streaming reference on the GPU for long sequences: fp32 arithmetic on CUDA cores, O(S) memory,
// one warp a row. Inputs f32, bf16 or f16 (any strides), head_dim and v_head_dim up to 256 each;
// outputs fp32 (o [B, Sq, Hq, Dv], lse and delta [B, Hq, Sq], dq/dk/dv of their inputs' widths,
// overwritten). The backward takes the
// reference's own o and lse and writes delta = rowsum(dout * o) on the way.
void reference_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const Mask& mask, double scale, const TensorView& o, const TensorView& lse,
                       void* stream = nullptr);
void reference_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse, const TensorView& dout,
                        const Mask& mask, double scale, const TensorView& delta,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        void* stream = nullptr);
}  // namespace cuda

}  // namespace ringattn
