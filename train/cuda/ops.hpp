// The model's ops on the GPU: the CUDA twins of train/op_*.hpp, with bf16 activations and fp32
// arithmetic inside every op (the CPU twins are fp32/fp64 and define the math; each op here is
// tested against its twin, tests/train/gpu_ops.cpp).
//
// Every pointer is device memory; every op is enqueued on `stream` and returns without waiting,
// except where a result comes back to the host (cross_entropy_forward(_backward),
// sum_of_squares), which wait on the stream. Sizes are the same shape structs as the CPU twins; a
// non-positive size or a null pointer throws ringattn::Error naming the argument before anything
// is launched.
//
// Precision: activations and their gradients are bf16 in memory; norms, softmax, rotations,
// SwiGLU and the optimizer compute in fp32; weight gradients, master weights and AdamW moments
// are fp32. The model's weights are read by the GEMMs as a bf16 copy that adamw_step refreshes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "train/op_adamw.hpp"
#include "train/op_common.hpp"
#include "train/op_cross_entropy.hpp"
#include "train/op_embedding.hpp"
#include "train/op_rmsnorm.hpp"
#include "train/op_rope.hpp"
#include "train/op_swiglu.hpp"

namespace ringattn::train::cuda {

using bf16 = __nv_bfloat16;

// ---- conversions and the residual stream --------------------------------------------------

// out[i] = bf16(in[i]) (round to nearest even).
void to_bf16(bf16* out, const float* in, std::int64_t count, cudaStream_t stream);
// out[i] = float(in[i]).
void to_float(float* out, const bf16* in, std::int64_t count, cudaStream_t stream);
// y += x elementwise (fp32 sum, rounded once to bf16).
void residual_add(bf16* y, const bf16* x, std::int64_t count, cudaStream_t stream);

// ---- embedding ----------------------------------------------------------------------------

// out[t, :] = table[tokens[t], :]; a token outside [0, vocab) is an error the kernel cannot
// report: the caller validates tokens on the host (the trainer does, on loading a batch).
void embedding_forward(bf16* out, const std::int32_t* tokens, const bf16* table,
                       const cpu::EmbeddingShape& shape, cudaStream_t stream);
// dtable[tokens[t], :] += dout[t, :] (always adds; fp32). deterministic = false uses atomics;
// true sums each column in token order (bitwise reproducible, slower).
void embedding_backward(float* dtable, const std::int32_t* tokens, const bf16* dout,
                        const cpu::EmbeddingShape& shape, bool deterministic,
                        cudaStream_t stream);

// ---- RMSNorm -------------------------------------------------------------------------------

// y = x * inv_rms * g; inv_rms [rows] fp32 saved for the backward; g [dim] fp32.
void rmsnorm_forward(bf16* y, float* inv_rms, const bf16* x, const float* g,
                     const cpu::RmsNormShape& shape, double eps, cudaStream_t stream);
// dx (+)= the gradient of x (dx_write), dg += the gradient of g (fp32, always adds; summed over
// rows in a fixed order: bitwise reproducible). dx may not alias dy.
void rmsnorm_backward(bf16* dx, float* dg, const bf16* dy, const bf16* x, const float* g,
                      const float* inv_rms, const cpu::RmsNormShape& shape, Write dx_write,
                      cudaStream_t stream);

// ---- RoPE ----------------------------------------------------------------------------------

// The rotation angles of a set of positions: cos and sin [positions.size(), head_dim / 2], fp32,
// computed in double on the host (angles at positions near 1e6 keep their precision), in the CPU
// twin's convention (half-split pairs, angle position * theta^(-2 i / head_dim)).
struct RopeTable {
  std::vector<float> cos, sin;
};
RopeTable rope_table(const std::vector<std::int64_t>& positions, std::int64_t head_dim,
                     double theta);
// What rope_table checks (at least one position, none negative; an even head_dim; a finite theta
// > 0), failing with `where` in the message.
void check_rope_arguments(const std::vector<std::int64_t>& positions, std::int64_t head_dim,
                          double theta, const char* where);
// theta^(-2 i / head_dim) for i < head_dim / 2, in double: the frequencies of both tables.
std::vector<double> rope_inverse_frequencies(std::int64_t head_dim, double theta);
// The same table made on the device: cos and sin [rows, head_dim / 2] from positions [rows] and
// inverse_frequencies [head_dim / 2] (rope_inverse_frequencies), all device memory, queued on
// `stream`. The angle and its cos and sin are formed in double as on the host; only the last
// bits of the double results may differ from the host's, so an element of fp32 rarely does, by
// one fp32 ulp. For positions that change every step (RoPE restarting at packed documents) it
// replaces the host's trigonometry and the copy of the table with a copy of the positions.
void rope_table(float* cos, float* sin, const std::int64_t* positions, std::int64_t rows,
                const double* inverse_frequencies, std::int64_t head_dim, cudaStream_t stream);

// In place on x [tokens, heads, head_dim] with token stride shape.token_stride (q or k inside a
// packed QKV row). Token t uses row (t % table_rows) of cos / sin [table_rows, head_dim / 2]
// (device copies of a RopeTable): a batch of sequences that share their positions shares one table.
void rope_forward(bf16* x, const float* cos, const float* sin, std::int64_t table_rows,
                  const cpu::RopeShape& shape, cudaStream_t stream);
// dx = R^T dx, in place.
void rope_backward(bf16* dx, const float* cos, const float* sin, std::int64_t table_rows,
                   const cpu::RopeShape& shape, cudaStream_t stream);
// dx = bf16(R^T dx_acc) from fp32 gradients dx_acc [tokens, token_stride], which may not overlap
// dx: every element of dx's token rows, dx[t * token_stride + j] for j < token_stride, is written
// once, rounded once: j < heads * head_dim rotated as above (the same pairs, table row
// t % table_rows), the rest of the row (v inside a packed QKV row) dx_acc's value as it is. With
// heads = q_heads + kv_heads this is the conversion of a packed QKV row's gradient to bf16 and the
// backward of q's and k's rotations in one pass.
void rope_backward(bf16* dx, const float* dx_acc, const float* cos, const float* sin,
                   std::int64_t table_rows, const cpu::RopeShape& shape, cudaStream_t stream);
// The same over the heads alone, the rest of each token row left as it is in dx: where only dQ
// arrives in fp32, and dK and dV were written in bf16 (dK rotated back) by the attention.
void rope_backward_heads(bf16* dx, const float* dx_acc, const float* cos, const float* sin,
                         std::int64_t table_rows, const cpu::RopeShape& shape,
                         cudaStream_t stream);

// ---- SwiGLU --------------------------------------------------------------------------------

// out [rows, hidden] = silu(a) * b, with a = gate_up[:, :hidden], b = gate_up[:, hidden:].
void swiglu_forward(bf16* out, const bf16* gate_up, const cpu::SwigluShape& shape,
                    cudaStream_t stream);
// dgate_up [rows, 2 hidden] = the gradients of a and b.
void swiglu_backward(bf16* dgate_up, const bf16* dout, const bf16* gate_up,
                     const cpu::SwigluShape& shape, cudaStream_t stream);

// ---- softmax cross-entropy -----------------------------------------------------------------

// Device outputs: losses [tokens] fp32 (loss_t, unweighted), predictions [tokens] int32 (argmax,
// lowest index among equal maxima). weights [tokens] fp32 on the device. The sums come back to
// the host (the call waits on the stream) and are summed in double in token order, as the CPU
// twin does. `host_losses` is a caller-owned host buffer of tokens floats (pinned or not) that
// the losses are copied through.
cpu::CrossEntropySums cross_entropy_forward(float* losses, std::int32_t* predictions,
                                            const bf16* logits, const std::int32_t* targets,
                                            const float* weights,
                                            const cpu::CrossEntropyShape& shape,
                                            float* host_losses, const float* host_weights,
                                            cudaStream_t stream);
// The forward, and dlogits[t, :] = (softmax(logits[t, :]) - onehot(targets[t])) * weights[t] *
// scale in bf16, written over `logits` (in place: dlogits may equal logits).
cpu::CrossEntropySums cross_entropy_forward_backward(bf16* dlogits, float* losses,
                                                     std::int32_t* predictions,
                                                     const bf16* logits,
                                                     const std::int32_t* targets,
                                                     const float* weights,
                                                     const cpu::CrossEntropyShape& shape,
                                                     double scale, float* host_losses,
                                                     const float* host_weights,
                                                     cudaStream_t stream);
// cross_entropy_forward (dlogits null) or cross_entropy_forward_backward without the wait: the
// same checks and kernel, queued on the stream; the losses stay on the device for the caller to
// copy back and sum (cpu::cross_entropy_sums) when it needs them.
void cross_entropy_queue(bf16* dlogits, float* losses, std::int32_t* predictions,
                         const bf16* logits, const std::int32_t* targets, const float* weights,
                         const cpu::CrossEntropyShape& shape, double scale,
                         const float* host_weights, cudaStream_t stream);

// ---- optimizer -----------------------------------------------------------------------------

// sum_i grads[i]^2 in double, over `count` fp32 elements: fixed-order block partials summed on
// the host in order (bitwise reproducible). Waits on the stream. Without `scratch` each call takes
// device memory for its partials from the stream-ordered pool and copies them back into pageable
// memory; a caller that sums every step passes buffers kept between calls instead.
struct SumOfSquaresScratch {
  static constexpr std::int64_t kPartials = 1024;  // the most block partials of a call
  double* device = nullptr;                         // kPartials doubles of device memory
  double* host = nullptr;                           // kPartials doubles of page-locked memory
  double* total = nullptr;  // queue_clip_factor's: one double of device memory
  float* factor = nullptr;  // queue_clip_factor's: one float of device memory
};
double sum_of_squares(const float* grads, std::int64_t count, cudaStream_t stream,
                      const SumOfSquaresScratch* scratch = nullptr);

// The gradient clip without the host in the loop: queues sum_of_squares's partials, then sums
// them on the device in the same order (the same double) into *scratch.total, copied to
// scratch.host[0] behind it, and writes *scratch.factor = cpu::step_clip_factor(total, max_norm)
// (the same operations, on the device).
// Returns at once: the total is on the host once the stream has passed the copy.
void queue_clip_factor(const float* grads, std::int64_t count, double max_norm,
                       const SumOfSquaresScratch& scratch, cudaStream_t stream);

// One AdamW step (cpu::adamw_step's update) on `count` elements, with the gradient multiplied by
// grad_scale first (the clip factor); writes the updated params and their bf16 copy
// params_bf16 (may be null: no copy).
void adamw_step(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                std::int64_t count, const cpu::AdamWHyper& hyper, std::int64_t step,
                cpu::WeightDecay decay, float grad_scale, cudaStream_t stream);
// The same step over consecutive tensors: segment j is the next segments[j].count elements from
// the pointers on, stepped with segments[j].decay. One launch covers up to 64 segments (a whole
// model of up to 64 tensors), not one a tensor.
void adamw_step(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& hyper,
                std::int64_t step, float grad_scale, cudaStream_t stream);
// The same with the gradient's multiplier read on the device, from *factor (queue_clip_factor's),
// as the kernels start: a factor that is not finite leaves every tensor as it was.
void adamw_step_clipped(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                        std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& hyper,
                        std::int64_t step, const float* factor, cudaStream_t stream);

}  // namespace ringattn::train::cuda
