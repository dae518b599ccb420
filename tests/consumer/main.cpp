// A program outside ringattn, built against its installed package and public headers only: the
// CPU flash block, called from C++ and through the C API (ringattn.h, its structs filled as a C
// caller fills them), must agree with the fp64 reference on a small problem.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include <ringattn/attention.hpp>
#include <ringattn/error.hpp>
#include <ringattn/ringattn.h>

namespace {

constexpr std::int64_t kBatch = 1, kQLen = 5, kKLen = 7, kQHeads = 2, kKvHeads = 1, kHeadDim = 8;
constexpr double kTolerance = 1e-12;

std::vector<double> random_values(std::size_t count, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  std::vector<double> values(count);
  for (double& value : values) value = normal(rng);
  return values;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double difference = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(a[i] - b[i]);
    // An element left unwritten (still NaN) fails the comparison outright.
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    difference = std::max(difference, d);
  }
  return difference;
}

// The C API's descriptor of a contiguous f64 host tensor.
ringattn_tensor_t describe(const ringattn::TensorView& t) {
  ringattn_tensor_t d{};
  d.data = t.data;
  d.dtype = RINGATTN_F64;
  d.memory = RINGATTN_HOST;
  d.rank = t.rank;
  for (int i = 0; i < t.rank; ++i) {
    d.shape[i] = t.shape[i];
    d.strides[i] = t.strides[i];
  }
  return d;
}

// The forward of `args` through ringattn_attention_forward; throws with the library's message.
void c_api_forward(const ringattn::ForwardArgs& args) {
  ringattn_forward_params_t p{};
  p.struct_size = sizeof(p);
  p.q = describe(args.q);
  p.k = describe(args.k);
  p.v = describe(args.v);
  p.o = describe(args.o);
  p.lse = describe(args.lse);
  p.scale = args.scale;
  p.causal = args.mask.causal ? 1 : 0;
  p.q_start = args.mask.q_start;
  p.k_start = args.mask.k_start;
  p.window_left = args.mask.window_left;
  p.window_right = args.mask.window_right;
  p.document_starts = args.mask.documents.data;
  p.num_documents = args.mask.documents.count;
  p.document_batch_stride = args.mask.documents.batch_stride;
  if (ringattn_attention_forward(&p, nullptr) != RINGATTN_SUCCESS) {
    throw std::runtime_error(ringattn_last_error());
  }
}

// Runs one mask through the block (from C++ or through the C API) and the reference; returns the
// max |O_flash - O_reference|.
double compare(const ringattn::Mask& mask, bool through_c_api, std::mt19937_64& rng) {
  using ringattn::DType;
  using ringattn::TensorView;
  std::vector<double> q = random_values(kBatch * kQLen * kQHeads * kHeadDim, rng);
  std::vector<double> k = random_values(kBatch * kKLen * kKvHeads * kHeadDim, rng);
  std::vector<double> v = random_values(kBatch * kKLen * kKvHeads * kHeadDim, rng);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> o_flash(q.size(), nan), o_reference(q.size(), nan);
  std::vector<double> lse_flash(kBatch * kQHeads * kQLen, nan);

  ringattn::ForwardArgs args;
  args.q = TensorView::contiguous(q.data(), DType::f64, {kBatch, kQLen, kQHeads, kHeadDim});
  args.k = TensorView::contiguous(k.data(), DType::f64, {kBatch, kKLen, kKvHeads, kHeadDim});
  args.v = TensorView::contiguous(v.data(), DType::f64, {kBatch, kKLen, kKvHeads, kHeadDim});
  args.o = TensorView::contiguous(o_flash.data(), DType::f64, {kBatch, kQLen, kQHeads, kHeadDim});
  args.lse = TensorView::contiguous(lse_flash.data(), DType::f64, {kBatch, kQHeads, kQLen});
  args.scale = ringattn::default_scale(kHeadDim);
  args.mask = mask;
  if (through_c_api) {
    c_api_forward(args);
  } else {
    ringattn::cpu::flash_forward(args);
  }

  const TensorView o_ref =
      TensorView::contiguous(o_reference.data(), DType::f64, {kBatch, kQLen, kQHeads, kHeadDim});
  const TensorView no_lse = TensorView::contiguous(nullptr, DType::f64, {kBatch, kQHeads, kQLen});
  ringattn::reference::attention_forward(args.q, args.k, args.v, mask, args.scale, o_ref, no_lse);
  return max_abs_difference(o_flash, o_reference);
}

}  // namespace

int main() {
  try {
    std::mt19937_64 rng(20260101);
    // Causal with the Q rows two positions after the K rows: every row sees a different number
    // of keys, the last row all of them. Then a window of 3 within two documents (keys at
    // positions 0-3 and 4-6).
    const std::int64_t starts[] = {0, 4};
    ringattn::Mask windowed{true, 2, 0, 3, 0};
    windowed.documents = {starts, 2, 0};
    struct Case {
      const char* name;
      ringattn::Mask mask;
      bool through_c_api;
    };
    const Case cases[] = {{"non-causal", {false, 0, 0}, false},
                          {"causal", {true, 2, 0}, false},
                          {"causal (C API)", {true, 2, 0}, true},
                          {"window and documents (C API)", windowed, true}};
    int status = 0;
    for (const Case& c : cases) {
      const double difference = compare(c.mask, c.through_c_api, rng);
      const bool ok = difference <= kTolerance;
      std::printf("consumer: %-28s max |O_flash - O_reference| = %.3e (limit %.0e) %s\n", c.name,
                  difference, kTolerance, ok ? "ok" : "FAILED");
      if (!ok) status = 1;
    }
    return status;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "consumer: %s\n", error.what());
    return 1;
  }
}
