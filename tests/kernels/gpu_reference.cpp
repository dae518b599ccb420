// The streaming GPU reference against the fp64 oracle: fp32 inputs, fp32 arithmetic, so the
// relative error stays under 1e-5 (TESTING.md's fp32 criterion) on every output; V of the head dim
// of Q and K and of one of its own (narrower and wider).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/gpu.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/device_buffer.hpp"

namespace ringattn::test {
namespace {

struct RefCase {
  std::int64_t batch, q_len, k_len, q_heads, kv_heads, head_dim;
  bool causal;
  std::int64_t q_start, k_start;
  std::int64_t v_head_dim = 0;  // 0: head_dim
};

double relative_error(const std::vector<float>& out, const std::vector<double>& ref) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (out[i] != ref[i]) return INFINITY;
      continue;
    }
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::isnan(diff) ? INFINITY : std::sqrt(diff / norm);
}

class GpuReference : public ::testing::TestWithParam<RefCase> {
 protected:
  void SetUp() override { RINGATTN_REQUIRE_GPUS(1); }
};

TEST_P(GpuReference, MatchesTheFp64Oracle) {
  SCOPED_TRACE(seed_trace());
  const RefCase c = GetParam();
  const std::int64_t B = c.batch, Sq = c.q_len, Sk = c.k_len, Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  const std::int64_t Dv = c.v_head_dim > 0 ? c.v_head_dim : D;
  std::mt19937_64 rng = make_rng(11);
  std::vector<float> q = normal_vector<float>(B * Sq * Hq * D, rng), k = normal_vector<float>(B * Sk * Hkv * D, rng),
                     v = normal_vector<float>(B * Sk * Hkv * Dv, rng), g = normal_vector<float>(B * Sq * Hq * Dv, rng);
  const Mask mask{c.causal, c.q_start, c.k_start};
  const double scale = default_scale(D);

  auto upload = [](const std::vector<float>& host) {
    DeviceBuffer buffer(host.size() * sizeof(float));
    RINGATTN_CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
    return buffer;
  };
  DeviceBuffer dq_in = upload(q), dk_in = upload(k), dv_in = upload(v), dg = upload(g);
  DeviceBuffer o(g.size() * 4), lse(B * Hq * Sq * 4), delta(B * Hq * Sq * 4), dq(q.size() * 4), dk(k.size() * 4),
      dv(v.size() * 4);
  for (DeviceBuffer* b : {&o, &lse, &delta, &dq, &dk, &dv}) RINGATTN_CUDA_CHECK(cudaMemset(b->data(), 0xff, b->bytes()));
  auto dev = [](const DeviceBuffer& b, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(b.data(), DType::f32, shape, Memory::device);
  };
  cuda::reference_forward(dev(dq_in, {B, Sq, Hq, D}), dev(dk_in, {B, Sk, Hkv, D}), dev(dv_in, {B, Sk, Hkv, Dv}),
                          mask, scale, dev(o, {B, Sq, Hq, Dv}), dev(lse, {B, Hq, Sq}));
  cuda::reference_backward(dev(dq_in, {B, Sq, Hq, D}), dev(dk_in, {B, Sk, Hkv, D}), dev(dv_in, {B, Sk, Hkv, Dv}),
                           dev(o, {B, Sq, Hq, Dv}), dev(lse, {B, Hq, Sq}), dev(dg, {B, Sq, Hq, Dv}), mask, scale,
                           dev(delta, {B, Hq, Sq}), dev(dq, {B, Sq, Hq, D}), dev(dk, {B, Sk, Hkv, D}),
                           dev(dv, {B, Sk, Hkv, Dv}));
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  auto download = [](const DeviceBuffer& b) {
    std::vector<float> host(b.bytes() / 4);
    RINGATTN_CUDA_CHECK(cudaMemcpy(host.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost));
    return host;
  };

  std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end()), g64(g.begin(), g.end());
  std::vector<double> o_ref(g.size()), lse_ref(B * Hq * Sq), dq_ref(q.size()), dk_ref(k.size()), dv_ref(v.size());
  auto host = [](std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.data(), DType::f64, shape);
  };
  reference::attention_forward(host(q64, {B, Sq, Hq, D}), host(k64, {B, Sk, Hkv, D}), host(v64, {B, Sk, Hkv, Dv}),
                               mask, scale, host(o_ref, {B, Sq, Hq, Dv}), host(lse_ref, {B, Hq, Sq}));
  reference::attention_backward(host(q64, {B, Sq, Hq, D}), host(k64, {B, Sk, Hkv, D}), host(v64, {B, Sk, Hkv, Dv}),
                                host(g64, {B, Sq, Hq, Dv}), mask, scale, host(dq_ref, {B, Sq, Hq, D}),
                                host(dk_ref, {B, Sk, Hkv, D}), host(dv_ref, {B, Sk, Hkv, Dv}));
  EXPECT_LT(relative_error(download(o), o_ref), 1e-5);
  EXPECT_LT(relative_error(download(lse), lse_ref), 1e-5);
  EXPECT_LT(relative_error(download(dq), dq_ref), 1e-5);
  EXPECT_LT(relative_error(download(dk), dk_ref), 1e-5);
  EXPECT_LT(relative_error(download(dv), dv_ref), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuReference,
                         ::testing::Values(RefCase{2, 17, 17, 4, 4, 64, false, 0, 0},
                                           RefCase{1, 300, 300, 8, 2, 128, true, 0, 0},
                                           RefCase{1, 200, 333, 4, 1, 96, true, 133, 0},
                                           RefCase{1, 100, 150, 2, 2, 32, true, 0, 80},
                                           RefCase{1, 257, 257, 4, 2, 192, true, 0, 0, 128},
                                           RefCase{2, 65, 90, 2, 1, 64, false, 0, 0, 96}));

}  // namespace
}  // namespace ringattn::test

#else

TEST(GpuReference, NeedsTheCudaBackend) { RINGATTN_REQUIRE_GPUS(1); }

#endif
