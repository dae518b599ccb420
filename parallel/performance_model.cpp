#include "parallel/performance_model.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <system_error>

#include "parallel/ring_attention.hpp"
#include "parallel/sequence_layout.hpp"
#include "ringattn/error.hpp"
#include "src/mask_rule.hpp"

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

namespace {

// `text` as a whole number >= lo, or Error naming the part of `description` it came from.
std::int64_t whole_number(std::string_view text, std::int64_t lo, const char* part,
                          std::string_view description) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size() || value < lo) {
    detail::fail("document_starts", "documents '", description, "': ", part, " is '", text,
                 "'; expected a whole number >= ", lo);
  }
  return value;
}

std::vector<std::int64_t> lognormal_starts(std::int64_t seq, std::int64_t mean, std::uint64_t seed,
                                           std::int64_t long_length) {
  // sigma 1: a mean of MEAN tokens is a median of MEAN / e^(1/2), about 0.61 MEAN.
  constexpr double kSigma = 1.0;
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> length(
      std::log(static_cast<double>(mean)) - kSigma * kSigma / 2, kSigma);
  std::vector<std::int64_t> lengths;
  std::int64_t filled = 0;
  while (filled < seq) {
    const auto next = std::max<std::int64_t>(1, std::llround(length(rng)));
    lengths.push_back(next);
    filled += next;
  }
  if (long_length > 0) {
    // Before a document that starts early enough for the long one to end within the sequence.
    std::size_t fitting = 1;
    for (std::int64_t start = lengths[0]; fitting < lengths.size() && start <= seq - long_length;
         start += lengths[fitting++]) {
    }
    std::uniform_int_distribution<std::size_t> place(0, fitting - 1);
    lengths.insert(lengths.begin() + static_cast<std::ptrdiff_t>(place(rng)), long_length);
  }
  std::vector<std::int64_t> starts;
  for (std::int64_t start = 0, i = 0; start < seq; start += lengths[i++]) starts.push_back(start);
  return starts;
}

std::vector<std::int64_t> file_starts(const std::string& path, std::string_view description) {
  std::ifstream in(path);
  if (!in) detail::fail("document_starts", "documents '", description, "': cannot read ", path);
  std::vector<std::int64_t> starts;
  std::string token;
  for (char c; in.get(c);) {
    const bool separator = c == ' ' || c == ',' || c == '\n' || c == '\t' || c == '\r';
    if (!separator) token += c;
    if ((separator || in.peek() == EOF) && !token.empty()) {
      starts.push_back(whole_number(token, 0, "a start", description));
      if (starts.size() > 1 && starts.back() < starts[starts.size() - 2]) {
        detail::fail("document_starts", "documents '", description, "': start ", starts.size() - 1,
                     " is ", starts.back(), ", below the one before (", starts[starts.size() - 2],
                     "); expected non-decreasing positions");
      }
      token.clear();
    }
  }
  return starts;
}

}  // namespace

std::vector<std::int64_t> document_starts(std::string_view description, std::int64_t seq) {
  std::vector<std::string_view> parts;
  for (std::size_t begin = 0;;) {
    const std::size_t colon = description.find(':', begin);
    parts.push_back(description.substr(begin, colon - begin));
    if (colon == std::string_view::npos) break;
    begin = colon + 1;
  }
  if (parts[0] == "lognormal" && (parts.size() == 3 || parts.size() == 4)) {
    const std::int64_t mean = whole_number(parts[1], 1, "MEAN", description);
    const std::int64_t seed = whole_number(parts[2], 0, "SEED", description);
    const std::int64_t long_length =
        parts.size() == 4 ? whole_number(parts[3], 1, "LONG", description) : 0;
    return lognormal_starts(seq, mean, static_cast<std::uint64_t>(seed), long_length);
  }
  if (parts[0] == "file" && parts.size() >= 2) {
    return file_starts(std::string(description.substr(5)), description);
  }
  detail::fail("document_starts", "documents '", description,
               "'; expected lognormal:MEAN:SEED, lognormal:MEAN:SEED:LONG or file:PATH");
}

RingBalance ring_balance(SequenceLayoutKind layout, int ranks, std::int64_t seq, const Mask& mask) {
  RingBalance balance;
  Mask row = mask;
  row.documents.batch_stride = 0;  // one batch row: the first list
  const SequenceLayout first = call_layout(layout, ranks, 0, seq, RingMask{row, 1});
  balance.layout = first.describe();
  balance.layout.erase(balance.layout.rfind(", rank 0"));
  balance.steps = ring_steps(first, RingMask{row, 1});
  const detail::MaskRule rule = detail::MaskRule::of(row);
  for (int rank = 0; rank < ranks; ++rank) {
    double pairs = 0;
    for (const SequenceChunk& chunk : first.for_rank(rank).chunks()) {
      for (std::int64_t i = chunk.global_start; i < chunk.global_start + chunk.length; ++i) {
        const detail::PositionInterval keys = rule.keys_of(i);
        pairs += static_cast<double>(std::max<std::int64_t>(
            0, std::min(keys.end, seq) - std::max<std::int64_t>(keys.begin, 0)));
      }
    }
    balance.visible_pairs.push_back(pairs);
    balance.mean += pairs / ranks;
    balance.max = std::max(balance.max, pairs);
  }
  return balance;
}

}  // namespace ringattn
