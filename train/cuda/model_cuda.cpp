// The CUDA backend's host side (train/cuda/backend_cuda.hpp) and the model's instantiation on it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ringattn/error.hpp"
#include "src/cuda/cuda_check.hpp"
#include "train/cuda/backend_cuda.hpp"
#include "train/model_impl.hpp"

namespace ringattn::train {

namespace {

template <typename E>
void ensure(DeviceArray<E>& array, std::int64_t count) {
  if (static_cast<std::int64_t>(array.size()) < count) array = DeviceArray<E>(count);
}

}  // namespace

CudaBackend::CudaBackend()
    : gemm_(stream_.get()),
      norm_partials_(cuda::SumOfSquaresScratch::kPartials),
      host_norm_partials_(cuda::SumOfSquaresScratch::kPartials),
      clip_total_(1),
      clip_factor_(1) {
  norm_scratch_.device = norm_partials_.data();
  norm_scratch_.host = host_norm_partials_.data();
  norm_scratch_.total = clip_total_.data();
  norm_scratch_.factor = clip_factor_.data();
}

CudaBackend::~CudaBackend() = default;

void CudaBackend::load_batch(const ShardBatch& batch, std::int64_t vocab) {
  const std::int64_t n = static_cast<std::int64_t>(batch.inputs.size());
  for (std::int64_t t = 0; t < n; ++t) {
    for (const auto* ids : {&batch.inputs, &batch.targets}) {
      const std::int32_t id = (*ids)[t];
      if (id < 0 || id >= vocab) {
        ringattn::detail::fail("Model::forward", ids == &batch.inputs ? "inputs" : "targets", "[",
                               t, "] is ", id, "; expected a token id in [0, ", vocab, ")");
      }
    }
  }
  ensure(tokens_, n);
  ensure(targets_, n);
  ensure(weights_, n);
  ensure(losses_, n);
  ensure(predictions_, n);
  cudaStream_t s = stream_.get();
  const auto count = static_cast<std::size_t>(n);
  if (host_losses_.size() < count) {
    // Copies of an earlier batch's losses may still be on their way into the old buffer.
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(s));
    host_losses_ = PinnedArray<float>(count);
  }
  // The last batch's copies out of the staging buffers: queued at the start of its step, long
  // done by the time the next batch is ready.
  RINGATTN_CUDA_CHECK(cudaEventSynchronize(batch_copied_.get()));
  if (host_weights_.size() < count) {
    host_ids_ = PinnedArray<std::int32_t>(2 * count);
    host_weights_ = PinnedArray<float>(count);
  }
  std::copy(batch.inputs.begin(), batch.inputs.end(), host_ids_.data());
  std::copy(batch.targets.begin(), batch.targets.end(), host_ids_.data() + count);
  std::copy(batch.loss_mask.begin(), batch.loss_mask.end(), host_weights_.data());
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), host_ids_.data(), n * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, s));
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(targets_.data(), host_ids_.data() + count,
                                      n * sizeof(std::int32_t), cudaMemcpyHostToDevice, s));
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(weights_.data(), host_weights_.data(), n * sizeof(float),
                                      cudaMemcpyHostToDevice, s));
  batch_copied_.record(s);
  // The losses of an earlier batch that nobody summed are not this batch's.
  pending_losses_.clear();
}

const std::int64_t* CudaBackend::stage(Staged& staged, std::span<const std::int64_t> values) {
  const auto count = static_cast<std::int64_t>(values.size());
  ensure(staged.device, count);
  // The last copy out of the staging buffer is done before it is overwritten.
  RINGATTN_CUDA_CHECK(cudaEventSynchronize(staged.copied.get()));
  if (static_cast<std::int64_t>(staged.host.size()) < count) {
    staged.host = PinnedArray<std::int64_t>(static_cast<std::size_t>(count));
  }
  std::copy(values.begin(), values.end(), staged.host.data());
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(staged.device.data(), staged.host.data(),
                                      count * sizeof(std::int64_t), cudaMemcpyHostToDevice,
                                      stream_.get()));
  staged.copied.record(stream_.get());
  return staged.device.data();
}

const std::int64_t* CudaBackend::load_documents(std::span<const std::int64_t> starts) {
  return stage(documents_, starts);
}

void CudaBackend::fill_zero(float* data, std::int64_t count) {
  RINGATTN_CUDA_CHECK(cudaMemsetAsync(data, 0, count * sizeof(float), stream_.get()));
}

void CudaBackend::copy(Act* dst, const Act* src, std::int64_t count) {
  RINGATTN_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, count * sizeof(Act), cudaMemcpyDeviceToDevice, stream_.get()));
}

void CudaBackend::to_act(Act* dst, const float* src, std::int64_t count) {
  cuda::to_bf16(dst, src, count, stream_.get());
}

void CudaBackend::upload(float* dst, const float* src, std::int64_t count) {
  RINGATTN_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyHostToDevice, stream_.get()));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
}

void CudaBackend::upload_wide(float* dst, const double* src, std::int64_t count) {
  std::vector<float> narrow(src, src + count);
  upload(dst, narrow.data(), count);
}

void CudaBackend::download(float* dst, const float* src, std::int64_t count) {
  RINGATTN_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToHost, stream_.get()));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
}

double CudaBackend::memory_mib() {
  std::size_t free_bytes = 0, total_bytes = 0;
  RINGATTN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  peak_mib_ = std::max(peak_mib_, static_cast<double>(total_bytes - free_bytes) / (1024.0 * 1024.0));
  return peak_mib_;
}

void CudaBackend::transfer(void* to, const void* from, std::size_t bytes, cudaMemcpyKind kind,
                           int slot) {
  RINGATTN_CUDA_CHECK(cudaEventRecord(transfer_after_.get(), stream_.get()));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(transfer_stream_.get(), transfer_after_.get(), 0));
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, kind, transfer_stream_.get()));
  RINGATTN_CUDA_CHECK(cudaEventRecord(transfer_done_[slot].get(), transfer_stream_.get()));
}

void CudaBackend::offload(void* host, const void* data, std::size_t bytes, int slot) {
  transfer(host, data, bytes, cudaMemcpyDeviceToHost, slot);
}

void CudaBackend::prefetch(void* data, const void* host, std::size_t bytes, int slot) {
  transfer(data, host, bytes, cudaMemcpyHostToDevice, slot);
}

void CudaBackend::wait_transfer(int slot) {
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), transfer_done_[slot].get(), 0));
}

bool CudaBackend::host_all_finite(const Act* host, std::int64_t count) {
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(transfer_stream_.get()));
  const auto* bits = reinterpret_cast<const std::uint16_t*>(host);
  for (std::int64_t i = 0; i < count; ++i) {
    if ((bits[i] & 0x7f80u) == 0x7f80u) return false;  // exponent all ones: inf or NaN
  }
  return true;
}

void CudaBackend::embedding_forward(Act* out, const Act* table, const cpu::EmbeddingShape& s) {
  cuda::embedding_forward(out, tokens_.data(), table, s, stream_.get());
}

void CudaBackend::embedding_backward(float* dtable, const Act* dout, const cpu::EmbeddingShape& s,
                                     bool deterministic) {
  cuda::embedding_backward(dtable, tokens_.data(), dout, s, deterministic, stream_.get());
  memory_mib();  // the backward's end: the most memory in use
}

void CudaBackend::rmsnorm_forward(Act* y, float* inv, const Act* x, const float* g,
                                  const cpu::RmsNormShape& s, double eps) {
  cuda::rmsnorm_forward(y, inv, x, g, s, eps, stream_.get());
}

void CudaBackend::rmsnorm_backward(Act* dx, float* dg, const Act* dy, const Act* x, const float* g,
                                   const float* inv, const cpu::RmsNormShape& s, Write dx_write) {
  cuda::rmsnorm_backward(dx, dg, dy, x, g, inv, s, dx_write, stream_.get());
}

void CudaBackend::matmul_forward(Act* y, const Act* x, const Act* w, const cpu::MatmulShape& s,
                                 Write write, const Act* residual) {
  gemm_.forward(y, x, w, s, write, residual);
}

void CudaBackend::matmul_backward_input(Act* dx, const Act* dy, const Act* w,
                                        const cpu::MatmulShape& s, Write write) {
  gemm_.backward_input(dx, dy, w, s, write);
}

void CudaBackend::matmul_backward_weight(float* dw, const Act* dy, const Act* x,
                                         const cpu::MatmulShape& s, Write write) {
  gemm_.backward_weight(dw, dy, x, s, write);
}

void CudaBackend::set_rope(const std::vector<std::int64_t>& positions, std::int64_t head_dim,
                           double theta) {
  cuda::check_rope_arguments(positions, head_dim, theta, "train::cuda::rope_table");
  const auto rows = static_cast<std::int64_t>(positions.size());
  const std::int64_t half = head_dim / 2;
  if (head_dim != rope_head_dim_ || theta != rope_theta_) {
    const std::vector<double> inv_freq = cuda::rope_inverse_frequencies(head_dim, theta);
    ensure(rope_frequencies_, half);
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));  // no kernel reads the old ones
    RINGATTN_CUDA_CHECK(cudaMemcpy(rope_frequencies_.data(), inv_freq.data(),
                                   half * sizeof(double), cudaMemcpyHostToDevice));
    rope_head_dim_ = head_dim;
    rope_theta_ = theta;
  }
  // Document-relative positions change every step: only they travel, and the table is made on
  // the stream.
  ensure(rope_cos_, rows * half);
  ensure(rope_sin_, rows * half);
  const std::int64_t* device_positions = stage(rope_positions_, positions);
  cuda::rope_table(rope_cos_.data(), rope_sin_.data(), device_positions, rows,
                   rope_frequencies_.data(), head_dim, stream_.get());
  rope_rows_ = rows;
}

KeyRotation CudaBackend::key_rotation() const {
  const std::int64_t half = rope_head_dim_ / 2;
  return {TensorView::contiguous(rope_cos_.data(), DType::f32,
                                 {rope_rows_, half}, Memory::device),
          TensorView::contiguous(rope_sin_.data(), DType::f32,
                                 {rope_rows_, half}, Memory::device)};
}

void CudaBackend::rope_forward(Act* x, const cpu::RopeShape& s) {
  cuda::rope_forward(x, rope_cos_.data(), rope_sin_.data(), rope_rows_, s, stream_.get());
}

void CudaBackend::rope_backward(Act* dx, const cpu::RopeShape& s) {
  cuda::rope_backward(dx, rope_cos_.data(), rope_sin_.data(), rope_rows_, s, stream_.get());
}

void CudaBackend::rope_backward(Act* dx, const float* dx_acc, const cpu::RopeShape& s) {
  cuda::rope_backward(dx, dx_acc, rope_cos_.data(), rope_sin_.data(), rope_rows_, s, stream_.get());
}

void CudaBackend::rope_backward_heads(Act* dx, const float* dx_acc, const cpu::RopeShape& s) {
  cuda::rope_backward_heads(dx, dx_acc, rope_cos_.data(), rope_sin_.data(), rope_rows_, s,
                            stream_.get());
}

void CudaBackend::swiglu_forward(Act* out, const Act* gu, const cpu::SwigluShape& s) {
  cuda::swiglu_forward(out, gu, s, stream_.get());
}

void CudaBackend::swiglu_backward(Act* dgu, const Act* dout, const Act* gu,
                                  const cpu::SwigluShape& s) {
  cuda::swiglu_backward(dgu, dout, gu, s, stream_.get());
}

void CudaBackend::cross_entropy(Act* logits, const cpu::CrossEntropyShape& s, bool with_grad,
                                double scale, std::span<std::int32_t> predictions,
                                std::int64_t first) {
  cuda::cross_entropy_queue(with_grad ? logits : nullptr, losses_.data() + first,
                            predictions_.data() + first, logits, targets_.data() + first,
                            weights_.data() + first, s, scale, host_weights_.data() + first,
                            stream_.get());
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(host_losses_.data() + first, losses_.data() + first,
                                      s.tokens * sizeof(float), cudaMemcpyDeviceToHost,
                                      stream_.get()));
  losses_copied_.record(stream_.get());
  pending_losses_.emplace_back(first, s.tokens);
  if (!predictions.empty()) {
    RINGATTN_CUDA_CHECK(cudaMemcpyAsync(predictions.data(), predictions_.data() + first,
                                        s.tokens * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                        stream_.get()));
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
  }
}

cpu::CrossEntropySums CudaBackend::loss_sums() {
  cpu::CrossEntropySums total;
  if (pending_losses_.empty()) return total;
  RINGATTN_CUDA_CHECK(cudaEventSynchronize(losses_copied_.get()));
  for (const auto& [first, tokens] : pending_losses_) {
    const auto begin = static_cast<std::size_t>(first), count = static_cast<std::size_t>(tokens);
    total += cpu::cross_entropy_sums<float>({host_losses_.data() + begin, count},
                                            {host_weights_.data() + begin, count});
  }
  pending_losses_.clear();
  return total;
}

bool CudaBackend::all_finite(const Act* data, std::int64_t count) {
  constexpr std::int64_t kChunk = std::int64_t{1} << 24;
  ensure(scratch_, std::min(count, kChunk));
  for (std::int64_t first = 0; first < count; first += kChunk) {
    const std::int64_t n = std::min(kChunk, count - first);
    cuda::to_float(scratch_.data(), data + first, n, stream_.get());
    if (!std::isfinite(cuda::sum_of_squares(scratch_.data(), n, stream_.get(), &norm_scratch_))) {
      return false;
    }
  }
  return true;
}

double CudaBackend::sum_of_squares(const float* grads, std::int64_t count) {
  return cuda::sum_of_squares(grads, count, stream_.get(), &norm_scratch_);
}

void CudaBackend::queue_clip(const float* grads, std::int64_t count, double max_norm) {
  cuda::queue_clip_factor(grads, count, max_norm, norm_scratch_, stream_.get());
  clip_total_copied_.record(stream_.get());
}

void CudaBackend::adamw_clipped(float* params, Act* params_bf16, const float* grads, float* m,
                                float* v, std::span<const cpu::AdamWSegment> segments,
                                const cpu::AdamWHyper& hyper, std::int64_t step) {
  cuda::adamw_step_clipped(params, params_bf16, grads, m, v, segments, hyper, step,
                           clip_factor_.data(), stream_.get());
}

double CudaBackend::clip_total() {
  RINGATTN_CUDA_CHECK(cudaEventSynchronize(clip_total_copied_.get()));
  return host_norm_partials_.data()[0];
}

void CudaBackend::begin_interval(std::size_t i) {
  while (interval_events_.size() < 2 * (i + 1)) {
    interval_events_.push_back(std::make_unique<CudaEvent>(cudaEventDefault));
  }
  interval_events_[2 * i]->record(stream_.get());
}

void CudaBackend::end_interval(std::size_t i) {
  interval_events_[2 * i + 1]->record(stream_.get());
}

void CudaBackend::intervals_ms(std::size_t count, std::vector<double>& ms) {
  ms.resize(count);
  if (count == 0) return;
  // Every event is on the one stream: once the last has completed, all have.
  RINGATTN_CUDA_CHECK(cudaEventSynchronize(interval_events_[2 * count - 1]->get()));
  for (std::size_t i = 0; i < count; ++i) {
    float elapsed_ms = 0.0f;
    RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&elapsed_ms, interval_events_[2 * i]->get(),
                                             interval_events_[2 * i + 1]->get()));
    ms[i] = elapsed_ms;
  }
}

template class Model<CudaBackend>;
static_assert(sizeof(CudaBackend::Act) == kCudaModelElements.act &&
              sizeof(CudaBackend::Acc) == kCudaModelElements.acc &&
              sizeof(CudaBackend::Master) == kCudaModelElements.master);

double cuda_peak_bf16_flops() {
  if (const char* forced = std::getenv("RINGATTN_PEAK_TFLOPS"); forced != nullptr) {
    return std::atof(forced) * 1e12;
  }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    return 0.0;
  }
  const std::string name = prop.name;
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) {
    return 989.4e12;
  }
  if (name.find("A100") != std::string::npos) return 312e12;
  return 0.0;
}

double cuda_device_memory_bytes() {
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    return 0.0;
  }
  return static_cast<double>(prop.totalGlobalMem);
}

double cuda_device_memory_in_use_bytes() {
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0.0;
  return static_cast<double>(total_bytes - free_bytes);
}

std::unique_ptr<TrainModel> make_cuda_model(const ModelConfig& config, std::int64_t batch,
                                            std::int64_t seq_len,
                                            std::shared_ptr<Communicator> cp_comm,
                                            SequenceLayoutKind layout, ModelOptions options,
                                            std::shared_ptr<Communicator> grad_comm) {
  return std::make_unique<Model<CudaBackend>>(config, batch, seq_len, std::move(cp_comm), layout,
                                              options, std::move(grad_comm));
}

}  // namespace ringattn::train
