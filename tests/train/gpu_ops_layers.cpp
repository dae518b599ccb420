// The trainer's layer ops on the GPU (train/cuda/ops_layers.cu) against their CPU twins
// (train/op_*.hpp), run in fp32 on the same bf16 values: the conversions, the residual add and the
// embedding gather bitwise; the embedding backward within fp32 reordering (atomics) and bitwise
// (deterministic mode, which also repeats itself); RMSNorm, RoPE (inside packed QKV rows, positions
// near 1e6, one table shared by a batch; the backward from fp32 gradients, which also converts v)
// and SwiGLU within the bf16 rounding of their outputs;
// RMSNorm's dg repeating itself bitwise; rope_table against a long-double table, the device's
// table against it and the host's; the argument
// checks. Odd sizes take the kernels' scalar paths, sizes of multiples of 8 their vector paths.
//
// Tolerance of a bf16 output: the GPU computes r in fp32 and stores bf16(r), within 2^-8 |r| (the
// unit roundoff of bf16's 8-bit significand). Against the fp32 twin's ref, |out - ref| <= 2^-8
// |ref|
// + (1 + 2^-8) |r - ref|, where |r - ref| is the fp32 disagreement of two computations (summation
// order, expf against std::exp, fused multiply-adds): ~1e-6 of the output's scale, bounded here by
// 2^-16 max|ref|. A wrong index, a missing term or a sign error costs far more.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringattn/config.h"
#include "tests/common/gpu.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include <span>

#include "ringattn/dtype.hpp"
#include "ringattn/error.hpp"
#include "src/cuda/device_buffer.hpp"
#include "tests/common/bf16_testing.hpp"
#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "train/cuda/ops.hpp"
#include "train/op_embedding.hpp"
#include "train/op_residual.hpp"
#include "train/op_rmsnorm.hpp"
#include "train/op_rope.hpp"
#include "train/op_swiglu.hpp"

namespace ringattn::train {
namespace {

using cuda::bf16;
using test::Bits;
using test::BitwiseEqual;
using test::download;
using test::download_bf16;
using test::kBf16Unit;
using test::narrow;
using test::random_bf16;
using test::to_device;
using test::widen;

constexpr double kFp32Slack = 0x1p-16;  // fp32 disagreement, relative to max|ref|
constexpr double kTheta = 10000.0;

// ---- device buffers -------------------------------------------------------------------------

bf16* as_bf16(const DeviceBuffer& buffer, std::size_t offset = 0) {
  return buffer.as<bf16>() + offset;
}

// ---- comparisons ----------------------------------------------------------------------------

// Every element within the rounding of a bf16 output: |out - ref| <= 2^-8 |ref| + slack max|ref|.
::testing::AssertionResult WithinBf16Rounding(const char* what, const std::vector<float>& out,
                                              const std::vector<float>& ref,
                                              double slack = kFp32Slack) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << out.size() << " values, expected " << ref.size();
  }
  double scale = 0.0;
  for (const float r : ref) scale = std::max(scale, std::fabs(double(r)));
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double error = std::fabs(double(out[i]) - double(ref[i]));
    if (!(error <= kBf16Unit * std::fabs(double(ref[i])) + slack * scale)) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << ref.size() << " elements outside 2^-8 |ref| + "
         << slack << " max|ref| (max|ref| " << scale << "); first at " << first << ": "
         << out[first] << ", expected " << ref[first] << " [" << test::seed_trace() << "]";
}

// Every element within `tolerance` of its magnitude: |out - ref| <= tolerance * magnitude[i], for
// fp32 results whose error is that of a sum (magnitude = the sum of the terms' absolute values).
::testing::AssertionResult WithinSumError(const char* what, const std::vector<float>& out,
                                          const std::vector<float>& ref,
                                          const std::vector<double>& magnitude, double tolerance) {
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double error = std::fabs(double(out[i]) - double(ref[i]));
    if (!(error <= tolerance * magnitude[i])) {
      if (bad++ == 0) first = i;
    }
  }
  if (out.size() == ref.size() && bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << ref.size() << " elements outside " << tolerance
         << " of their magnitude; first at " << first << ": " << out[first] << ", expected "
         << ref[first] << " (magnitude " << magnitude[first] << ") [" << test::seed_trace() << "]";
}

// ---- conversions and the residual add -----------------------------------------------------

// Sizes around the vector width, and a large odd one; offset 1 misaligns the buffers (scalar path).
constexpr std::int64_t kCounts[] = {1, 7, 1000, 1000003};

// Runs `check(count, offset)` for every count, on buffers `offset` elements into their allocation.
template <typename Check>
void for_counts_and_offsets(Check check) {
  for (const std::int64_t count : kCounts) {
    for (const std::size_t offset : {0, 1}) {
      SCOPED_TRACE("count " + std::to_string(count) + ", offset " + std::to_string(offset));
      check(count, offset);
    }
  }
}

// The elements of `bits` from `offset` on.
Bits tail(const Bits& bits, std::size_t offset) {
  return Bits(bits.begin() + static_cast<std::ptrdiff_t>(offset), bits.end());
}

TEST(CudaLayerOps, ToBf16RoundsToNearestEven) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(1);
  CudaStream stream;
  for_counts_and_offsets([&](std::int64_t count, std::size_t offset) {
    std::vector<float> in = test::normal_vector<float>(count + offset, rng, 3.0);
    // Ties (to even, down and up), subnormals, overflow to infinity, infinities, NaN.
    const float specials[] = {1.00390625f,
                              1.01171875f,
                              -1.00390625f,
                              1e-40f,
                              -3e-39f,
                              std::numeric_limits<float>::max(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(),
                              0.0f,
                              -0.0f};
    for (std::size_t i = 0; i < std::size(specials) && offset + i < in.size(); ++i) {
      in[offset + i] = specials[i];
    }
    const DeviceBuffer d_in = to_device(in, stream.get());
    const DeviceBuffer d_out((count + offset) * sizeof(bf16));
    cuda::to_bf16(as_bf16(d_out, offset), d_in.as<float>() + offset, count, stream.get());
    Bits out = download<std::uint16_t>(as_bf16(d_out, offset), count, stream.get());
    Bits ref(count);
    for (std::int64_t i = 0; i < count; ++i) {
      ref[i] = float_to_bf16(in[offset + i]);
      // NaN payloads may differ; NaN must stay NaN.
      if (std::isnan(in[offset + i])) {
        EXPECT_TRUE(std::isnan(bf16_to_float(out[i]))) << i;
        out[i] = ref[i];
      }
    }
    EXPECT_TRUE(BitwiseEqual("to_bf16", out, ref));
  });
}

TEST(CudaLayerOps, ToFloatIsExact) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(2);
  CudaStream stream;
  for_counts_and_offsets([&](std::int64_t count, std::size_t offset) {
    const Bits in = random_bf16(count + offset, rng, 100.0);
    const DeviceBuffer d_in = to_device(in, stream.get());
    const DeviceBuffer d_out((count + offset) * sizeof(float));
    cuda::to_float(d_out.as<float>() + offset, as_bf16(d_in, offset), count, stream.get());
    const std::vector<float> out = download<float>(d_out.as<float>() + offset, count, stream.get());
    const std::vector<float> ref = widen(tail(in, offset));
    EXPECT_TRUE(BitwiseEqual("to_float", out, ref));
  });
}

TEST(CudaLayerOps, ResidualAddRoundsTheFp32SumOnce) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(3);
  CudaStream stream;
  for_counts_and_offsets([&](std::int64_t count, std::size_t offset) {
    const Bits y = random_bf16(count + offset, rng);
    Bits x = random_bf16(count + offset, rng);
    // Addends far smaller than y: their sum rounds in the interesting places.
    for (std::size_t i = 0; i < x.size(); i += 3) {
      x[i] = float_to_bf16(bf16_to_float(x[i]) * 0x1p-9f);
    }
    const DeviceBuffer d_y = to_device(y, stream.get());
    const DeviceBuffer d_x = to_device(x, stream.get());
    cuda::residual_add(as_bf16(d_y, offset), as_bf16(d_x, offset), count, stream.get());
    const Bits out = download<std::uint16_t>(as_bf16(d_y, offset), count, stream.get());

    // The CPU twin's fp32 sum, rounded to bf16.
    std::vector<float> sum = widen(tail(y, offset));
    const std::vector<float> addend = widen(tail(x, offset));
    cpu::residual_add<float>(sum, addend);
    EXPECT_TRUE(BitwiseEqual("residual_add", out, narrow(sum)));
  });
}

// ---- embedding ------------------------------------------------------------------------------

// Token ids with many repeats: half of them drawn from the first few ids.
std::vector<std::int32_t> random_tokens(std::int64_t count, std::int64_t vocab,
                                        std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> any(0, static_cast<std::int32_t>(vocab - 1));
  std::uniform_int_distribution<std::int32_t> hot(
      0, static_cast<std::int32_t>(std::min<std::int64_t>(vocab, 4) - 1));
  std::vector<std::int32_t> tokens(count);
  for (std::int64_t t = 0; t < count; ++t) tokens[t] = t % 2 == 0 ? hot(rng) : any(rng);
  return tokens;
}

const cpu::EmbeddingShape kEmbeddingShapes[] = {
    {37, 11, 200}, {37, 5, 203}, {1, 1, 1}, {512, 1000, 1024}, {300, 3, 64}};

std::string describe(const cpu::EmbeddingShape& s) {
  return "tokens " + std::to_string(s.tokens) + ", vocab " + std::to_string(s.vocab) + ", dim " +
         std::to_string(s.dim);
}

TEST(CudaLayerOps, EmbeddingForwardGathersRows) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(4);
  CudaStream stream;
  for (const cpu::EmbeddingShape& s : kEmbeddingShapes) {
    SCOPED_TRACE(describe(s));
    const std::vector<std::int32_t> tokens = random_tokens(s.tokens, s.vocab, rng);
    const Bits table = random_bf16(s.vocab * s.dim, rng);
    const DeviceBuffer d_tokens = to_device(tokens, stream.get());
    const DeviceBuffer d_table = to_device(table, stream.get());
    const DeviceBuffer d_out(s.tokens * s.dim * sizeof(bf16));
    cuda::embedding_forward(as_bf16(d_out), d_tokens.as<std::int32_t>(), as_bf16(d_table), s,
                            stream.get());
    const std::vector<float> out = download_bf16(d_out.data(), s.tokens * s.dim, stream.get());
    std::vector<float> ref(s.tokens * s.dim);
    cpu::embedding_forward<float>(ref, tokens, widen(table), s);
    EXPECT_TRUE(BitwiseEqual("embedding_forward", out, ref));
  }
}

// An embedding backward's inputs: token ids with repeats, dout, and dtable's previous values (the
// backward adds to them); the tokens and dout also on the device.
struct EmbeddingBackwardInputs {
  std::vector<std::int32_t> tokens;
  Bits dout;
  std::vector<float> dtable0;
  DeviceBuffer d_tokens, d_dout;
};

EmbeddingBackwardInputs embedding_backward_inputs(const cpu::EmbeddingShape& s,
                                                  std::mt19937_64& rng, cudaStream_t stream) {
  EmbeddingBackwardInputs in;
  in.tokens = random_tokens(s.tokens, s.vocab, rng);
  in.dout = random_bf16(s.tokens * s.dim, rng);
  in.dtable0 = test::normal_vector<float>(s.vocab * s.dim, rng);
  in.d_tokens = to_device(in.tokens, stream);
  in.d_dout = to_device(in.dout, stream);
  return in;
}

// embedding_backward on the GPU, adding into a fresh copy of dtable0. Returns dtable.
std::vector<float> gpu_embedding_backward(const EmbeddingBackwardInputs& in,
                                          const cpu::EmbeddingShape& s, bool deterministic,
                                          cudaStream_t stream) {
  const DeviceBuffer d_dtable = to_device(in.dtable0, stream);
  cuda::embedding_backward(d_dtable.as<float>(), in.d_tokens.as<std::int32_t>(), as_bf16(in.d_dout),
                           s, deterministic, stream);
  return download<float>(d_dtable.data(), in.dtable0.size(), stream);
}

// The twin's dtable: dtable0 plus the rows of dout, added in token order in fp32.
std::vector<float> twin_embedding_backward(const EmbeddingBackwardInputs& in,
                                           const cpu::EmbeddingShape& s) {
  std::vector<float> ref = in.dtable0;
  cpu::embedding_backward<float>(ref, in.tokens, widen(in.dout), s, Write::add);
  return ref;
}

TEST(CudaLayerOps, EmbeddingBackwardAtomicMatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(5);
  CudaStream stream;
  for (const cpu::EmbeddingShape& s : kEmbeddingShapes) {
    SCOPED_TRACE(describe(s));
    const EmbeddingBackwardInputs in = embedding_backward_inputs(s, rng, stream.get());
    const std::vector<float> out =
        gpu_embedding_backward(in, s, /*deterministic=*/false, stream.get());
    const std::vector<float> ref = twin_embedding_backward(in, s);
    // fp32 sums of at most `tokens` terms in another order: within a few hundred ulps of the sum
    // of the terms' magnitudes; 2^-14 of it is well above that and far below one missing term.
    const std::vector<float> dout_f = widen(in.dout);
    std::vector<double> magnitude(in.dtable0.size());
    for (std::size_t i = 0; i < magnitude.size(); ++i) magnitude[i] = std::fabs(in.dtable0[i]);
    for (std::int64_t t = 0; t < s.tokens; ++t) {
      for (std::int64_t c = 0; c < s.dim; ++c) {
        magnitude[in.tokens[t] * s.dim + c] += std::fabs(dout_f[t * s.dim + c]);
      }
    }
    EXPECT_TRUE(WithinSumError("embedding_backward (atomic)", out, ref, magnitude, 0x1p-14));
  }
}

TEST(CudaLayerOps, EmbeddingBackwardDeterministicIsBitwiseTheTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(6);
  CudaStream stream;
  for (const cpu::EmbeddingShape& s : kEmbeddingShapes) {
    SCOPED_TRACE(describe(s));
    const EmbeddingBackwardInputs in = embedding_backward_inputs(s, rng, stream.get());
    const std::vector<float> first =
        gpu_embedding_backward(in, s, /*deterministic=*/true, stream.get());
    const std::vector<float> second =
        gpu_embedding_backward(in, s, /*deterministic=*/true, stream.get());
    // The twin adds in token order in fp32, as the deterministic kernel does: the same bits.
    EXPECT_TRUE(BitwiseEqual("embedding_backward (deterministic) against the twin", first,
                             twin_embedding_backward(in, s)));
    EXPECT_TRUE(BitwiseEqual("embedding_backward (deterministic), second run", second, first));
  }
}

// ---- RMSNorm --------------------------------------------------------------------------------

// dim 256, 512, 768 and 1024 take the kernels that hold a row in registers; 20000 rows make 254
// row ranges of 79 for dg's partial sums. (dim 1 only in the forward: there the backward's dx is
// inv * dy * g * eps / (x^2 + eps), all cancellation, and no fp32 computation of it is within
// 2^-8.)
const cpu::RmsNormShape kRmsNormShapes[] = {{37, 200},   {37, 203},  {512, 1024}, {3, 8192},
                                            {4097, 64},  {700, 201}, {5, 2},      {300, 768},
                                            {20000, 256}, {65, 512}};

std::string describe(const cpu::RmsNormShape& s) {
  return "rows " + std::to_string(s.rows) + ", dim " + std::to_string(s.dim);
}

struct RmsNormInputs {
  Bits x, dy, dx0;
  std::vector<float> g, dg0;
};

RmsNormInputs rmsnorm_inputs(const cpu::RmsNormShape& s, std::mt19937_64& rng) {
  RmsNormInputs in;
  in.x = random_bf16(s.rows * s.dim, rng, 2.0);
  in.dy = random_bf16(s.rows * s.dim, rng);
  in.dx0 = random_bf16(s.rows * s.dim, rng);
  in.g = test::normal_vector<float>(s.dim, rng);
  in.dg0 = test::normal_vector<float>(s.dim, rng);
  return in;
}

TEST(CudaLayerOps, RmsNormForwardMatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(7);
  CudaStream stream;
  constexpr double kEps = 1e-5;
  std::vector<cpu::RmsNormShape> shapes(std::begin(kRmsNormShapes), std::end(kRmsNormShapes));
  shapes.push_back({1, 1});
  for (const cpu::RmsNormShape& s : shapes) {
    SCOPED_TRACE(describe(s));
    const RmsNormInputs in = rmsnorm_inputs(s, rng);
    const DeviceBuffer d_x = to_device(in.x, stream.get());
    const DeviceBuffer d_g = to_device(in.g, stream.get());
    const DeviceBuffer d_y(s.rows * s.dim * sizeof(bf16)), d_inv(s.rows * sizeof(float));
    cuda::rmsnorm_forward(as_bf16(d_y), d_inv.as<float>(), as_bf16(d_x), d_g.as<float>(), s, kEps,
                          stream.get());
    const std::vector<float> y = download_bf16(d_y.data(), s.rows * s.dim, stream.get());
    const std::vector<float> inv = download<float>(d_inv.data(), s.rows, stream.get());

    std::vector<float> ref_y(s.rows * s.dim), ref_inv(s.rows);
    cpu::rmsnorm_forward<float>(ref_y, ref_inv, widen(in.x), in.g, s, kEps);
    EXPECT_TRUE(WithinBf16Rounding("y", y, ref_y));
    // inv_rms from an fp32 sum of dim squares (lanes of up to 256 terms, then a tree) against the
    // twin's double sum: a few 1e-6 relative at most.
    std::vector<double> magnitude(ref_inv.begin(), ref_inv.end());
    EXPECT_TRUE(WithinSumError("inv_rms", inv, ref_inv, magnitude, 0x1p-14));
  }
}

// The backward's inputs that both GPU passes share: the twin's inv_rms (eps 1e-5), so that the
// GPU's and the twin's backward start from the same values, and the read-only operands on the
// device.
struct RmsNormBackwardInputs {
  std::vector<float> inv;
  DeviceBuffer x, dy, g, inv_rms;
};

RmsNormBackwardInputs rmsnorm_backward_inputs(const RmsNormInputs& in, const cpu::RmsNormShape& s,
                                              cudaStream_t stream) {
  RmsNormBackwardInputs b;
  std::vector<float> y(s.rows * s.dim);
  b.inv.resize(s.rows);
  cpu::rmsnorm_forward<float>(y, b.inv, widen(in.x), in.g, s, 1e-5);
  b.x = to_device(in.x, stream);
  b.dy = to_device(in.dy, stream);
  b.g = to_device(in.g, stream);
  b.inv_rms = to_device(b.inv, stream);
  return b;
}

// rmsnorm_backward on the GPU into d_dx, adding dg into a fresh copy of dg0. Returns dg.
std::vector<float> gpu_rmsnorm_backward(const RmsNormBackwardInputs& b, const DeviceBuffer& d_dx,
                                        const std::vector<float>& dg0, const cpu::RmsNormShape& s,
                                        Write dx_write, cudaStream_t stream) {
  const DeviceBuffer d_dg = to_device(dg0, stream);
  cuda::rmsnorm_backward(as_bf16(d_dx), d_dg.as<float>(), as_bf16(b.dy), as_bf16(b.x),
                         b.g.as<float>(), b.inv_rms.as<float>(), s, dx_write, stream);
  return download<float>(d_dg.data(), s.dim, stream);
}

TEST(CudaLayerOps, RmsNormBackwardMatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(8);
  CudaStream stream;
  for (const cpu::RmsNormShape& s : kRmsNormShapes) {
    for (const Write dx_write : {Write::overwrite, Write::add}) {
      SCOPED_TRACE(describe(s) + (dx_write == Write::add ? ", dx added" : ", dx overwritten"));
      const RmsNormInputs in = rmsnorm_inputs(s, rng);
      const RmsNormBackwardInputs b = rmsnorm_backward_inputs(in, s, stream.get());
      const DeviceBuffer d_dx = to_device(in.dx0, stream.get());
      const std::vector<float> dg =
          gpu_rmsnorm_backward(b, d_dx, in.dg0, s, dx_write, stream.get());
      const std::vector<float> dx = download_bf16(d_dx.data(), s.rows * s.dim, stream.get());

      const std::vector<float> x = widen(in.x), dy = widen(in.dy);
      const std::vector<float>& inv = b.inv;
      std::vector<float> ref_dx = widen(in.dx0), ref_dg = in.dg0;
      cpu::rmsnorm_backward<float>(ref_dx, ref_dg, dy, x, in.g, inv, s, dx_write, Write::add);
      EXPECT_TRUE(WithinBf16Rounding("dx", dx, ref_dx));
      // dg: fp32 sums over the rows (chains of at most a few hundred terms) against the twin's
      // double sums; 2^-14 of the terms' magnitudes is above their worst case.
      std::vector<double> magnitude(s.dim);
      for (std::int64_t c = 0; c < s.dim; ++c) magnitude[c] = std::fabs(in.dg0[c]);
      for (std::int64_t r = 0; r < s.rows; ++r) {
        for (std::int64_t c = 0; c < s.dim; ++c) {
          magnitude[c] += std::fabs(double(dy[r * s.dim + c]) * x[r * s.dim + c] * inv[r]);
        }
      }
      EXPECT_TRUE(WithinSumError("dg", dg, ref_dg, magnitude, 0x1p-14));
    }
  }
}

TEST(CudaLayerOps, RmsNormBackwardDgIsReproducible) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(9);
  CudaStream stream;
  // One row range, and many (4097 rows: 65 ranges of 64 rows, the last of one row).
  for (const cpu::RmsNormShape s :
       {cpu::RmsNormShape{37, 203}, cpu::RmsNormShape{512, 1024}, cpu::RmsNormShape{4097, 200}}) {
    SCOPED_TRACE(describe(s));
    const RmsNormInputs in = rmsnorm_inputs(s, rng);
    const RmsNormBackwardInputs b = rmsnorm_backward_inputs(in, s, stream.get());
    const DeviceBuffer d_dx(s.rows * s.dim * sizeof(bf16));
    const std::vector<float> first =
        gpu_rmsnorm_backward(b, d_dx, in.dg0, s, Write::overwrite, stream.get());
    const std::vector<float> second =
        gpu_rmsnorm_backward(b, d_dx, in.dg0, s, Write::overwrite, stream.get());
    EXPECT_TRUE(BitwiseEqual("dg, second run", second, first));
  }
}

// ---- RoPE -----------------------------------------------------------------------------------

TEST(CudaLayerOps, RopeTableMatchesLongDouble) {
  // Host only: no GPU needed.
  const std::vector<std::int64_t> positions = {0,       1,         2,         1000,     65535,
                                               999'999, 1'000'000, 1'048'575, 3'000'017};
  for (const double theta : {10000.0, 500000.0}) {
    for (const std::int64_t head_dim : {2, 6, 128}) {
      SCOPED_TRACE("theta " + std::to_string(theta) + ", head_dim " + std::to_string(head_dim));
      const cuda::RopeTable table = cuda::rope_table(positions, head_dim, theta);
      const std::int64_t half = head_dim / 2;
      ASSERT_EQ(table.cos.size(), positions.size() * half);
      ASSERT_EQ(table.sin.size(), positions.size() * half);
      // A float's rounding (<= 2^-25 below 1) plus the double angle's error (a few ulps of
      // 3e6 rad, ~1e-9). Angles formed in float would be off by ~0.1 rad at these positions.
      const double tolerance = 0x1p-25 + 4.0 * 3.1e6 * 0x1p-52;
      std::size_t bad = 0;
      for (std::size_t t = 0; t < positions.size(); ++t) {
        for (std::int64_t i = 0; i < half; ++i) {
          const long double angle =
              (long double)positions[t] *
              std::pow((long double)theta, -2.0L * (long double)i / (long double)head_dim);
          const std::size_t at = t * half + i;
          const double cos_error = std::fabs(double(table.cos[at]) - double(std::cos(angle)));
          const double sin_error = std::fabs(double(table.sin[at]) - double(std::sin(angle)));
          if (!(cos_error <= tolerance && sin_error <= tolerance) && bad++ < 5) {
            ADD_FAILURE() << "position " << positions[t] << ", pair " << i << ": cos "
                          << table.cos[at] << " (error " << cos_error << "), sin " << table.sin[at]
                          << " (error " << sin_error << "), tolerance " << tolerance;
          }
        }
      }
      EXPECT_EQ(bad, 0u);
    }
  }
}

struct RopeCase {
  std::string name;
  std::int64_t tokens, table_rows, head_dim, token_stride;
  // The rotated views, each at an offset into the token row: (offset, heads).
  std::vector<std::pair<std::int64_t, std::int64_t>> views;
  std::int64_t first_position, position_span;
};

std::vector<RopeCase> rope_cases() {
  // Packed QKV rows of 8 q heads and 2 kv heads: q at 0, k at 8 head_dim, v after k.
  return {
      {"packed qkv d128, 2 sequences near 1e6",
       512,
       256,
       128,
       (8 + 2 * 2) * 128,
       {{0, 8}, {8 * 128, 2}},
       999'000,
       4096},
      {"packed qkv d64, 4 sequences",
       256,
       64,
       64,
       (4 + 2 * 1) * 64,
       {{0, 4}, {4 * 64, 1}},
       0,
       70000},
      {"d64, stride 258 (pairs of 2)", 37, 37, 64, 4 * 64 + 2, {{0, 4}}, 123'456, 1000},
      {"d128, 48 heads (a token's groups loop over the block)", 9, 9, 128, 48 * 128, {{0, 48}},
       77, 5000},
      {"d6, odd stride, table of 5 rows", 37, 5, 6, 19, {{1, 3}}, 999'990, 20},
      {"d2, one token", 1, 1, 2, 2, {{0, 1}}, 1'000'000, 1},
  };
}

// The positions of a table's rows, drawn from [first, first + span): not contiguous, in no order.
// The table made on the device from positions (document-relative ones, small and large, and
// positions near 3e6): every element within the long-double bound of RopeTableMatchesLongDouble,
// and within one fp32 ulp of the host's table (both form the angle and its cos and sin in double
// from the same frequencies; only the last bits of the double results may differ).
TEST(CudaLayerOps, RopeTableOnTheDeviceMatchesTheHosts) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(12);
  CudaStream stream;
  std::vector<std::int64_t> positions;
  for (std::int64_t p = 0; p < 300; ++p) positions.push_back(p % 77);  // documents of 77 tokens
  for (const std::int64_t p : {999'999, 1'000'000, 1'048'575, 3'000'017}) positions.push_back(p);
  std::uniform_int_distribution<std::int64_t> far(0, 3'000'000);
  for (int i = 0; i < 1000; ++i) positions.push_back(far(rng));
  for (const double theta : {10000.0, 500000.0}) {
    for (const std::int64_t head_dim : {2, 6, 64, 128}) {
      SCOPED_TRACE("theta " + std::to_string(theta) + ", head_dim " + std::to_string(head_dim));
      const std::int64_t half = head_dim / 2, rows = static_cast<std::int64_t>(positions.size());
      const cuda::RopeTable host = cuda::rope_table(positions, head_dim, theta);
      const DeviceBuffer d_positions = to_device(positions, stream.get());
      const DeviceBuffer d_frequencies =
          to_device(cuda::rope_inverse_frequencies(head_dim, theta), stream.get());
      const DeviceBuffer d_cos(host.cos.size() * sizeof(float)), d_sin(host.sin.size() * sizeof(float));
      cuda::rope_table(d_cos.as<float>(), d_sin.as<float>(), d_positions.as<std::int64_t>(), rows,
                       d_frequencies.as<double>(), head_dim, stream.get());
      const std::vector<float> cos = download<float>(d_cos.data(), host.cos.size(), stream.get());
      const std::vector<float> sin = download<float>(d_sin.data(), host.sin.size(), stream.get());
      const double tolerance = 0x1p-25 + 4.0 * 3.1e6 * 0x1p-52;
      std::size_t bad = 0;
      for (std::int64_t t = 0; t < rows; ++t) {
        for (std::int64_t i = 0; i < half; ++i) {
          const long double angle =
              (long double)positions[t] *
              std::pow((long double)theta, -2.0L * (long double)i / (long double)head_dim);
          const std::size_t at = t * half + i;
          const bool near_host =
              std::fabs(cos[at] - host.cos[at]) <=
                  std::nextafter(std::fabs(host.cos[at]), 2.0f) - std::fabs(host.cos[at]) &&
              std::fabs(sin[at] - host.sin[at]) <=
                  std::nextafter(std::fabs(host.sin[at]), 2.0f) - std::fabs(host.sin[at]);
          const bool near_exact = std::fabs(double(cos[at]) - double(std::cos(angle))) <= tolerance &&
                                  std::fabs(double(sin[at]) - double(std::sin(angle))) <= tolerance;
          if (!(near_host && near_exact) && bad++ < 5) {
            ADD_FAILURE() << "position " << positions[t] << ", pair " << i << ": device cos "
                          << cos[at] << " sin " << sin[at] << ", host cos " << host.cos[at]
                          << " sin " << host.sin[at];
          }
        }
      }
      EXPECT_EQ(bad, 0u);
    }
  }
}

std::vector<std::int64_t> random_positions(std::int64_t table_rows, std::int64_t first,
                                           std::int64_t span, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> position(first, first + span - 1);
  std::vector<std::int64_t> positions(table_rows);
  for (auto& p : positions) p = position(rng);
  return positions;
}

// Each token's position: token t has the table's row t % table_rows, as the GPU ops use it.
std::vector<std::int64_t> positions_of_tokens(const std::vector<std::int64_t>& positions,
                                              std::int64_t tokens) {
  std::vector<std::int64_t> per_token(tokens);
  const auto table_rows = static_cast<std::int64_t>(positions.size());
  for (std::int64_t t = 0; t < tokens; ++t) per_token[t] = positions[t % table_rows];
  return per_token;
}

// Runs rope_forward (or rope_backward) on every view of a random buffer, on the GPU and through
// the CPU twin, and compares the whole buffer: rotated elements within bf16 rounding, the rest
// (v, gaps between views) bitwise unchanged.
void check_rope(const RopeCase& rc, bool backward, std::mt19937_64& rng, cudaStream_t stream) {
  SCOPED_TRACE(rc.name + (backward ? ", backward" : ", forward"));
  const std::vector<std::int64_t> positions =
      random_positions(rc.table_rows, rc.first_position, rc.position_span, rng);
  const cuda::RopeTable table = cuda::rope_table(positions, rc.head_dim, kTheta);
  const std::vector<std::int64_t> token_positions = positions_of_tokens(positions, rc.tokens);

  const Bits x = random_bf16(rc.tokens * rc.token_stride, rng);
  const DeviceBuffer d_x = to_device(x, stream);
  const DeviceBuffer d_cos = to_device(table.cos, stream);
  const DeviceBuffer d_sin = to_device(table.sin, stream);
  std::vector<float> ref = widen(x);
  std::vector<bool> rotated(x.size(), false);
  for (const auto& [offset, heads] : rc.views) {
    const cpu::RopeShape shape{rc.tokens, heads, rc.head_dim, rc.token_stride};
    if (backward) {
      cuda::rope_backward(as_bf16(d_x, offset), d_cos.as<float>(), d_sin.as<float>(), rc.table_rows,
                          shape, stream);
    } else {
      cuda::rope_forward(as_bf16(d_x, offset), d_cos.as<float>(), d_sin.as<float>(), rc.table_rows,
                         shape, stream);
    }
    const std::span<float> view = std::span<float>(ref).subspan(offset);
    const std::int64_t extent = (rc.tokens - 1) * rc.token_stride + heads * rc.head_dim;
    if (backward) {
      cpu::rope_backward<float>(view.first(extent), token_positions, shape, kTheta);
    } else {
      cpu::rope_forward<float>(view.first(extent), token_positions, shape, kTheta);
    }
    for (std::int64_t t = 0; t < rc.tokens; ++t) {
      for (std::int64_t e = 0; e < heads * rc.head_dim; ++e) {
        rotated[offset + t * rc.token_stride + e] = true;
      }
    }
  }
  const std::vector<float> out = download_bf16(d_x.data(), x.size(), stream);

  std::vector<float> out_rotated, ref_rotated, out_kept, ref_kept;
  for (std::size_t i = 0; i < x.size(); ++i) {
    (rotated[i] ? out_rotated : out_kept).push_back(out[i]);
    (rotated[i] ? ref_rotated : ref_kept).push_back(ref[i]);
  }
  EXPECT_TRUE(WithinBf16Rounding("rotated elements", out_rotated, ref_rotated));
  EXPECT_TRUE(BitwiseEqual("elements outside the views", out_kept, ref_kept));
}

TEST(CudaLayerOps, RopeForwardMatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(10);
  CudaStream stream;
  for (const RopeCase& rc : rope_cases()) check_rope(rc, /*backward=*/false, rng, stream.get());
}

TEST(CudaLayerOps, RopeBackwardMatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(11);
  CudaStream stream;
  for (const RopeCase& rc : rope_cases()) check_rope(rc, /*backward=*/true, rng, stream.get());
}

// rope_backward from fp32 gradients: packed QKV rows [tokens, (q_heads + 2 kv_heads) head_dim],
// q's and k's heads rotated as one view of q_heads + kv_heads heads, v's converted.
struct RopeFromAccCase {
  std::string name;
  std::int64_t tokens, table_rows, q_heads, kv_heads, head_dim;
  // dx_acc and dx this many elements into their allocations (misaligned: narrower accesses).
  std::size_t acc_offset, dx_offset;
  std::int64_t first_position, position_span;
};

std::vector<RopeFromAccCase> rope_from_acc_cases() {
  return {
      {"d128, 4 q + 2 kv heads, 2 sequences near 1e6", 512, 256, 4, 2, 128, 0, 0, 999'000, 4096},
      {"d64, 4 q + 2 kv heads, 4 sequences", 256, 64, 4, 2, 64, 0, 0, 0, 70000},
      {"d64, dx_acc 8-byte aligned (pairs of 2)", 300, 300, 4, 2, 64, 2, 0, 123'456, 1000},
      {"d64, dx 2-byte aligned (single pairs)", 37, 37, 4, 2, 64, 0, 1, 5'000, 100},
      {"d6, 1 q + 1 kv head, table of 5 rows", 37, 5, 1, 1, 6, 0, 0, 999'990, 20},
  };
}

// The GPU writes bf16(R^T dx_acc) over a NaN-filled dx (every element must be written); the twin
// rotates an fp32 copy of dx_acc in place. Rotated elements (q, k) within the rounding of a bf16
// output of the fp32 twin, |out - ref| <= 2^-8 |ref| + 2^-16 max|ref| (one rounding, after the
// rotation: rounding dx_acc to bf16 before it would add up to 2^-8 (|a| + |b|) for a pair (a, b),
// far more than 2^-8 |ref| where a and b cancel); v bitwise bf16(dx_acc).
void check_rope_from_acc(const RopeFromAccCase& rc, std::mt19937_64& rng, cudaStream_t stream) {
  SCOPED_TRACE(rc.name);
  const std::int64_t heads = rc.q_heads + rc.kv_heads;
  const std::int64_t token_stride = (rc.q_heads + 2 * rc.kv_heads) * rc.head_dim;
  const std::int64_t count = rc.tokens * token_stride;
  const std::vector<std::int64_t> positions =
      random_positions(rc.table_rows, rc.first_position, rc.position_span, rng);
  const cuda::RopeTable table = cuda::rope_table(positions, rc.head_dim, kTheta);

  const std::vector<float> dx_acc = test::normal_vector<float>(rc.acc_offset + count, rng);
  const DeviceBuffer d_acc = to_device(dx_acc, stream);
  const Bits poison(rc.dx_offset + count, std::uint16_t{0x7fc0});  // bf16 NaN
  const DeviceBuffer d_dx = to_device(poison, stream);
  const DeviceBuffer d_cos = to_device(table.cos, stream);
  const DeviceBuffer d_sin = to_device(table.sin, stream);
  const cpu::RopeShape shape{rc.tokens, heads, rc.head_dim, token_stride};
  cuda::rope_backward(as_bf16(d_dx, rc.dx_offset), d_acc.as<float>() + rc.acc_offset,
                      d_cos.as<float>(), d_sin.as<float>(), rc.table_rows, shape, stream);
  const Bits out = download<std::uint16_t>(as_bf16(d_dx, rc.dx_offset), count, stream);

  std::vector<float> ref(dx_acc.begin() + static_cast<std::ptrdiff_t>(rc.acc_offset), dx_acc.end());
  cpu::rope_backward<float>(ref, positions_of_tokens(positions, rc.tokens), shape, kTheta);

  std::vector<float> out_rotated, ref_rotated, ref_kept;
  Bits out_kept;
  for (std::int64_t i = 0; i < count; ++i) {
    if (i % token_stride < heads * rc.head_dim) {
      out_rotated.push_back(bf16_to_float(out[i]));
      ref_rotated.push_back(ref[i]);
    } else {
      out_kept.push_back(out[i]);
      ref_kept.push_back(ref[i]);  // the twin leaves v as it is: dx_acc's value
    }
  }
  EXPECT_TRUE(WithinBf16Rounding("rotated elements (q, k)", out_rotated, ref_rotated));
  EXPECT_TRUE(BitwiseEqual("converted elements (v)", out_kept, narrow(ref_kept)));
}

TEST(CudaLayerOps, RopeBackwardFromFp32MatchesTwinRoundedOnce) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(14);
  CudaStream stream;
  for (const RopeFromAccCase& rc : rope_from_acc_cases()) {
    check_rope_from_acc(rc, rng, stream.get());
  }
}

// rope_backward_heads with only dQ in fp32 (shape.heads = q_heads): q's heads rotated from dx_acc,
// whose k and v columns are NaN (never read); k's and v's left bitwise as they were (as the
// attention wrote them). The twin rotates an fp32 row of dx_acc's q; the same bound as above.
void check_rope_heads(const RopeFromAccCase& rc, std::mt19937_64& rng, cudaStream_t stream) {
  SCOPED_TRACE(rc.name + ", dQ alone in fp32");
  const std::int64_t heads = rc.q_heads, d = rc.head_dim;
  const std::int64_t token_stride = (rc.q_heads + 2 * rc.kv_heads) * d;
  const std::int64_t count = rc.tokens * token_stride;
  const std::vector<std::int64_t> positions =
      random_positions(rc.table_rows, rc.first_position, rc.position_span, rng);
  const cuda::RopeTable table = cuda::rope_table(positions, d, kTheta);

  std::vector<float> dx_acc = test::normal_vector<float>(rc.acc_offset + count, rng);
  const Bits dx_in = random_bf16(rc.dx_offset + count, rng, 1.0);
  std::vector<float> ref(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    const bool q_column = i % token_stride < rc.q_heads * d;
    float& acc = dx_acc[rc.acc_offset + i];
    ref[i] = q_column ? acc : bf16_to_float(dx_in[rc.dx_offset + i]);
    if (!q_column) acc = std::numeric_limits<float>::quiet_NaN();
  }
  const DeviceBuffer d_acc = to_device(dx_acc, stream);
  const DeviceBuffer d_dx = to_device(dx_in, stream);
  const DeviceBuffer d_cos = to_device(table.cos, stream);
  const DeviceBuffer d_sin = to_device(table.sin, stream);
  const cpu::RopeShape shape{rc.tokens, heads, d, token_stride};
  cuda::rope_backward_heads(as_bf16(d_dx, rc.dx_offset), d_acc.as<float>() + rc.acc_offset,
                            d_cos.as<float>(), d_sin.as<float>(), rc.table_rows, shape, stream);
  const Bits out = download<std::uint16_t>(as_bf16(d_dx, rc.dx_offset), count, stream);
  cpu::rope_backward<float>(ref, positions_of_tokens(positions, rc.tokens), shape, kTheta);

  std::vector<float> out_rotated, ref_rotated;
  Bits out_kept, in_kept;
  for (std::int64_t i = 0; i < count; ++i) {
    if (i % token_stride < heads * d) {
      out_rotated.push_back(bf16_to_float(out[i]));
      ref_rotated.push_back(ref[i]);
    } else {
      out_kept.push_back(out[i]);
      in_kept.push_back(dx_in[rc.dx_offset + i]);
    }
  }
  EXPECT_TRUE(WithinBf16Rounding("q's rotated elements", out_rotated, ref_rotated));
  EXPECT_TRUE(BitwiseEqual("the elements after the rotated heads, untouched", out_kept, in_kept));
}

TEST(CudaLayerOps, RopeBackwardWithDqAloneInFp32MatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(15);
  CudaStream stream;
  for (const RopeFromAccCase& rc : rope_from_acc_cases()) check_rope_heads(rc, rng, stream.get());
}

// ---- SwiGLU ---------------------------------------------------------------------------------

const cpu::SwigluShape kSwigluShapes[] = {{37, 200}, {37, 203}, {1, 1}, {512, 1024}, {64, 2816}};

std::string describe(const cpu::SwigluShape& s) {
  return "rows " + std::to_string(s.rows) + ", hidden " + std::to_string(s.hidden);
}

// gate_up with gates of scale 3 and a few far out in both tails (sigmoid 0 and 1 exactly).
Bits swiglu_input(const cpu::SwigluShape& s, std::mt19937_64& rng) {
  Bits gate_up = random_bf16(s.rows * 2 * s.hidden, rng, 3.0);
  for (std::int64_t r = 0; r < s.rows; r += 5) {
    gate_up[r * 2 * s.hidden] = float_to_bf16(r % 2 == 0 ? 100.0f : -100.0f);
  }
  return gate_up;
}

TEST(CudaLayerOps, SwigluForwardMatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(12);
  CudaStream stream;
  for (const cpu::SwigluShape& s : kSwigluShapes) {
    SCOPED_TRACE(describe(s));
    const Bits gate_up = swiglu_input(s, rng);
    const DeviceBuffer d_gate_up = to_device(gate_up, stream.get());
    const DeviceBuffer d_out(s.rows * s.hidden * sizeof(bf16));
    cuda::swiglu_forward(as_bf16(d_out), as_bf16(d_gate_up), s, stream.get());
    const std::vector<float> out = download_bf16(d_out.data(), s.rows * s.hidden, stream.get());
    std::vector<float> ref(s.rows * s.hidden);
    cpu::swiglu_forward<float>(ref, widen(gate_up), s);
    EXPECT_TRUE(WithinBf16Rounding("swiglu", out, ref));
  }
}

TEST(CudaLayerOps, SwigluBackwardMatchesTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(13);
  CudaStream stream;
  for (const cpu::SwigluShape& s : kSwigluShapes) {
    SCOPED_TRACE(describe(s));
    const Bits gate_up = swiglu_input(s, rng);
    const Bits dout = random_bf16(s.rows * s.hidden, rng);
    const DeviceBuffer d_gate_up = to_device(gate_up, stream.get());
    const DeviceBuffer d_dout = to_device(dout, stream.get());
    const DeviceBuffer d_dgate_up(s.rows * 2 * s.hidden * sizeof(bf16));
    cuda::swiglu_backward(as_bf16(d_dgate_up), as_bf16(d_dout), as_bf16(d_gate_up), s,
                          stream.get());
    const std::vector<float> out =
        download_bf16(d_dgate_up.data(), s.rows * 2 * s.hidden, stream.get());
    std::vector<float> ref(s.rows * 2 * s.hidden);
    cpu::swiglu_backward<float>(ref, widen(dout), widen(gate_up), s);
    EXPECT_TRUE(WithinBf16Rounding("dgate_up", out, ref));
  }
}

// ---- argument checks ------------------------------------------------------------------------

// The checks run on the host before anything is launched, so they need no GPU: the pointers
// below are never dereferenced.
TEST(CudaLayerOps, ArgumentErrorsNameTheArgument) {
  using test::throws_error_with;
  alignas(16) static std::uint16_t storage[64];
  bf16* b = reinterpret_cast<bf16*>(storage);
  float* f = reinterpret_cast<float*>(storage);
  const std::int32_t* tokens = reinterpret_cast<const std::int32_t*>(storage);
  const cudaStream_t stream = nullptr;

  EXPECT_TRUE(throws_error_with([&] { cuda::to_bf16(nullptr, f, 4, stream); },
                                {"train::cuda::to_bf16", "out is null"}));
  EXPECT_TRUE(throws_error_with([&] { cuda::to_bf16(b, f, 0, stream); },
                                {"train::cuda::to_bf16", "count is 0; expected > 0"}));
  EXPECT_TRUE(throws_error_with([&] { cuda::to_float(f, nullptr, 4, stream); },
                                {"train::cuda::to_float", "in is null"}));
  EXPECT_TRUE(throws_error_with([&] { cuda::residual_add(b, nullptr, 4, stream); },
                                {"train::cuda::residual_add", "x is null"}));
  EXPECT_TRUE(throws_error_with([&] { cuda::residual_add(b, b, -3, stream); },
                                {"train::cuda::residual_add", "count is -3"}));

  const cpu::EmbeddingShape embedding{4, 8, 2};
  EXPECT_TRUE(throws_error_with([&] { cuda::embedding_forward(b, nullptr, b, embedding, stream); },
                                {"train::cuda::embedding_forward", "tokens is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::embedding_forward(b, tokens, b, {4, 0, 2}, stream);
      },
      {"train::cuda::embedding_forward", "shape.vocab is 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::embedding_backward(nullptr, tokens, b, embedding, true, stream); },
      {"train::cuda::embedding_backward", "dtable is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::embedding_backward(f, tokens, b, {0, 8, 2}, false, stream);
      },
      {"train::cuda::embedding_backward", "shape.tokens is 0"}));

  const cpu::RmsNormShape norm{2, 8};
  EXPECT_TRUE(throws_error_with([&] { cuda::rmsnorm_forward(b, f, b, f, norm, 0.0, stream); },
                                {"train::cuda::rmsnorm_forward", "eps is 0"}));
  EXPECT_TRUE(
      throws_error_with([&] { cuda::rmsnorm_forward(b, f, b, nullptr, norm, 1e-5, stream); },
                        {"train::cuda::rmsnorm_forward", "g is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rmsnorm_forward(b, f, b, f, {-1, 8}, 1e-5, stream);
      },
      {"train::cuda::rmsnorm_forward", "shape.rows is -1"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::rmsnorm_backward(b, f, b + 8, b, f, f, norm, Write::add, stream); },
      {"train::cuda::rmsnorm_backward", "dx overlaps dy"}));
  EXPECT_TRUE(throws_error_with(
      [&] { cuda::rmsnorm_backward(b, f, b + 16, b, f, nullptr, norm, Write::add, stream); },
      {"train::cuda::rmsnorm_backward", "inv_rms is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rmsnorm_backward(b, f, b + 16, b, f, f, {2, 0}, Write::add, stream);
      },
      {"train::cuda::rmsnorm_backward", "shape.dim is 0"}));

  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_forward(b, f, f, 1, {1, 1, 7, 7}, stream);
      },
      {"train::cuda::rope_forward", "shape.head_dim is 7; expected an even number"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_forward(b, f, f, 1, {2, 2, 64, 100}, stream);
      },
      {"train::cuda::rope_forward", "shape.token_stride is 100", "128"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_forward(b, f, f, 0, {1, 1, 8, 8}, stream);
      },
      {"train::cuda::rope_forward", "table_rows is 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_forward(b, f, f, 1, {std::int64_t{1} << 31, 1, 8, 8}, stream);
      },
      {"train::cuda::rope_forward", "shape.tokens is 2147483648; expected at most 2147483647"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_forward(b, f, f, 1, {1, 1, 8, std::int64_t{1} << 32}, stream);
      },
      {"train::cuda::rope_forward", "shape.token_stride is 4294967296; expected at most"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_backward(b, nullptr, f, 1, {1, 1, 8, 8}, stream);
      },
      {"train::cuda::rope_backward", "cos is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_backward(nullptr, f, f, 1, {1, 1, 8, 8}, stream);
      },
      {"train::cuda::rope_backward", "dx is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_backward(b, nullptr, f, f, 1, {1, 1, 8, 24}, stream);
      },
      {"train::cuda::rope_backward", "dx_acc is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_backward_heads(b, nullptr, f, f, 1, {1, 2, 8, 24}, stream);
      },
      {"train::cuda::rope_backward_heads", "dx_acc is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_backward_heads(b, f, f, f, 1, {1, 3, 8, 16}, stream);
      },
      {"train::cuda::rope_backward_heads", "shape.token_stride is 16", "24"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_backward(nullptr, f, f, f, 1, {1, 1, 8, 24}, stream);
      },
      {"train::cuda::rope_backward", "dx is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_backward(b, f, f, f, 1, {2, 3, 8, 16}, stream);
      },
      {"train::cuda::rope_backward", "shape.token_stride is 16", "24"}));

  EXPECT_TRUE(throws_error_with([&] { cuda::rope_table({}, 8, kTheta); },
                                {"train::cuda::rope_table", "positions.size() is 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::rope_table({0, -3}, 8, kTheta);
      },
      {"train::cuda::rope_table", "positions[1] is -3"}));
  EXPECT_TRUE(throws_error_with([&] { cuda::rope_table({0}, 5, kTheta); },
                                {"train::cuda::rope_table", "head_dim is 5"}));
  EXPECT_TRUE(throws_error_with([&] { cuda::rope_table({0}, 8, 0.0); },
                                {"train::cuda::rope_table", "theta is 0"}));

  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::swiglu_forward(b, b, {4, 0}, stream);
      },
      {"train::cuda::swiglu_forward", "shape.hidden is 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::swiglu_forward(nullptr, b, {4, 2}, stream);
      },
      {"train::cuda::swiglu_forward", "out is null"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        cuda::swiglu_backward(b, nullptr, b, {4, 2}, stream);
      },
      {"train::cuda::swiglu_backward", "dout is null"}));
}

}  // namespace
}  // namespace ringattn::train

#else

TEST(CudaLayerOps, MatchesCpuTwins) {
  RINGATTN_REQUIRE_GPUS(1);
}

#endif
