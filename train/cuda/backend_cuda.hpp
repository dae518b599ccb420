// The CUDA backend of the model (train/model.hpp): bf16 activations in device memory, fp32
// statistics, attention gradients, master weights, gradients and AdamW moments; GEMMs through
// cuBLASLt (train/cuda/gemm.hpp), the other ops in train/cuda/ops.hpp, the ring over NCCL. All
// work is queued on the backend's stream; the host waits only where a number comes back (the
// loss sums, the gradient norm) and, in a profiled step, once at its end.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/tensor.hpp"
#include "src/cuda/device_buffer.hpp"
#include "train/cuda/gemm.hpp"
#include "train/cuda/ops.hpp"
#include "train/model.hpp"

namespace ringattn::train {

// `count` elements of E in device memory (uninitialised), moved, never copied.
template <typename E>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::int64_t count)
      : buffer_(static_cast<std::size_t>(count) * sizeof(E)), size_(static_cast<std::size_t>(count)) {}
  E* data() const { return buffer_.as<E>(); }
  std::size_t size() const { return size_; }

 private:
  DeviceBuffer buffer_;
  std::size_t size_ = 0;
};

class CudaBackend {
 public:
  using Act = __nv_bfloat16;
  using Acc = float;
  using Master = float;
  template <typename E>
  using Buffer = DeviceArray<E>;
  static constexpr DType act_dtype = DType::bf16;
  static constexpr DType acc_dtype = DType::f32;
  static constexpr DType master_dtype = DType::f32;
  static constexpr Memory memory = Memory::device;
  static std::string name() { return "cuda bf16"; }

  CudaBackend();
  ~CudaBackend();

  void* stream() { return stream_.get(); }

  // ---- data ----
  // Copies the batch's token ids (checked against vocab on the host), targets and loss mask to
  // the device, through page-locked staging buffers: queued behind the stream's work without
  // waiting for it, so that a step's first kernels follow the last step's AdamW without a pause.
  void load_batch(const ShardBatch& batch, std::int64_t vocab);
  // The attention's document starts in device memory, queued like the batch (valid until the next
  // call).
  const std::int64_t* load_documents(std::span<const std::int64_t> starts);
  void fill_zero(float* data, std::int64_t count);
  void copy(Act* dst, const Act* src, std::int64_t count);
  void to_act(Act* dst, const float* src, std::int64_t count);
  void upload(float* dst, const float* src, std::int64_t count);
  void upload_wide(float* dst, const double* src, std::int64_t count);
  void download(float* dst, const float* src, std::int64_t count);
  // Device memory in use by this process's GPU, the largest seen so far (cudaMemGetInfo, sampled
  // at each call and after every backward).
  double memory_mib();
  // The offload (ModelOptions::offload), on a stream of its own: offload copies `bytes` from
  // device memory into pinned host memory and prefetch copies them back, each after the work
  // queued so far on the model's stream, and marks its end in the event of `slot` (0 to
  // kTransferSlots - 1); wait_transfer makes the model's stream wait for that mark.
  // host_all_finite reads bf16 bits in host memory.
  static constexpr int kTransferSlots = 4;
  template <typename E>
  using HostBuffer = PinnedArray<E>;
  void offload(void* host, const void* data, std::size_t bytes, int slot);
  void prefetch(void* data, const void* host, std::size_t bytes, int slot);
  void wait_transfer(int slot);
  bool host_all_finite(const Act* host, std::int64_t count);

  // ---- ops ----
  void embedding_forward(Act* out, const Act* table, const cpu::EmbeddingShape& s);
  void embedding_backward(float* dtable, const Act* dout, const cpu::EmbeddingShape& s,
                          bool deterministic);
  void rmsnorm_forward(Act* y, float* inv, const Act* x, const float* g,
                       const cpu::RmsNormShape& s, double eps);
  void rmsnorm_backward(Act* dx, float* dg, const Act* dy, const Act* x, const float* g,
                        const float* inv, const cpu::RmsNormShape& s, Write dx_write);
  void matmul_forward(Act* y, const Act* x, const Act* w, const cpu::MatmulShape& s, Write write,
                      const Act* residual = nullptr);
  void matmul_backward_input(Act* dx, const Act* dy, const Act* w, const cpu::MatmulShape& s,
                             Write write);
  void matmul_backward_weight(float* dw, const Act* dy, const Act* x, const cpu::MatmulShape& s,
                              Write write);
  // The positions of one row's tokens (every row repeats them) or of all the batch's tokens.
  void set_rope(const std::vector<std::int64_t>& positions, std::int64_t head_dim, double theta);
  void rope_forward(Act* x, const cpu::RopeShape& s);
  void rope_backward(Act* dx, const cpu::RopeShape& s);
  // dx = bf16(R^T dx_acc) over the heads of s, the rest of each token row converted as it is.
  void rope_backward(Act* dx, const float* dx_acc, const cpu::RopeShape& s);
  // The same over the heads of s alone, the rest of each token row left as it is.
  void rope_backward_heads(Act* dx, const float* dx_acc, const cpu::RopeShape& s);
  // The rotation's tables [local tokens, head_dim / 2] as the attention's KeyRotation (set_rope's).
  KeyRotation key_rotation() const;
  void swiglu_forward(Act* out, const Act* gu, const cpu::SwigluShape& s);
  void swiglu_backward(Act* dgu, const Act* dout, const Act* gu, const cpu::SwigluShape& s);
  // The loaded batch's tokens [first, first + s.tokens), queued: their losses come back to the
  // host behind the kernel, and loss_sums() waits only for them (predictions, for an evaluation,
  // are waited for here).
  void cross_entropy(Act* logits, const cpu::CrossEntropyShape& s, bool with_grad, double scale,
                     std::span<std::int32_t> predictions, std::int64_t first);
  // The sums of the cross_entropy calls since the last loss_sums(): each call's tokens in order in
  // double, the calls added in order (the CPU backend's sums).
  cpu::CrossEntropySums loss_sums();

  // Whether every value is finite (through fp32 copies of up to 16M values at a time; for
  // diagnostics, it waits on the stream).
  bool all_finite(const Act* data, std::int64_t count);

  // ---- optimizer ----
  double sum_of_squares(const float* grads, std::int64_t count);
  // The clip without a wait: queue_clip queues the sum of squares and the clip factor on the
  // device (cuda::queue_clip_factor), adamw_clipped a step over consecutive tensors
  // (cpu::AdamWSegment each, from the pointers on) with that factor (none if it is not finite),
  // and clip_total waits for the sum alone and returns it.
  void queue_clip(const float* grads, std::int64_t count, double max_norm);
  void adamw_clipped(float* params, Act* params_bf16, const float* grads, float* m, float* v,
                     std::span<const cpu::AdamWSegment> segments, const cpu::AdamWHyper& hyper,
                     std::int64_t step);
  double clip_total();

  // ---- profile ----
  // A pair of timing events per interval, recorded on the stream: the pool grows to the most
  // intervals a step has had and is reused by every later step.
  void begin_interval(std::size_t i);
  void end_interval(std::size_t i);
  void intervals_ms(std::size_t count, std::vector<double>& ms);

 private:
  CudaStream stream_;
  cuda::Gemm gemm_;
  DeviceArray<std::int32_t> tokens_, targets_, predictions_;
  DeviceArray<float> weights_, losses_, rope_cos_, rope_sin_, scratch_;
  // The batch as staged for its copies (token ids, then targets), and its loss mask, which the
  // loss sums read; batch_copied_ marks the end of the copies out of them.
  PinnedArray<std::int32_t> host_ids_;
  PinnedArray<float> host_weights_;
  CudaEvent batch_copied_;
  // Integers that change every step, copied to the device on the stream through a pinned
  // staging buffer (stage()): the document starts, and the positions of the RoPE table's rows.
  struct Staged {
    DeviceArray<std::int64_t> device;
    PinnedArray<std::int64_t> host;
    CudaEvent copied;  // the end of the last copy out of `host`
  };
  const std::int64_t* stage(Staged& staged, std::span<const std::int64_t> values);
  Staged documents_, rope_positions_;
  // The RoPE frequencies of rope_head_dim_ and rope_theta_, from which (with the staged positions)
  // the table is made on the device.
  DeviceArray<double> rope_frequencies_;
  double rope_theta_ = 0.0;
  PinnedArray<float> host_losses_;
  // sum_of_squares's partials, kept: the gradient norm is summed every step.
  DeviceArray<double> norm_partials_;
  PinnedArray<double> host_norm_partials_;
  DeviceArray<double> clip_total_;
  DeviceArray<float> clip_factor_;
  cuda::SumOfSquaresScratch norm_scratch_;
  CudaEvent clip_total_copied_;
  std::vector<std::pair<std::int64_t, std::int64_t>> pending_losses_;  // (first, tokens) a call
  CudaEvent losses_copied_;
  std::int64_t rope_rows_ = 0, rope_head_dim_ = 0;
  double peak_mib_ = 0.0;
  std::vector<std::unique_ptr<CudaEvent>> interval_events_;  // interval i: 2 i (begin), 2 i + 1
  // One copy of offload or prefetch on the offload's stream.
  void transfer(void* to, const void* from, std::size_t bytes, cudaMemcpyKind kind, int slot);
  // The offload's stream, the model stream's point each transfer waits for, and each slot's end.
  CudaStream transfer_stream_;
  CudaEvent transfer_after_;
  CudaEvent transfer_done_[kTransferSlots];
};

extern template class Model<CudaBackend>;

}  // namespace ringattn::train
