// A program outside ringattn, built against its installed package and public headers only: the
// CPU flash block must agree with the fp64 reference on a small problem.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <random>
#include <vector>

#include <ringattn/attention.hpp>
#include <ringattn/error.hpp>

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

// Runs one mask through both implementations; returns the max |O_flash - O_reference|.
double compare(const ringattn::Mask& mask, std::mt19937_64& rng) {
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
  ringattn::cpu::flash_forward(args);

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
    // of keys, the last row all of them.
    const ringattn::Mask masks[] = {{false, 0, 0}, {true, 2, 0}};
    int status = 0;
    for (const ringattn::Mask& mask : masks) {
      const double difference = compare(mask, rng);
      const bool ok = difference <= kTolerance;
      std::printf("consumer: %-10s max |O_flash - O_reference| = %.3e (limit %.0e) %s\n",
                  mask.causal ? "causal" : "non-causal", difference, kTolerance,
                  ok ? "ok" : "FAILED");
      if (!ok) status = 1;
    }
    return status;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "consumer: %s\n", error.what());
    return 1;
  }
}
