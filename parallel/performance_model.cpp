#include "parallel/performance_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ringattn/error.hpp"

namespace ringattn {

RingPlan plan_ring(const RingPlanInput& in) {
  constexpr const char* kWhere = "plan_ring";
  if (in.ranks < 1) detail::fail(kWhere, "ranks is ", in.ranks, "; expected >= 1");
  const std::int64_t divisor = in.zigzag ? 2 * in.ranks : in.ranks;
  if (in.seq < 1 || in.seq % divisor != 0) {
    detail::fail(kWhere, "seq is ", in.seq, "; expected a positive multiple of ", divisor,
                 in.zigzag ? " (2 x ranks, zigzag)" : " (ranks, contiguous)");
  }
  if (in.heads < 1 || in.kv_heads < 1 || in.heads % in.kv_heads != 0) {
    detail::fail(kWhere, "heads ", in.heads, " and kv_heads ", in.kv_heads,
                 "; expected positive with heads % kv_heads == 0");
  }
  if (in.head_dim < 1) detail::fail(kWhere, "head_dim is ", in.head_dim, "; expected >= 1");
  if (!(in.attention_tflops > 0) || !(in.link_gbytes_per_s > 0) || !(in.memory_gib > 0)) {
    detail::fail(kWhere, "attention_tflops, link_gbytes_per_s and memory_gib must be > 0");
  }
  if (in.element_bytes != 2 && in.element_bytes != 4) {
    detail::fail(kWhere, "element_bytes is ", in.element_bytes, "; expected 2 (bf16/f16) or 4");
  }

  RingPlan p;
  const double c = static_cast<double>(in.seq / in.ranks), d = in.head_dim;
  const double h = in.heads, hkv = in.kv_heads, e = in.element_bytes;
  const double flops = in.attention_tflops * 1e12, bandwidth = in.link_gbytes_per_s * 1e9;
  p.tokens_per_rank = in.seq / in.ranks;
  // A step after the first: a full block (4 c^2 d h FLOPs), or half of it on a zigzag causal ring.
  const double visible = in.causal && in.zigzag ? 0.5 : 1.0;
  const double step_flops = 4.0 * c * c * d * h * visible;
  const double kv_bytes = 2.0 * c * d * hkv * e;     // K and V of one shard
  const double dkv_bytes = 2.0 * c * d * hkv * 4.0;  // fp32 dK and dV travelling with them
  p.forward_compute_ms = step_flops / flops * 1e3;
  p.forward_transfer_ms = kv_bytes / bandwidth * 1e3;
  p.backward_compute_ms = 2.5 * step_flops / flops * 1e3;
  p.backward_transfer_ms = (kv_bytes + dkv_bytes) / bandwidth * 1e3;
  p.forward_hidden = p.forward_transfer_ms <= p.forward_compute_ms;
  p.backward_hidden = p.backward_transfer_ms <= p.backward_compute_ms;
  // compute >= transfer  <=>  c >= (bytes per token) F / (4 c-free FLOPs per token^2).
  p.forward_min_tokens_per_rank = (2.0 * d * hkv * e) * flops / (4.0 * d * h * visible * bandwidth);
  p.backward_min_tokens_per_rank =
      (2.0 * d * hkv * (e + 4.0)) * flops / (2.5 * 4.0 * d * h * visible * bandwidth);

  // Per local token: q, o, dout (h heads) and k, v (h_kv) in the input dtype; fp32 running O and
  // dq (h), dk, dv (h_kv); LSE and delta (h); ring buffers: 2 x K/V (h_kv, input dtype) and
  // 2 x fp32 dK/dV accumulators plus the step's dK/dV (h_kv).
  const double per_token = 3 * h * d * e + 2 * hkv * d * e + 2 * h * d * 4.0 + 2 * hkv * d * 4.0 +
                           2 * h * 4.0 + 2 * 2 * hkv * d * e + 3 * 2 * hkv * d * 4.0;
  p.bytes_per_local_token = per_token;
  const double budget = in.memory_gib * 1024.0 * 1024.0 * 1024.0;
  const auto fitting_local = static_cast<std::int64_t>(std::floor(budget / per_token));
  p.longest_seq = fitting_local * in.ranks / divisor * divisor;
  return p;
}

double attention_forward_flops(std::int64_t batch, std::int64_t heads, std::int64_t seq,
                               std::int64_t head_dim, bool causal) {
  const double s = static_cast<double>(seq);
  return 4.0 * static_cast<double>(batch) * static_cast<double>(heads) * s * s *
         static_cast<double>(head_dim) * (causal ? 0.5 : 1.0);
}

double ring_efficiency(double one_gpu_time, int ranks, double ring_time) {
  return one_gpu_time / (ranks * ring_time);
}

double hidden_share(double ring_time, double compute_alone, double transfers_alone) {
  if (!(transfers_alone > 0)) return std::numeric_limits<double>::quiet_NaN();
  return std::clamp(1.0 - (ring_time - compute_alone) / transfers_alone, 0.0, 1.0);
}

}  // namespace ringattn
