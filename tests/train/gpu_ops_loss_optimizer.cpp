// The trainer's loss and optimizer ops on the GPU (train/cuda/ops_loss_optimizer.cu) against their
// CPU twins (train/op_cross_entropy, train/op_adamw) on the same values:
//
//   cross-entropy  vocabularies of 256 to 131072 entries (1003: rows start at every alignment;
//                  12296: a row that ends mid-way through the threads' last vectors; up to 32768
//                  the rows staged in shared memory, 65536 and 131072 read twice), weights
//                  with zeros, ties for the argmax: the losses, the predictions, the sums, the
//                  gradient out of place (vector and scalar paths) and in place; an
//                  out-of-range target; NaN and infinite logits on both kernels;
//   sum_of_squares against a long-double sum, and bitwise the same twice;
//   adamw_step     five steps with and without decay, grad_scale != 1, against the twin fed the
//                  scaled gradient; the bf16 copy; one call over 70 consecutive tensors against
//                  the twin tensor by tensor; the clip formed on the device
//                  (queue_clip_factor, adamw_step_clipped) against the host's, bitwise, and
//                  skipped on a NaN;
//   the argument checks (on the host: no GPU needed).
//
// Tolerances:
//   losses: |out - ref| <= 1e-5 max(1, |ref|). The GPU sums exp(x - max) in fp32 (at most 256
//     terms a thread, then a tree of 9 levels): relative error <= ~265 2^-24 = 1.6e-5 at worst
//     over 131072 entries, ~1e-7 typically, plus ~2^-21 from its exp (ex2.approx, and the
//     rounding of max log2(e): ~1e-6 at these logits) on the terms that matter; the twin sums in
//     double. The loss is lse - x[target]
//     with lse ~ 5..16 here, so an absolute lse error of 2e-5 is within 1e-5 |loss|. The logits
//     are bf16 values, exact in fp32, so both sides see the same inputs. loss_sum: relative 1e-5.
//   gradient: |out - ref| <= 2^-8 |ref| + 2^-14 (|ref| + weight scale). bf16 rounding of the
//     fp32 value (unit roundoff 2^-8), plus the fp32 disagreement: exp(x - lse) inherits lse's
//     error (<= 2e-5 < 2^-14, relative), and the target entry (p - 1) * factor loses it against
//     factor = weight * scale, not against its own size.
//   adamw: the kernel repeats the twin's fp32 operations without contraction, so params, m and v
//     are expected bit for bit; checked within 4 ulp. The bf16 copy is bf16(params), bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ringattn/config.h"
#include "tests/common/gpu.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ringattn/dtype.hpp"
#include "ringattn/error.hpp"
#include "src/cuda/device_buffer.hpp"
#include "tests/common/bf16_testing.hpp"
#include "tests/common/op_testing.hpp"
#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "train/cuda/ops.hpp"
#include "train/op_adamw.hpp"
#include "train/op_cross_entropy.hpp"

namespace ringattn::train {
namespace {

using cuda::bf16;
using test::Bits;
using test::BitwiseEqual;
using test::download;
using test::download_bf16;
using test::kBf16Unit;
using test::random_bf16;
using test::to_device;
using test::upload;
using test::widen;

constexpr double kGradientSlack = 0x1p-14;  // fp32 disagreement of the gradient
constexpr double kLossTolerance = 1e-5;

// ---- device buffers -------------------------------------------------------------------------

// All bytes 0xff: NaN as fp32 and as bf16, -1 as int32. An output that still holds it was not
// written.
void poison(void* device, std::size_t bytes, cudaStream_t stream) {
  RINGATTN_CUDA_CHECK(cudaMemsetAsync(device, 0xff, bytes, stream));
}

// ---- cross-entropy --------------------------------------------------------------------------

struct CrossEntropyCase {
  std::int64_t tokens, vocab;
};

// The inputs of one case, with ties for the argmax planted in rows 0 and 1 and a zero weight on
// every fourth token.
struct CrossEntropyInputs {
  Bits logits;
  std::vector<std::int32_t> targets;
  std::vector<float> weights;
  double scale = 0.0;  // 1 / the sum of weights: the mean over weighted tokens
};

CrossEntropyInputs make_inputs(const CrossEntropyCase& c, std::mt19937_64& rng) {
  CrossEntropyInputs in;
  const auto tokens = static_cast<std::size_t>(c.tokens), vocab = static_cast<std::size_t>(c.vocab);
  in.logits = random_bf16(tokens * vocab, rng, 2.0);
  // Row 0: its maximum at entry 3 and at the last entry (argmax 3, the target: a small loss and
  // a one-hot on the maximum). Row 1: at its last two entries (argmax vocab - 2).
  const std::uint16_t top = float_to_bf16(16.0f);
  in.logits[3] = top;
  in.logits[vocab - 1] = top;
  if (tokens > 1) {
    in.logits[2 * vocab - 2] = top;
    in.logits[2 * vocab - 1] = top;
  }
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(c.vocab - 1));
  std::uniform_real_distribution<float> weight(0.25f, 2.0f);
  in.targets.resize(tokens);
  in.weights.resize(tokens);
  double weight_sum = 0.0;
  for (std::size_t t = 0; t < tokens; ++t) {
    in.targets[t] = id(rng);
    in.weights[t] = t % 4 == 1 ? 0.0f : weight(rng);
    weight_sum += in.weights[t];
  }
  in.targets[0] = 3;
  in.targets[tokens - 1] = static_cast<std::int32_t>(c.vocab - 1);
  in.scale = 1.0 / weight_sum;
  return in;
}

::testing::AssertionResult LossesMatch(const char* what, const std::vector<float>& out,
                                       const std::vector<float>& ref) {
  for (std::size_t t = 0; t < ref.size(); ++t) {
    const double error = std::fabs(double(out[t]) - double(ref[t]));
    if (!(error <= kLossTolerance * std::max(1.0, std::fabs(double(ref[t]))))) {
      return ::testing::AssertionFailure()
             << what << ": losses[" << t << "] is " << out[t] << ", expected " << ref[t] << " ["
             << test::seed_trace() << "]";
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult RelativelyClose(const char* what, double out, double ref,
                                           double tolerance) {
  if (std::fabs(out - ref) <= tolerance * std::fabs(ref)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << " is " << out << ", expected " << ref << " within " << tolerance
         << " relative [" << test::seed_trace() << "]";
}

// The gradient within the bf16 rounding of the fp32 value (see the top of the file); rows of
// weight 0 exactly 0.
::testing::AssertionResult GradientMatches(const char* what, const Bits& out,
                                           const std::vector<float>& ref,
                                           const CrossEntropyInputs& in, std::int64_t vocab) {
  const std::vector<float> values = widen(out);
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const std::size_t t = i / static_cast<std::size_t>(vocab);
    const double factor = double(in.weights[t]) * in.scale;
    const double error = std::fabs(double(values[i]) - double(ref[i]));
    const double bound = kBf16Unit * std::fabs(double(ref[i])) +
                         kGradientSlack * (std::fabs(double(ref[i])) + factor);
    const bool ok = in.weights[t] == 0.0f ? values[i] == 0.0f : error <= bound;
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << ref.size() << " entries outside the bound; first ["
         << first / static_cast<std::size_t>(vocab) << ", "
         << first % static_cast<std::size_t>(vocab) << "]: " << values[first] << ", expected "
         << ref[first] << " [" << test::seed_trace() << "]";
}

class CudaCrossEntropy : public ::testing::TestWithParam<CrossEntropyCase> {};

TEST_P(CudaCrossEntropy, MatchesCpuTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  const CrossEntropyCase c = GetParam();
  std::mt19937_64 rng = test::make_rng(static_cast<std::uint64_t>(c.vocab));
  const CrossEntropyInputs in = make_inputs(c, rng);
  const cpu::CrossEntropyShape shape{c.tokens, c.vocab};
  const auto tokens = static_cast<std::size_t>(c.tokens);
  const std::size_t count = tokens * static_cast<std::size_t>(c.vocab);

  // The twin, in fp32 on the same values.
  const std::vector<float> logits = widen(in.logits);
  std::vector<float> ref_losses(tokens), ref_dlogits(count);
  std::vector<std::int32_t> ref_predictions(tokens);
  const cpu::CrossEntropySums ref = cpu::cross_entropy_forward_backward<float>(
      ref_dlogits, ref_losses, ref_predictions, logits, in.targets, in.weights, shape, in.scale);

  CudaStream stream;
  const cudaStream_t st = stream.get();
  const DeviceBuffer d_logits = to_device(in.logits, st);
  const DeviceBuffer d_targets = to_device(in.targets, st);
  const DeviceBuffer d_weights = to_device(in.weights, st);
  DeviceBuffer d_losses(tokens * sizeof(float)), d_predictions(tokens * sizeof(std::int32_t));
  // One spare element: the gradient written 2 bytes off the logits' alignment.
  DeviceBuffer d_dlogits((count + 8) * sizeof(bf16));
  std::vector<float> host_losses(tokens);
  const auto* logits_ptr = d_logits.as<const bf16>();
  const auto* targets_ptr = d_targets.as<const std::int32_t>();
  const auto* weights_ptr = d_weights.as<const float>();
  auto* losses_ptr = d_losses.as<float>();
  auto* predictions_ptr = d_predictions.as<std::int32_t>();

  // The forward alone.
  poison(losses_ptr, tokens * sizeof(float), st);
  poison(predictions_ptr, tokens * sizeof(std::int32_t), st);
  const cpu::CrossEntropySums forward =
      cuda::cross_entropy_forward(losses_ptr, predictions_ptr, logits_ptr, targets_ptr, weights_ptr,
                                  shape, host_losses.data(), in.weights.data(), st);
  const std::vector<float> losses = download<float>(losses_ptr, tokens, st);
  EXPECT_EQ(download<std::int32_t>(predictions_ptr, tokens, st), ref_predictions);
  EXPECT_TRUE(LossesMatch("forward", losses, ref_losses));
  EXPECT_TRUE(BitwiseEqual("host_losses", host_losses, losses));
  EXPECT_TRUE(RelativelyClose("forward loss_sum", forward.loss_sum, ref.loss_sum, 1e-5));
  EXPECT_EQ(forward.weight_sum, ref.weight_sum);  // the same floats summed in the same order
  if (c.tokens > 1) {
    EXPECT_EQ(ref_predictions[0], 3);
    EXPECT_EQ(ref_predictions[1], c.vocab - 2);
  }

  // Forward and backward, out of place (the rows split alike: vector accesses).
  auto* dlogits_ptr = d_dlogits.as<bf16>();
  poison(losses_ptr, tokens * sizeof(float), st);
  poison(predictions_ptr, tokens * sizeof(std::int32_t), st);
  poison(dlogits_ptr, count * sizeof(bf16), st);
  const cpu::CrossEntropySums both = cuda::cross_entropy_forward_backward(
      dlogits_ptr, losses_ptr, predictions_ptr, logits_ptr, targets_ptr, weights_ptr, shape,
      in.scale, host_losses.data(), in.weights.data(), st);
  // The same statistics pass as the forward alone.
  EXPECT_TRUE(BitwiseEqual("losses", download<float>(losses_ptr, tokens, st), losses));
  EXPECT_EQ(download<std::int32_t>(predictions_ptr, tokens, st), ref_predictions);
  EXPECT_EQ(both.loss_sum, forward.loss_sum);
  EXPECT_EQ(both.weight_sum, forward.weight_sum);
  const Bits gradient = download<std::uint16_t>(dlogits_ptr, count, st);
  EXPECT_TRUE(GradientMatches("out of place", gradient, ref_dlogits, in, c.vocab));

  // In place: the same bits.
  DeviceBuffer d_in_place = to_device(in.logits, st);
  auto* in_place_ptr = d_in_place.as<bf16>();
  poison(losses_ptr, tokens * sizeof(float), st);
  const cpu::CrossEntropySums in_place = cuda::cross_entropy_forward_backward(
      in_place_ptr, losses_ptr, predictions_ptr, in_place_ptr, targets_ptr, weights_ptr, shape,
      in.scale, host_losses.data(), in.weights.data(), st);
  EXPECT_TRUE(BitwiseEqual("in place", download<std::uint16_t>(in_place_ptr, count, st), gradient));
  EXPECT_TRUE(BitwiseEqual("in-place losses", download<float>(losses_ptr, tokens, st), losses));
  EXPECT_EQ(in_place.loss_sum, forward.loss_sum);

  // Out of place, dlogits 2 bytes off the logits' alignment: the scalar path.
  poison(dlogits_ptr, (count + 8) * sizeof(bf16), st);
  cuda::cross_entropy_forward_backward(dlogits_ptr + 1, losses_ptr, predictions_ptr, logits_ptr,
                                       targets_ptr, weights_ptr, shape, in.scale,
                                       host_losses.data(), in.weights.data(), st);
  EXPECT_TRUE(GradientMatches("scalar path", download<std::uint16_t>(dlogits_ptr + 1, count, st),
                              ref_dlogits, in, c.vocab));
  EXPECT_TRUE(LossesMatch("scalar path", download<float>(losses_ptr, tokens, st), ref_losses));
  EXPECT_EQ(download<std::int32_t>(predictions_ptr, tokens, st), ref_predictions);
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, CudaCrossEntropy,
                         ::testing::Values(CrossEntropyCase{64, 256}, CrossEntropyCase{50, 1000},
                                           CrossEntropyCase{33, 1003}, CrossEntropyCase{16, 12296},
                                           CrossEntropyCase{24, 32768}, CrossEntropyCase{8, 65536},
                                           CrossEntropyCase{3, 131072},
                                           // Several rows a block of the staged kernel, whose
                                           // blocks go through rows with their next rows'
                                           // copies in flight, and over 512 rows a block (their
                                           // targets and weights are read 512 at a time).
                                           CrossEntropyCase{600, 32768}, CrossEntropyCase{1200, 1003},
                                           CrossEntropyCase{300000, 16}),
                         [](const ::testing::TestParamInfo<CrossEntropyCase>& info) {
                           return "tokens" + std::to_string(info.param.tokens) + "_vocab" +
                                  std::to_string(info.param.vocab);
                         });

// A target outside [0, vocab) cannot be reported by the kernel: its row's loss and gradient are
// NaN, for the caller's check of the loss to catch; the other rows are unaffected.
TEST(CudaCrossEntropyTargets, OutOfRangeTargetGivesNaN) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(5);
  const std::int64_t tokens = 4, vocab = 1000;
  const cpu::CrossEntropyShape shape{tokens, vocab};
  const Bits logits = random_bf16(tokens * vocab, rng);
  const std::vector<std::int32_t> targets{7, 1000, -1, 999};
  const std::vector<float> weights{1.0f, 1.0f, 0.0f, 1.0f};
  CudaStream stream;
  const cudaStream_t st = stream.get();
  DeviceBuffer d_logits = to_device(logits, st);
  const DeviceBuffer d_targets = to_device(targets, st), d_weights = to_device(weights, st);
  DeviceBuffer d_losses(tokens * sizeof(float)), d_predictions(tokens * sizeof(std::int32_t));
  std::vector<float> host_losses(tokens);
  const cpu::CrossEntropySums sums = cuda::cross_entropy_forward_backward(
      d_logits.as<bf16>(), d_losses.as<float>(), d_predictions.as<std::int32_t>(),
      d_logits.as<bf16>(), d_targets.as<std::int32_t>(), d_weights.as<float>(), shape, 0.5,
      host_losses.data(), weights.data(), st);
  EXPECT_TRUE(std::isnan(sums.loss_sum));
  EXPECT_TRUE(std::isfinite(host_losses[0]) && std::isfinite(host_losses[3]));
  EXPECT_TRUE(std::isnan(host_losses[1]) && std::isnan(host_losses[2]));
  const std::vector<float> gradient =
      download_bf16(d_logits.data(), static_cast<std::size_t>(tokens * vocab), st);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const bool bad_row = t == 1 || t == 2;
    std::int64_t nan = 0;
    for (std::int64_t j = 0; j < vocab; ++j) nan += std::isnan(gradient[t * vocab + j]) ? 1 : 0;
    EXPECT_EQ(nan, bad_row ? vocab : 0) << "row " << t;
  }
}

// Rows with non-finite logits, on both kernels (the staged one where dlogits aligns with the
// logits, the online one where it is 2 bytes off): a NaN never becomes the maximum and makes the
// loss NaN; a +inf logit is the prediction and makes the loss non-finite; a row of -inf and NaN
// predicts its first -inf. Both kernels give the same losses and predictions. Rows 0-2 come again
// as rows 3000-3002 among 4000 finite ones, which the staged kernel's blocks take after others.
TEST(CudaCrossEntropyTargets, NonFiniteLogitsOnBothPaths) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(9);
  const std::int64_t tokens = 4004, vocab = 1000, again = 3000;
  const cpu::CrossEntropyShape shape{tokens, vocab};
  Bits logits = random_bf16(tokens * vocab, rng);
  const std::uint16_t nan = 0x7fc0u, inf = 0x7f80u, minus_inf = 0xff80u;
  for (const std::int64_t first : {std::int64_t{0}, again}) {
    logits[(first + 0) * vocab + 17] = nan;  // row 0: a NaN among finite logits
    logits[(first + 1) * vocab + 5] = inf;   // row 1: one +inf
    logits[(first + 1) * vocab + 900] = nan;
    for (std::int64_t j = 0; j < vocab; ++j) {  // row 2: -inf, NaN from 600 on
      logits[(first + 2) * vocab + j] = j < 600 ? minus_inf : nan;
    }
  }
  // Row 3: finite. The expected predictions: the first index of the largest non-NaN logit.
  std::vector<std::int32_t> expected(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) {
    float best = -INFINITY;
    std::int32_t at = -1;
    for (std::int64_t j = 0; j < vocab; ++j) {
      const float x = bf16_to_float(logits[t * vocab + j]);
      if (!std::isnan(x) && (at < 0 || x > best)) best = x, at = static_cast<std::int32_t>(j);
    }
    expected[t] = at;
  }
  std::vector<std::int32_t> targets(tokens, 999);
  const std::vector<float> weights(tokens, 1.0f);
  for (const std::int64_t first : {std::int64_t{0}, again}) {
    targets[first] = 3;
    targets[first + 1] = 5;
    targets[first + 2] = 10;
  }
  CudaStream stream;
  const cudaStream_t st = stream.get();
  const DeviceBuffer d_logits = to_device(logits, st);
  const DeviceBuffer d_targets = to_device(targets, st), d_weights = to_device(weights, st);
  DeviceBuffer d_losses(tokens * sizeof(float)), d_predictions(tokens * sizeof(std::int32_t));
  DeviceBuffer d_dlogits((tokens * vocab + 8) * sizeof(bf16));
  std::vector<float> losses[2];
  for (int offset = 0; offset < 2; ++offset) {  // 0: staged kernel, 1: online kernel
    std::vector<float> host_losses(tokens);
    poison(d_losses.data(), tokens * sizeof(float), st);
    poison(d_predictions.data(), tokens * sizeof(std::int32_t), st);
    cuda::cross_entropy_forward_backward(
        d_dlogits.as<bf16>() + offset, d_losses.as<float>(), d_predictions.as<std::int32_t>(),
        d_logits.as<const bf16>(), d_targets.as<std::int32_t>(), d_weights.as<float>(), shape, 0.25,
        host_losses.data(), weights.data(), st);
    losses[offset] = download<float>(d_losses.as<float>(), tokens, st);
    EXPECT_EQ(download<std::int32_t>(d_predictions.as<std::int32_t>(), tokens, st), expected)
        << "offset " << offset;
    EXPECT_TRUE(std::isnan(losses[offset][0])) << "offset " << offset;
    EXPECT_FALSE(std::isfinite(losses[offset][1])) << "offset " << offset;
    EXPECT_FALSE(std::isfinite(losses[offset][2])) << "offset " << offset;
    EXPECT_TRUE(std::isfinite(losses[offset][3])) << "offset " << offset;
  }
  EXPECT_EQ(expected[1], 5);
  EXPECT_EQ(expected[2], 0);
  for (int offset = 0; offset < 2; ++offset) {
    for (std::int64_t t = 0; t < 3; ++t) {  // the same rows again: the same losses
      const float a = losses[offset][t], b = losses[offset][again + t];
      EXPECT_TRUE(std::isnan(a) ? std::isnan(b) : a == b)
          << "offset " << offset << ", rows " << t << " and " << again + t << ": " << a
          << " and " << b;
    }
  }
  for (std::int64_t t = 0; t < tokens; ++t) {
    const bool special = t % again < 3;
    if (special) {  // the non-finite rows: the same value on both kernels
      const bool same =
          std::isnan(losses[0][t]) ? std::isnan(losses[1][t]) : losses[0][t] == losses[1][t];
      EXPECT_TRUE(same) << "row " << t << ": " << losses[0][t] << " and " << losses[1][t];
    } else {  // the finite rows: the two kernels' sums differ in rounding only
      const double loss = losses[1][t];
      ASSERT_TRUE(std::isfinite(losses[0][t])) << "row " << t;
      EXPECT_NEAR(losses[0][t], loss, kLossTolerance * std::max(1.0, std::fabs(loss)))
          << "row " << t;
    }
  }
}

// ---- sum of squares -------------------------------------------------------------------------

// Against a sum in long double (at least double's precision; 64-bit significands on x86-64): the
// GPU's error is that of double sums of at most a few thousand terms each, ~1e-13 relative at
// worst, so 1e-12 leaves room. Two calls give the same bits, and so does a call through kept
// scratch buffers (whose host side starts as NaNs, so a partial left unwritten would show).
TEST(CudaSumOfSquares, MatchesLongDoubleSumAndRepeatsBitwise) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(6);
  CudaStream stream;
  constexpr auto kPartials = static_cast<std::size_t>(cuda::SumOfSquaresScratch::kPartials);
  const DeviceBuffer d_partials(kPartials * sizeof(double));
  PinnedArray<double> h_partials(kPartials);
  std::fill_n(h_partials.data(), kPartials, std::numeric_limits<double>::quiet_NaN());
  const cuda::SumOfSquaresScratch scratch{d_partials.as<double>(), h_partials.data()};
  // One element; one block; two blocks, the second of one element; many blocks; the most blocks
  // with ranges that do not divide the count.
  for (const std::int64_t count : {1LL, 1000LL, 16385LL, (1LL << 22) + 3, 20000003LL}) {
    const std::vector<float> grads =
        test::normal_vector<float>(static_cast<std::size_t>(count), rng, 0.01);
    long double expected = 0.0L;
    for (const float g : grads) expected += static_cast<long double>(g) * g;
    const DeviceBuffer d_grads = to_device(grads, stream.get());
    const double first = cuda::sum_of_squares(d_grads.as<float>(), count, stream.get());
    const double second = cuda::sum_of_squares(d_grads.as<float>(), count, stream.get());
    const double kept = cuda::sum_of_squares(d_grads.as<float>(), count, stream.get(), &scratch);
    EXPECT_TRUE(RelativelyClose("sum_of_squares", first, static_cast<double>(expected), 1e-12))
        << count << " elements";
    EXPECT_EQ(std::memcmp(&first, &second, sizeof(double)), 0)
        << count << " elements: " << first << " then " << second;
    EXPECT_EQ(std::memcmp(&first, &kept, sizeof(double)), 0)
        << count << " elements: " << first << ", through kept scratch " << kept;
  }
}

// ---- AdamW ----------------------------------------------------------------------------------

// The distance in units in the last place between two finite floats.
std::int64_t ulp_distance(float a, float b) {
  auto ordered = [](float x) {
    std::int32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return bits < 0 ? std::int64_t{std::numeric_limits<std::int32_t>::min()} - bits
                    : std::int64_t{bits};
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

::testing::AssertionResult WithinUlps(const char* what, const std::vector<float>& out,
                                      const std::vector<float>& ref, std::int64_t ulps) {
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i]) || ulp_distance(out[i], ref[i]) > ulps) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << ref.size() << " elements more than " << ulps
         << " ulp away; first at " << first << ": " << out[first] << ", expected " << ref[first]
         << " [" << test::seed_trace() << "]";
}

void check_adamw_steps(cpu::WeightDecay decay) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(decay == cpu::WeightDecay::apply ? 7 : 8);
  const std::int64_t n = 100003;  // not a multiple of the block or of a vector
  const auto size = static_cast<std::size_t>(n);
  const cpu::AdamWHyper h{
      .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  const float grad_scale = 0.37f;
  CudaStream stream;
  const cudaStream_t st = stream.get();
  DeviceBuffer d_params(size * sizeof(float)), d_grads(size * sizeof(float));
  DeviceBuffer d_m(size * sizeof(float)), d_v(size * sizeof(float));
  DeviceBuffer d_bf16(size * sizeof(bf16));
  upload(d_params.data(), test::normal_vector<float>(size, rng), st);
  RINGATTN_CUDA_CHECK(cudaMemsetAsync(d_m.data(), 0, size * sizeof(float), st));
  RINGATTN_CUDA_CHECK(cudaMemsetAsync(d_v.data(), 0, size * sizeof(float), st));

  for (std::int64_t step = 1; step <= 5; ++step) {
    // The twin continues from the GPU's state, so each step is checked on its own inputs.
    std::vector<float> p = download<float>(d_params.data(), size, st);
    std::vector<float> m = download<float>(d_m.data(), size, st);
    std::vector<float> v = download<float>(d_v.data(), size, st);
    const std::vector<float> g = test::normal_vector<float>(size, rng, 0.1);
    std::vector<float> scaled(size);
    for (std::size_t i = 0; i < size; ++i) scaled[i] = g[i] * grad_scale;
    cpu::adamw_step(p, scaled, m, v, h, step, decay);

    upload(d_grads.data(), g, st);
    poison(d_bf16.data(), size * sizeof(bf16), st);
    // The last step without the bf16 copy.
    bf16* copy = step < 5 ? d_bf16.as<bf16>() : nullptr;
    cuda::adamw_step(d_params.as<float>(), copy, d_grads.as<float>(), d_m.as<float>(),
                     d_v.as<float>(), n, h, step, decay, grad_scale, st);
    const std::vector<float> params = download<float>(d_params.data(), size, st);
    EXPECT_TRUE(WithinUlps("params", params, p, 4)) << "step " << step;
    EXPECT_TRUE(WithinUlps("m", download<float>(d_m.data(), size, st), m, 4)) << "step " << step;
    EXPECT_TRUE(WithinUlps("v", download<float>(d_v.data(), size, st), v, 4)) << "step " << step;
    const Bits copied = download<std::uint16_t>(d_bf16.data(), size, st);
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < size; ++i) {
      const std::uint16_t expected = copy != nullptr ? float_to_bf16(params[i]) : 0xffff;
      mismatches += copied[i] != expected ? 1 : 0;
    }
    EXPECT_EQ(mismatches, 0u) << "step " << step << (copy != nullptr ? "" : " (no copy)");
  }
}

TEST(CudaAdamW, StepsMatchCpuTwinWithDecay) {
  RINGATTN_REQUIRE_GPUS(1);
  check_adamw_steps(cpu::WeightDecay::apply);
}

TEST(CudaAdamW, StepsMatchCpuTwinWithoutDecay) {
  RINGATTN_REQUIRE_GPUS(1);
  check_adamw_steps(cpu::WeightDecay::skip);
}

// One call over 70 consecutive tensors (two launches: 64 segments each at most) of uneven sizes,
// from 1 element to a few blocks' worth, decayed or not at random: each tensor as the twin steps
// it alone, and the bf16 copy of every element.
TEST(CudaAdamW, SegmentsMatchCpuTwinTensorByTensor) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(9);
  std::vector<cpu::AdamWSegment> segments(70);
  std::int64_t n = 0;
  for (cpu::AdamWSegment& segment : segments) {
    segment.count = 1 + static_cast<std::int64_t>(rng() % 5000);
    segment.decay = rng() % 2 == 0 ? cpu::WeightDecay::apply : cpu::WeightDecay::skip;
    n += segment.count;
  }
  const auto size = static_cast<std::size_t>(n);
  const cpu::AdamWHyper h{
      .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  const float grad_scale = 0.61f;
  const std::int64_t step = 3;
  std::vector<float> p = test::normal_vector<float>(size, rng);
  std::vector<float> m = test::normal_vector<float>(size, rng, 0.01);
  std::vector<float> v = test::normal_vector<float>(size, rng, 0.001);
  for (float& x : v) x = x * x;
  const std::vector<float> g = test::normal_vector<float>(size, rng, 0.1);
  CudaStream stream;
  const cudaStream_t st = stream.get();
  DeviceBuffer d_params(size * sizeof(float)), d_grads(size * sizeof(float));
  DeviceBuffer d_m(size * sizeof(float)), d_v(size * sizeof(float));
  DeviceBuffer d_bf16(size * sizeof(bf16));
  upload(d_params.data(), p, st);
  upload(d_grads.data(), g, st);
  upload(d_m.data(), m, st);
  upload(d_v.data(), v, st);
  poison(d_bf16.data(), size * sizeof(bf16), st);
  cuda::adamw_step(d_params.as<float>(), d_bf16.as<bf16>(), d_grads.as<float>(), d_m.as<float>(),
                   d_v.as<float>(), segments, h, step, grad_scale, st);
  std::size_t offset = 0;
  for (const cpu::AdamWSegment& segment : segments) {
    const auto count = static_cast<std::size_t>(segment.count);
    std::vector<float> scaled(g.begin() + offset, g.begin() + offset + count);
    for (float& x : scaled) x *= grad_scale;
    cpu::adamw_step(std::span(p).subspan(offset, count), scaled,
                    std::span(m).subspan(offset, count), std::span(v).subspan(offset, count), h,
                    step, segment.decay);
    offset += count;
  }
  const std::vector<float> params = download<float>(d_params.data(), size, st);
  EXPECT_TRUE(WithinUlps("params", params, p, 4));
  EXPECT_TRUE(WithinUlps("m", download<float>(d_m.data(), size, st), m, 4));
  EXPECT_TRUE(WithinUlps("v", download<float>(d_v.data(), size, st), v, 4));
  const Bits copied = download<std::uint16_t>(d_bf16.data(), size, st);
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < size; ++i) mismatches += copied[i] != float_to_bf16(params[i]);
  EXPECT_EQ(mismatches, 0u);
}

// The clip formed on the device (queue_clip_factor, then adamw_step_clipped) against the host's
// (sum_of_squares, cpu::step_clip_factor, adamw_step with that factor):
// the same total and factor, bitwise, and the same params, moments and bf16 copy, bitwise (the
// same kernel and scalars). A clip that bites, one that does not, none (max_norm 0), and a NaN
// gradient: total NaN, and every tensor left as it was.
TEST(CudaAdamW, ClipOnTheDeviceMatchesTheHostsBitwise) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(10);
  const std::vector<cpu::AdamWSegment> segments = {{40000, cpu::WeightDecay::apply},
                                                   {3, cpu::WeightDecay::skip},
                                                   {60000, cpu::WeightDecay::apply}};
  const std::int64_t n = 100003;  // 7 partial sums
  const auto size = static_cast<std::size_t>(n);
  const cpu::AdamWHyper h{
      .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  CudaStream stream;
  const cudaStream_t st = stream.get();
  constexpr auto kPartials = static_cast<std::size_t>(cuda::SumOfSquaresScratch::kPartials);
  const DeviceBuffer d_partials(kPartials * sizeof(double)), d_total(sizeof(double));
  const DeviceBuffer d_factor(sizeof(float));
  PinnedArray<double> h_partials(kPartials);
  const cuda::SumOfSquaresScratch scratch{d_partials.as<double>(), h_partials.data(),
                                          d_total.as<double>(), d_factor.as<float>()};
  test::AdamWState state = test::random_adamw_state(size, rng);
  const std::vector<float>& p0 = state.params;
  const std::vector<float>& m0 = state.m;
  const std::vector<float>& v0 = state.v;
  std::vector<float>& g = state.grads;
  for (const test::ClipCase& c : test::clip_cases(state.norm)) {
    SCOPED_TRACE(c.name);
    if (c.nan_gradient) g[77777] = std::numeric_limits<float>::quiet_NaN();
    const DeviceBuffer d_grads = to_device(g, st);
    // [0]: the host's clip, [1]: the device's.
    DeviceBuffer d_params[2], d_m[2], d_v[2], d_bf16[2];
    for (int k = 0; k < 2; ++k) {
      d_params[k] = to_device(p0, st);
      d_m[k] = to_device(m0, st);
      d_v[k] = to_device(v0, st);
      d_bf16[k] = DeviceBuffer(size * sizeof(bf16));
      poison(d_bf16[k].data(), size * sizeof(bf16), st);
    }
    const double total = cuda::sum_of_squares(d_grads.as<float>(), n, st);
    const float factor = cpu::step_clip_factor(total, c.max_norm);
    if (!c.nan_gradient) {
      cuda::adamw_step(d_params[0].as<float>(), d_bf16[0].as<bf16>(), d_grads.as<float>(),
                       d_m[0].as<float>(), d_v[0].as<float>(), segments, h, 4, factor, st);
    }
    h_partials.data()[0] = -1.0;
    cuda::queue_clip_factor(d_grads.as<float>(), n, c.max_norm, scratch, st);
    cuda::adamw_step_clipped(d_params[1].as<float>(), d_bf16[1].as<bf16>(), d_grads.as<float>(),
                             d_m[1].as<float>(), d_v[1].as<float>(), segments, h, 4,
                             d_factor.as<float>(), st);
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(st));
    const double device_total = h_partials.data()[0];
    const float device_factor = download<float>(d_factor.data(), 1, st)[0];
    if (c.nan_gradient) {
      EXPECT_TRUE(std::isnan(total) && std::isnan(device_total)) << total << ", " << device_total;
      EXPECT_TRUE(std::isnan(device_factor)) << device_factor;
    } else {
      EXPECT_EQ(std::memcmp(&total, &device_total, sizeof(double)), 0)
          << total << " on the host, " << device_total << " on the device";
      EXPECT_EQ(std::memcmp(&factor, &device_factor, sizeof(float)), 0)
          << factor << " on the host, " << device_factor << " on the device";
      if (c.max_norm > 0.0 && c.max_norm < state.norm) {
        EXPECT_LT(factor, 0.31f);
      }
    }
    // With a NaN gradient neither side steps: the device's tensors are the starting ones.
    const auto same = [&](const char* what, const DeviceBuffer (&buffers)[2], std::size_t bytes) {
      const std::vector<unsigned char> a = download<unsigned char>(buffers[0].data(), bytes, st);
      const std::vector<unsigned char> b = download<unsigned char>(buffers[1].data(), bytes, st);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), bytes), 0) << what << " differ";
    };
    same("params", d_params, size * sizeof(float));
    same("m", d_m, size * sizeof(float));
    same("v", d_v, size * sizeof(float));
    same("bf16 copies", d_bf16, size * sizeof(bf16));
    if (c.nan_gradient) {
      EXPECT_EQ(download<float>(d_params[1].data(), size, st), p0) << "params stepped";
    } else {
      EXPECT_NE(download<float>(d_params[1].data(), size, st), p0) << "params not stepped";
    }
  }
}

// ---- argument checks ------------------------------------------------------------------------

// The checks run on the host before anything is launched, so they need no GPU: the pointers
// below are never dereferenced on the device (host_weights is read on the host).
TEST(CudaLossOptimizerOps, ArgumentErrorsNameTheArgument) {
  using test::throws_error_with;
  alignas(16) static std::uint16_t storage[64];
  bf16* b = reinterpret_cast<bf16*>(storage);
  float* f = reinterpret_cast<float*>(storage);
  std::int32_t* i = reinterpret_cast<std::int32_t*>(storage);
  const cudaStream_t stream = nullptr;
  const float weights[] = {1.0f, 2.0f};
  const float negative[] = {1.0f, -1.0f};
  const float nan[] = {std::numeric_limits<float>::quiet_NaN(), 1.0f};
  float host[2];
  const cpu::CrossEntropyShape shape{2, 8};

  constexpr const char* kForward = "train::cuda::cross_entropy_forward";
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::cross_entropy_forward(f, i, b, i, f, {0, 8}, host, weights, stream);
      },
      {kForward, "shape.tokens is 0; expected > 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::cross_entropy_forward(f, i, b, i, f, {2, -1}, host, weights, stream);
      },
      {kForward, "shape.vocab is -1"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::cross_entropy_forward(f, i, b, i, f, {2, (std::int64_t{1} << 30) + 1}, host, weights,
                                    stream);
      },
      {kForward, "shape.vocab is 1073741825", "at most 1073741824"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_forward(f, i, nullptr, i, f, shape, host, weights, stream); },
      {kForward, "logits is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_forward(f, nullptr, b, i, f, shape, host, weights, stream); },
      {kForward, "predictions is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_forward(f, i, b, i, f, shape, nullptr, weights, stream); },
      {kForward, "host_losses is null; expected host memory"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_forward(f, i, b, i, f, shape, host, negative, stream); },
      {kForward, "host_weights[1] is -1", "finite value >= 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_forward(f, i, b, i, f, shape, host, nan, stream); },
      {kForward, "host_weights[0] is nan"}));

  constexpr const char* kBoth = "train::cuda::cross_entropy_forward_backward";
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::cross_entropy_forward_backward(nullptr, f, i, b, i, f, shape, 1.0, host, weights,
                                             stream);
      },
      {kBoth, "dlogits is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::cross_entropy_forward_backward(b, f, i, b, i, nullptr, shape, 1.0, host, weights,
                                             stream);
      },
      {kBoth, "weights is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::cross_entropy_forward_backward(b, f, i, b, i, f, shape,
                                             std::numeric_limits<double>::infinity(), host, weights,
                                             stream);
      },
      {kBoth, "scale is inf"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::cross_entropy_forward_backward(b + 3, f, i, b, i, f, shape, 1.0, host, weights,
                                             stream);
      },
      {kBoth, "dlogits overlaps logits"}));

  // The queued form checks the same arguments before it launches anything.
  constexpr const char* kQueue = "train::cuda::cross_entropy_queue";
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_queue(b, nullptr, i, b, i, f, shape, 1.0, weights, stream); },
      {kQueue, "losses is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_queue(b, f, i, b, i, f, shape, 1.0, nullptr, stream); },
      {kQueue, "host_weights is null; expected host memory"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_queue(b, f, i, b, i, f, shape, 1.0, negative, stream); },
      {kQueue, "host_weights[1] is -1", "finite value >= 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::cross_entropy_queue(b + 3, f, i, b, i, f, shape, 1.0, weights, stream); },
      {kQueue, "dlogits overlaps logits"}));

  constexpr const char* kSum = "train::cuda::sum_of_squares";
  EXPECT_TRUE(throws_error_with([&] { cuda::sum_of_squares(nullptr, 4, stream); },
                                {kSum, "grads is null"}));
  EXPECT_TRUE(throws_error_with([&] { cuda::sum_of_squares(f, 0, stream); },
                                {kSum, "count is 0; expected > 0"}));
  double host_partial = 0.0;
  const cuda::SumOfSquaresScratch no_device{nullptr, &host_partial};
  EXPECT_TRUE(throws_error_with([&] { cuda::sum_of_squares(f, 4, stream, &no_device); },
                                {kSum, "scratch->device is null"}));
  constexpr const char* kClip = "train::cuda::queue_clip_factor";
  double* d = reinterpret_cast<double*>(f);
  const cuda::SumOfSquaresScratch no_total{d, &host_partial, nullptr, f};
  EXPECT_TRUE(throws_error_with([&] { cuda::queue_clip_factor(f, 4, 1.0, no_total, stream); },
                                {kClip, "scratch.total is null"}));
  const cuda::SumOfSquaresScratch full{d, &host_partial, d, f};
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::queue_clip_factor(f, 4, std::numeric_limits<double>::quiet_NaN(), full, stream);
      },
      {kClip, "max_norm is nan"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::adamw_step_clipped(f, nullptr, f, f, f, std::span<const cpu::AdamWSegment>{},
                                 cpu::AdamWHyper{.lr = 1e-3}, 1, nullptr, stream);
      },
      {"train::cuda::adamw_step_clipped", "factor is null"}));

  constexpr const char* kAdamW = "train::cuda::adamw_step";
  const cpu::AdamWHyper h{.lr = 1e-3};
  const auto apply = cpu::WeightDecay::apply;
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::adamw_step(nullptr, b, f, f, f, 4, h, 1, apply, 1.0f, stream); },
      {kAdamW, "params is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::adamw_step(f, b, f, nullptr, f, 4, h, 1, apply, 1.0f, stream); },
      {kAdamW, "m is null"}));
  EXPECT_TRUE(
      throws_error_with([&] { cuda::adamw_step(f, b, f, f, f, -2, h, 1, apply, 1.0f, stream); },
                        {kAdamW, "count is -2"}));
  const cpu::AdamWSegment segments[] = {{3, apply}, {0, apply}};
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::adamw_step(f, b, f, f, f, segments, h, 1, 1.0f, stream); },
      {kAdamW, "segments[1].count is 0; expected > 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::adamw_step(f, b, f, f, f, std::span<const cpu::AdamWSegment>{}, h, 1, 1.0f, stream);
      },
      {kAdamW, "segments is empty"}));
  EXPECT_TRUE(
      throws_error_with([&] { cuda::adamw_step(f, b, f, f, f, 4, h, 0, apply, 1.0f, stream); },
                        {kAdamW, "step is 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::adamw_step(f, b, f, f, f, 4, {.lr = -1.0}, 1, apply, 1.0f, stream); },
      {kAdamW, "hyper.lr is -1"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::adamw_step(f, b, f, f, f, 4, {.lr = 1e-3, .beta1 = 1.0}, 1, apply, 1.0f, stream);
      },
      {kAdamW, "hyper.beta1 is 1", "[0, 1)"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::adamw_step(f, b, f, f, f, 4, {.lr = 1e-3, .eps = 0.0}, 1, apply, 1.0f, stream); },
      {kAdamW, "hyper.eps is 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::adamw_step(f, b, f, f, f, 4, h, 1, apply, std::numeric_limits<float>::infinity(),
                         stream);
      },
      {kAdamW, "grad_scale is inf"}));
}

}  // namespace
}  // namespace ringattn::train

#else

TEST(CudaLossOptimizerOps, MatchesCpuTwins) {
  RINGATTN_REQUIRE_GPUS(1);
}

#endif
