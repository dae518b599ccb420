// The CUDA flash block's test problems: one case's inputs in a 16-bit dtype on the device (or
// packed into one QKV buffer), a forward and backward with every output poisoned, and the fp64
// oracle and the low-precision baseline of the FlashAttention criterion (TESTING.md) on the same
// rounded inputs. Used by the gpu tests of kernels/ (include only where RINGATTN_WITH_CUDA).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringattn/attention.hpp"
#include "src/cuda/device_buffer.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/head_dims.hpp"
#include "tests/common/low_precision_attention.hpp"

namespace ringattn::test {

struct Case {
  DType dtype;
  std::int64_t batch, q_len, k_len, q_heads, kv_heads, head_dim;
  bool causal;
  std::int64_t q_start = 0, k_start = 0;
  bool packed = false;      // Q, K, V as views of one [B, S, Hq + 2 Hkv, D] buffer
  double input_scale = 1.0;  // large values give scores near 1e4
  double softmax_scale = 0.0;  // 0: 1/sqrt(head_dim)
  // Sliding window and packed documents (Mask): `documents` holds every batch row's list
  // (document_stride apart; 0: one list for all), uploaded for the kernels.
  std::int64_t window_left = 0, window_right = 0;
  std::vector<std::int64_t> documents = {};
  std::int64_t document_stride = 0;
  const char* label = nullptr;  // the case's name, when its mask needs one
  // V, O, dO and dV of v_head_dim columns (0: head_dim), as multi-head latent attention's 192/128.
  std::int64_t v_head_dim = 0;

  std::int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};

// `c` with V, O, dO and dV of `dims.v_head_dim` columns and Q, K of `dims.head_dim`.
inline Case with_dims(Case c, const CudaDims& dims) {
  c.head_dim = dims.head_dim;
  c.v_head_dim = dims.v_head_dim;
  return c;
}

inline std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string name = std::string(dtype_name(c.dtype)) + (c.label ? std::string("_") + c.label : "") + "_b" + std::to_string(c.batch) + "_sq" +
                     std::to_string(c.q_len) + "_sk" + std::to_string(c.k_len) + "_h" +
                     std::to_string(c.q_heads) + "x" + std::to_string(c.kv_heads) + "_d" +
                     std::to_string(c.head_dim);
  if (c.value_dim() != c.head_dim) name += std::string("_v") + std::to_string(c.value_dim());
  name += c.causal ? "_causal" : "_full";
  if (c.q_start != 0 || c.k_start != 0) name += "_q" + std::to_string(c.q_start) + "k" + std::to_string(c.k_start);
  if (c.packed) name += "_packed";
  if (c.input_scale != 1.0) name += "_x" + std::to_string(static_cast<int>(c.input_scale));
  return name;
}

// A device copy of logical [B, S, H, D] values in a 16-bit dtype, or a view into a shared buffer.
inline std::vector<std::uint16_t> to_bits(DType dtype, const std::vector<double>& values) {
  std::vector<std::uint16_t> bits(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float f = static_cast<float>(values[i]);
    bits[i] = dtype == DType::bf16 ? float_to_bf16(f) : float_to_f16(f);
  }
  return bits;
}

inline std::vector<double> random_rounded(DType dtype, std::size_t count, std::mt19937_64& rng, double scale) {
  std::vector<double> values = normal_vector<double>(count, rng, scale);
  for (double& value : values) value = round_to(dtype, value);
  return values;
}

template <typename T>
inline std::vector<T> download(const DeviceBuffer& buffer, std::size_t count) {
  std::vector<T> host(count);
  RINGATTN_CUDA_CHECK(cudaMemcpy(host.data(), buffer.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

inline std::vector<double> widen(DType dtype, const std::vector<std::uint16_t>& bits) {
  std::vector<double> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    out[i] = dtype == DType::bf16 ? bf16_to_float(bits[i]) : f16_to_float(bits[i]);
  }
  return out;
}

inline std::vector<double> widen(const std::vector<float>& values) { return {values.begin(), values.end()}; }

// Everything one case needs on the device, and the results brought back.
struct DeviceProblem {
  Case c;
  AttentionShape s;
  std::vector<double> q, k, v, dout;  // logical values, exactly representable in c.dtype
  DeviceBuffer qkv, k_only, v_only, dout_buffer, o, lse, delta, dq, dk, dv, document_buffer;
  TensorView q_view, k_view, v_view, o_view, lse_view, dout_view, delta_view, dq_view, dk_view, dv_view;

  // Random inputs drawn from `stream`: q and k of magnitude c.input_scale, v and dout N(0, 1);
  // v and dout of c.value_dim() columns.
  DeviceProblem(const Case& cs, std::uint64_t stream) : DeviceProblem(cs, random_inputs(cs, stream)) {}

  // Given logical values, each representable in c.dtype: {q, k, v, dout}.
  DeviceProblem(const Case& cs, std::array<std::vector<double>, 4> inputs)
      : c(cs), q(std::move(inputs[0])), k(std::move(inputs[1])), v(std::move(inputs[2])),
        dout(std::move(inputs[3])) {
    s = {c.batch, c.q_len, c.k_len, c.q_heads, c.kv_heads, c.head_dim, c.value_dim()};
    const std::int64_t B = c.batch, Sq = c.q_len, Sk = c.k_len, Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
    const std::int64_t Dv = c.value_dim();
    const std::size_t two = 2;
    if (c.packed) {
      // [B, S, Hq D + Hkv D + Hkv Dv]: Q heads, then K heads, then V heads of each token.
      const std::int64_t row_len = (Hq + Hkv) * D + Hkv * Dv;
      std::vector<std::uint16_t> packed(B * Sq * row_len);
      const auto qb = to_bits(c.dtype, q), kb = to_bits(c.dtype, k), vb = to_bits(c.dtype, v);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < Sq; ++t) {
          std::uint16_t* row = &packed[(b * Sq + t) * row_len];
          std::memcpy(row, &qb[(b * Sq + t) * Hq * D], Hq * D * two);
          std::memcpy(row + Hq * D, &kb[(b * Sq + t) * Hkv * D], Hkv * D * two);
          std::memcpy(row + (Hq + Hkv) * D, &vb[(b * Sq + t) * Hkv * Dv], Hkv * Dv * two);
        }
      qkv = DeviceBuffer(packed.size() * two);
      RINGATTN_CUDA_CHECK(cudaMemcpy(qkv.data(), packed.data(), packed.size() * two, cudaMemcpyHostToDevice));
      auto view = [&](std::int64_t offset, std::int64_t heads, std::int64_t width) {
        TensorView t = TensorView::contiguous(qkv.as<std::uint16_t>() + offset, c.dtype,
                                              {B, Sq, heads, width}, Memory::device);
        return t.with_strides({Sq * row_len, row_len, width, 1});
      };
      q_view = view(0, Hq, D);
      k_view = view(Hq * D, Hkv, D);
      v_view = view((Hq + Hkv) * D, Hkv, Dv);
    } else {
      q_view = upload(qkv, q, {B, Sq, Hq, D});
      k_view = upload(k_only, k, {B, Sk, Hkv, D});
      v_view = upload(v_only, v, {B, Sk, Hkv, Dv});
    }
    dout_view = upload(dout_buffer, dout, {B, Sq, Hq, Dv});
    o = DeviceBuffer(B * Sq * Hq * Dv * two);
    o_view = TensorView::contiguous(o.data(), c.dtype, {B, Sq, Hq, Dv}, Memory::device);
    lse = DeviceBuffer(B * Hq * Sq * sizeof(float));
    lse_view = TensorView::contiguous(lse.data(), DType::f32, {B, Hq, Sq}, Memory::device);
    delta = DeviceBuffer(B * Hq * Sq * sizeof(float));
    delta_view = TensorView::contiguous(delta.data(), DType::f32, {B, Hq, Sq}, Memory::device);
    dq = DeviceBuffer(B * Sq * Hq * D * sizeof(float));
    dk = DeviceBuffer(B * Sk * Hkv * D * sizeof(float));
    dv = DeviceBuffer(B * Sk * Hkv * Dv * sizeof(float));
    dq_view = TensorView::contiguous(dq.data(), DType::f32, {B, Sq, Hq, D}, Memory::device);
    dk_view = TensorView::contiguous(dk.data(), DType::f32, {B, Sk, Hkv, D}, Memory::device);
    dv_view = TensorView::contiguous(dv.data(), DType::f32, {B, Sk, Hkv, Dv}, Memory::device);
    if (!c.documents.empty()) {
      document_buffer = DeviceBuffer(c.documents.size() * sizeof(std::int64_t));
      RINGATTN_CUDA_CHECK(cudaMemcpy(document_buffer.data(), c.documents.data(),
                                     c.documents.size() * sizeof(std::int64_t),
                                     cudaMemcpyHostToDevice));
    }
  }

  static std::array<std::vector<double>, 4> random_inputs(const Case& c, std::uint64_t stream) {
    std::mt19937_64 rng = make_rng(stream);
    const std::int64_t B = c.batch, Sq = c.q_len, Sk = c.k_len, Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
    const std::int64_t Dv = c.value_dim();
    std::array<std::vector<double>, 4> inputs;
    inputs[0] = random_rounded(c.dtype, B * Sq * Hq * D, rng, c.input_scale);
    inputs[1] = random_rounded(c.dtype, B * Sk * Hkv * D, rng, c.input_scale);
    inputs[2] = random_rounded(c.dtype, B * Sk * Hkv * Dv, rng, 1.0);
    inputs[3] = random_rounded(c.dtype, B * Sq * Hq * Dv, rng, 1.0);
    return inputs;
  }

  TensorView upload(DeviceBuffer& buffer, const std::vector<double>& values,
                    std::initializer_list<std::int64_t> shape) {
    const auto bits = to_bits(c.dtype, values);
    buffer = DeviceBuffer(bits.size() * 2);
    RINGATTN_CUDA_CHECK(cudaMemcpy(buffer.data(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    return TensorView::contiguous(buffer.data(), c.dtype, shape, Memory::device);
  }

  // The mask with the document starts on the host (the oracle, the baseline) or on the device
  // (the kernels).
  Mask mask() const { return mask_with(c.documents.data()); }
  Mask device_mask() const { return mask_with(document_buffer.as<const std::int64_t>()); }
  Mask mask_with(const std::int64_t* starts) const {
    Mask m{c.causal, c.q_start, c.k_start, c.window_left, c.window_right};
    if (!c.documents.empty()) {
      const std::int64_t rows = c.document_stride > 0 ? c.batch : 1;
      m.documents = {starts, static_cast<std::int64_t>(c.documents.size()) / rows, c.document_stride};
    }
    return m;
  }
  double scale() const { return c.softmax_scale > 0.0 ? c.softmax_scale : default_scale(c.head_dim); }

  // Forward, prepare and backward with every output poisoned (NaN), dQ too (the prepare zeroes
  // it), and dK and dV zeroed; overwrite: dK and dV poisoned too, and the backward asked to
  // overwrite them.
  AttentionResult run(bool deterministic, bool overwrite = false, bool rounded = false,
                      const KeyRotation& rotation = {}) {
    RINGATTN_CUDA_CHECK(cudaMemset(o.data(), 0xff, o.bytes()));
    RINGATTN_CUDA_CHECK(cudaMemset(lse.data(), 0xff, lse.bytes()));
    RINGATTN_CUDA_CHECK(cudaMemset(delta.data(), 0xff, delta.bytes()));
    RINGATTN_CUDA_CHECK(cudaMemset(dq.data(), 0xff, dq.bytes()));
    RINGATTN_CUDA_CHECK(cudaMemset(dk.data(), overwrite ? 0xff : 0, dk.bytes()));
    RINGATTN_CUDA_CHECK(cudaMemset(dv.data(), overwrite ? 0xff : 0, dv.bytes()));
    cuda::flash_forward({q_view, k_view, v_view, o_view, lse_view, scale(), device_mask(), false});
    cuda::flash_backward_prepare(o_view, dout_view, delta_view, nullptr, &dq_view);
    BackwardArgs args{q_view, k_view, v_view, dout_view, lse_view, delta_view,
                      dq_view, dk_view, dv_view, scale(), device_mask(), deterministic};
    args.overwrite_key_gradients = overwrite;
    args.key_rotation = rotation;
    if (rounded) {  // dK and dV in the input dtype, in the front halves of the poisoned buffers
      args.dk = TensorView::contiguous(dk.data(), c.dtype, {c.batch, c.k_len, c.kv_heads, c.head_dim},
                                       Memory::device);
      args.dv = TensorView::contiguous(dv.data(), c.dtype, {c.batch, c.k_len, c.kv_heads, c.value_dim()},
                                       Memory::device);
    }
    cuda::flash_backward(args);
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    AttentionResult r;
    r.o = widen(c.dtype, download<std::uint16_t>(o, o_view.numel()));
    r.lse = widen(download<float>(lse, lse_view.numel()));
    r.dq = widen(download<float>(dq, dq_view.numel()));
    if (rounded) {
      r.dk = widen(c.dtype, download<std::uint16_t>(dk, dk_view.numel()));
      r.dv = widen(c.dtype, download<std::uint16_t>(dv, dv_view.numel()));
    } else {
      r.dk = widen(download<float>(dk, dk_view.numel()));
      r.dv = widen(download<float>(dv, dv_view.numel()));
    }
    return r;
  }

  AttentionResult oracle() const {
    AttentionResult r;
    const std::int64_t B = c.batch, Sq = c.q_len, Sk = c.k_len, Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
    const std::int64_t Dv = c.value_dim();
    r.o.resize(B * Sq * Hq * Dv);
    r.lse.resize(B * Hq * Sq);
    r.dq.resize(B * Sq * Hq * D);
    r.dk.resize(B * Sk * Hkv * D);
    r.dv.resize(B * Sk * Hkv * Dv);
    auto view = [](const std::vector<double>& data, std::initializer_list<std::int64_t> shape) {
      return TensorView::contiguous(const_cast<double*>(data.data()), DType::f64, shape);
    };
    reference::attention_forward(view(q, {B, Sq, Hq, D}), view(k, {B, Sk, Hkv, D}), view(v, {B, Sk, Hkv, Dv}),
                                 mask(), scale(), view(r.o, {B, Sq, Hq, Dv}), view(r.lse, {B, Hq, Sq}));
    reference::attention_backward(view(q, {B, Sq, Hq, D}), view(k, {B, Sk, Hkv, D}), view(v, {B, Sk, Hkv, Dv}),
                                  view(dout, {B, Sq, Hq, Dv}), mask(), scale(), view(r.dq, {B, Sq, Hq, D}),
                                  view(r.dk, {B, Sk, Hkv, D}), view(r.dv, {B, Sk, Hkv, Dv}));
    return r;
  }

  AttentionResult low() const {
    return low_precision_attention(s, c.dtype, q, k, v, dout, mask(), scale());
  }
};


inline void expect_within_criterion(const AttentionResult& out, const AttentionResult& low,
                             const AttentionResult& ref) {
  EXPECT_TRUE(WithinFlashCriterion("O", out.o, low.o, ref.o));
  EXPECT_TRUE(WithinFlashCriterion("LSE", out.lse, low.lse, ref.lse));
  EXPECT_TRUE(WithinFlashCriterion("dQ", out.dq, low.dq, ref.dq));
  EXPECT_TRUE(WithinFlashCriterion("dK", out.dk, low.dk, ref.dk));
  EXPECT_TRUE(WithinFlashCriterion("dV", out.dv, low.dv, ref.dv));
}

// A case against the oracle with the FlashAttention criterion, through the backward with atomic
// dQ and through the deterministic one, each output poisoned (DeviceProblem::run).
inline void expect_case_within_criterion(const Case& c, std::uint64_t stream) {
  DeviceProblem problem(c, stream);
  const AttentionResult ref = problem.oracle();
  const AttentionResult low = problem.low();
  {
    SCOPED_TRACE("atomic dQ");
    expect_within_criterion(problem.run(false), low, ref);
  }
  {
    SCOPED_TRACE("deterministic");
    expect_within_criterion(problem.run(true), low, ref);
  }
}

}  // namespace ringattn::test
