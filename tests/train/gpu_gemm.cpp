// The trainer's GEMMs on cuBLASLt (train/cuda/gemm.cpp) against the CPU twin (train/op_matmul)
// on the same bf16 values, widened exactly to fp32: the three products, overwriting and adding,
// at shapes from 8 x 8 x 8 to 1000 x 1024 x 3072 and with a row count that is not a multiple of
// 8; again on pointers aligned to 16 bytes only (another cached algorithm); repeated calls bitwise
// equal; the argument checks; RINGATTN_GEMM_WORKSPACE_MIB's values (on the host).
//
// Tolerance, per element, with rms the root mean square of the reference output:
//
//   bf16 outputs (forward, backward_input):  |out - ref| <= 2^-8 |ref| + 2^-12 rms   (overwrite)
//                                             |out - ref| <= 2^-8 (|ref| + |ref - C|) + 2^-12 rms
//                                                                                    (add into C)
//   fp32 output (backward_weight):           |out - ref| <= 2^-12 (|ref| + rms)
//
// The GPU forms r in fp32 and, for a bf16 output, rounds it once: within 2^-8 |r|, the unit
// roundoff of bf16's 8-bit significand. r and the twin's ref are two fp32 sums of the same exact
// products (a product of two bf16 is exact in fp32) in different orders: typically
// 2^-24 sqrt(k / 2) rms apart (2^-19.5 rms at k = 1024), a few times that at the worst of a few
// million elements; 2^-12 rms leaves a margin for tensor-core accumulation details. Adding into a
// bf16 output C, cuBLASLt's epilogue rounds the product (ref - C, up to the summation order) to
// bf16 before adding C and rounds again: 2^-8 |ref - C| more (the one-rounding bound alone is
// missed by up to 1.8x where the sum cancels, H200, CUDA 13). A transposed operand, a wrong
// leading dimension or a missing beta costs O(rms).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringattn/config.h"
#include "tests/common/gpu.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ringattn/error.hpp"
#include "src/cuda/device_buffer.hpp"
#include "tests/common/bf16_testing.hpp"
#include "tests/common/random.hpp"
#include "tests/train/expect_error.hpp"
#include "train/cuda/gemm.hpp"
#include "train/op_matmul.hpp"

namespace ringattn::train {
namespace {

using bf16 = __nv_bfloat16;
using test::Bits;
using test::BitwiseEqual;
using test::download;
using test::download_bf16;
using test::kBf16Unit;
using test::narrow;
using test::random_bf16;
using test::upload;
using test::widen;

constexpr double kSumSlack = 0x1p-12;  // fp32 summation-order disagreement, relative to rms

enum class Product { forward, backward_input, backward_weight };

std::string describe(Product p, Write write) {
  const char* names[] = {"forward", "backward_input", "backward_weight"};
  return std::string(names[static_cast<int>(p)]) +
         (write == Write::add ? " (Write::add)" : " (Write::overwrite)");
}

// Element counts of a product's operands a, b and its output:
//   forward          a = X [rows, in],   b = W [out, in],  Y [rows, out]
//   backward_input   a = dY [rows, out], b = W [out, in],  dX [rows, in]
//   backward_weight  a = dY [rows, out], b = X [rows, in], dW [out, in] (fp32)
struct Sizes {
  std::size_t a, b, out, inner;
};

Sizes sizes_of(Product p, const cpu::MatmulShape& s) {
  const auto rows = static_cast<std::size_t>(s.rows);
  const auto in = static_cast<std::size_t>(s.in_features);
  const auto out = static_cast<std::size_t>(s.out_features);
  switch (p) {
    case Product::forward:
      return {rows * in, out * in, rows * out, in};
    case Product::backward_input:
      return {rows * out, out * in, rows * in, out};
    case Product::backward_weight:
      return {rows * out, rows * in, out * in, rows};
  }
  return {};
}

// The product on the GPU, with every operand `offset` bytes into its own allocation; `initial` is
// the output's previous value (bf16-representable for a bf16 output). Returns the output.
std::vector<float> run_gpu(cuda::Gemm& gemm, Product p, const cpu::MatmulShape& s, Write write,
                           const Bits& a, const Bits& b, const std::vector<float>& initial,
                           std::size_t offset) {
  const cudaStream_t stream = gemm.stream();
  const bool fp32_out = p == Product::backward_weight;
  DeviceBuffer da(a.size() * sizeof(bf16) + offset), db(b.size() * sizeof(bf16) + offset);
  DeviceBuffer dout(initial.size() * (fp32_out ? sizeof(float) : sizeof(bf16)) + offset);
  void* pa = static_cast<char*>(da.data()) + offset;
  void* pb = static_cast<char*>(db.data()) + offset;
  void* pout = static_cast<char*>(dout.data()) + offset;
  upload(pa, a, stream);
  upload(pb, b, stream);
  if (fp32_out) {
    upload(pout, initial, stream);
  } else {
    upload(pout, narrow(initial), stream);
  }
  const auto* x = static_cast<const bf16*>(pa);
  const auto* y = static_cast<const bf16*>(pb);
  switch (p) {
    case Product::forward:
      gemm.forward(static_cast<bf16*>(pout), x, y, s, write);
      break;
    case Product::backward_input:
      gemm.backward_input(static_cast<bf16*>(pout), x, y, s, write);
      break;
    case Product::backward_weight:
      gemm.backward_weight(static_cast<float*>(pout), x, y, s, write);
      break;
  }
  if (fp32_out) return download<float>(pout, initial.size(), stream);
  return download_bf16(pout, initial.size(), stream);
}

std::vector<float> run_cpu(Product p, const cpu::MatmulShape& s, Write write,
                           const std::vector<float>& a, const std::vector<float>& b,
                           std::vector<float> out) {
  switch (p) {
    case Product::forward:
      cpu::matmul_forward<float>(out, a, b, s, write);
      break;
    case Product::backward_input:
      cpu::matmul_backward_input<float>(out, a, b, s, write);
      break;
    case Product::backward_weight:
      cpu::matmul_backward_weight<float>(out, a, b, s, write);
      break;
  }
  return out;
}

// |out - ref| <= unit (|ref| + |ref - added|) + slack rms(ref) for every element (added: the
// output's previous values under Write::add into bf16, whose epilogue rounds the product ref -
// added too; empty otherwise, and the bound is unit |ref| + slack rms).
::testing::AssertionResult Matches(const std::string& what, const std::vector<float>& out,
                                   const std::vector<float>& ref, double unit, double slack,
                                   const std::vector<float>& added = {}) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << out.size() << " values, expected " << ref.size();
  }
  double squares = 0.0;
  for (const float r : ref) squares += double(r) * double(r);
  const double rms = std::sqrt(squares / static_cast<double>(ref.size()));
  std::size_t bad = 0, first = 0;
  double worst = 0.0;  // the largest |out - ref| / (unit |ref| + slack rms)
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double error = std::fabs(double(out[i]) - double(ref[i]));
    const double product = added.empty() ? 0.0 : std::fabs(double(ref[i]) - double(added[i]));
    const double bound = unit * (std::fabs(double(ref[i])) + product) + slack * rms;
    if (!(error <= bound)) {
      if (bad++ == 0) first = i;
    }
    if (error / bound > worst) worst = error / bound;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << ref.size() << " elements outside " << unit
         << " |ref| + " << slack << " rms (rms " << rms << ", worst at " << worst
         << " times the bound); first at " << first << ": " << out[first] << ", expected "
         << ref[first] << " [" << test::seed_trace() << "]";
}

// One product against the twin, with fresh random operands.
void check_product(cuda::Gemm& gemm, Product p, const cpu::MatmulShape& s, Write write,
                   std::mt19937_64& rng, std::size_t offset = 0) {
  const Sizes n = sizes_of(p, s);
  const Bits a = random_bf16(n.a, rng), b = random_bf16(n.b, rng);
  // Write::add: a previous output of the product's own magnitude, sqrt(inner); overwrite: NaN,
  // which beta = 0 must never read.
  std::vector<float> initial(n.out, std::numeric_limits<float>::quiet_NaN());
  if (write == Write::add) {
    const double scale = std::sqrt(static_cast<double>(n.inner));
    if (p == Product::backward_weight) {
      initial = test::normal_vector<float>(n.out, rng, scale);
    } else {
      initial = widen(random_bf16(n.out, rng, scale));
    }
  }
  const std::vector<float> out = run_gpu(gemm, p, s, write, a, b, initial, offset);
  const std::vector<float> ref = run_cpu(p, s, write, widen(a), widen(b), initial);
  const bool fp32_out = p == Product::backward_weight;
  const bool bf16_add = !fp32_out && write == Write::add;
  EXPECT_TRUE(Matches(describe(p, write), out, ref, fp32_out ? kSumSlack : kBf16Unit, kSumSlack,
                      bf16_add ? initial : std::vector<float>{}));
}

constexpr Product kProducts[] = {Product::forward, Product::backward_input,
                                 Product::backward_weight};
constexpr Write kWrites[] = {Write::overwrite, Write::add};

class GemmShapes : public ::testing::TestWithParam<cpu::MatmulShape> {};

TEST_P(GemmShapes, MatchesCpuTwin) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  const cpu::MatmulShape s = GetParam();
  std::mt19937_64 rng = test::make_rng(static_cast<std::uint64_t>(s.rows * 7 + s.in_features));
  CudaStream stream;
  cuda::Gemm gemm(stream.get());
  EXPECT_EQ(gemm.stream(), stream.get());
  for (const Product p : kProducts) {
    for (const Write write : kWrites) check_product(gemm, p, s, write, rng);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmShapes,
                         ::testing::Values(cpu::MatmulShape{64, 128, 256},
                                           cpu::MatmulShape{1000, 1024, 3072},
                                           cpu::MatmulShape{8, 8, 8}, cpu::MatmulShape{37, 64, 48}),
                         [](const ::testing::TestParamInfo<cpu::MatmulShape>& info) {
                           const cpu::MatmulShape& s = info.param;
                           return "rows" + std::to_string(s.rows) + "_in" +
                                  std::to_string(s.in_features) + "_out" +
                                  std::to_string(s.out_features);
                         });

// cudaMalloc gives 256-byte alignment; 16 bytes past it the heuristic must pick (and the cache
// keep apart) algorithms that take 16-byte aligned operands.
TEST(Gemm, SixteenByteAlignedPointers) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(16);
  CudaStream stream;
  cuda::Gemm gemm(stream.get());
  const cpu::MatmulShape s{96, 136, 264};
  for (const Product p : kProducts) {
    for (const Write write : kWrites) {
      check_product(gemm, p, s, write, rng, 0);
      check_product(gemm, p, s, write, rng, 16);
      check_product(gemm, p, s, write, rng, 48);
    }
  }
}

// The second call of a shape reuses the cached algorithm: the same bits.
TEST(Gemm, RepeatedCallsAreBitwiseEqual) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(17);
  CudaStream stream;
  cuda::Gemm gemm(stream.get());
  const cpu::MatmulShape s{200, 512, 384};
  for (const Product p : kProducts) {
    const Sizes n = sizes_of(p, s);
    const Bits a = random_bf16(n.a, rng), b = random_bf16(n.b, rng);
    const std::vector<float> initial = widen(random_bf16(n.out, rng, 10.0));
    for (const Write write : kWrites) {
      const std::vector<float> first = run_gpu(gemm, p, s, write, a, b, initial, 0);
      const std::vector<float> second = run_gpu(gemm, p, s, write, a, b, initial, 0);
      EXPECT_TRUE(BitwiseEqual(describe(p, write), first, second));
    }
  }
}

// forward with a residual R: Y = R + X W^T, Y (NaN before) never read, R left as it was; the twin
// adds into a copy of R. Also R == Y (the in-place Write::add).
TEST(Gemm, ForwardWithResidual) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(18);
  CudaStream stream;
  cuda::Gemm gemm(stream.get());
  for (const cpu::MatmulShape s : {cpu::MatmulShape{200, 512, 384}, cpu::MatmulShape{37, 64, 48}}) {
    const Sizes n = sizes_of(Product::forward, s);
    const Bits x = random_bf16(n.a, rng), w = random_bf16(n.b, rng);
    const Bits r = random_bf16(n.out, rng, std::sqrt(static_cast<double>(n.inner)));
    DeviceBuffer dx(n.a * sizeof(bf16)), dw(n.b * sizeof(bf16)), dr(n.out * sizeof(bf16)),
        dy(n.out * sizeof(bf16));
    upload(dx.data(), x, stream.get());
    upload(dw.data(), w, stream.get());
    upload(dr.data(), r, stream.get());
    upload(dy.data(), narrow(std::vector<float>(n.out, std::numeric_limits<float>::quiet_NaN())),
           stream.get());
    gemm.forward(dy.as<bf16>(), dx.as<bf16>(), dw.as<bf16>(), s, Write::add, dr.as<bf16>());
    const std::vector<float> ref =
        run_cpu(Product::forward, s, Write::add, widen(x), widen(w), widen(r));
    EXPECT_TRUE(Matches("forward (residual)", download_bf16(dy.data(), n.out, stream.get()), ref,
                        kBf16Unit, kSumSlack, widen(r)));
    EXPECT_TRUE(BitwiseEqual("residual (unchanged)", download_bf16(dr.data(), n.out, stream.get()),
                             widen(r)));
    gemm.forward(dr.as<bf16>(), dx.as<bf16>(), dw.as<bf16>(), s, Write::add, dr.as<bf16>());
    EXPECT_TRUE(Matches("forward (residual == y)", download_bf16(dr.data(), n.out, stream.get()),
                        ref, kBf16Unit, kSumSlack, widen(r)));
  }
}

// RINGATTN_GEMM_WORKSPACE_MIB's values (parsed on the host: no GPU needed): unset or empty is
// 32 MiB, whole numbers 0 to 1024 are MiB, anything else is named in the error.
TEST(GemmWorkspace, VariableIsReadOrNamed) {
  using test::throws_error_with;
  EXPECT_EQ(cuda::gemm_workspace_bytes(nullptr), std::size_t{32} << 20);
  EXPECT_EQ(cuda::gemm_workspace_bytes(""), std::size_t{32} << 20);
  EXPECT_EQ(cuda::gemm_workspace_bytes("0"), 0u);
  EXPECT_EQ(cuda::gemm_workspace_bytes("64"), std::size_t{64} << 20);
  EXPECT_EQ(cuda::gemm_workspace_bytes("1024"), std::size_t{1024} << 20);
  for (const char* bad : {"abc", "-1", "1025", "12x"}) {
    EXPECT_TRUE(throws_error_with([&] { cuda::gemm_workspace_bytes(bad); },
                                  {"RINGATTN_GEMM_WORKSPACE_MIB", std::string("'") + bad + "'",
                                   "[0, 1024]"}))
        << bad;
  }
}

TEST(Gemm, ArgumentErrorsNameTheArgument) {
  RINGATTN_REQUIRE_GPUS(1);
  using test::throws_error_with;
  CudaStream stream;
  cuda::Gemm gemm(stream.get());
  // Never read: every call below fails its checks before anything is enqueued.
  DeviceBuffer buffer(4096);
  bf16* b = buffer.as<bf16>();
  float* f = buffer.as<float>();
  const cpu::MatmulShape s{8, 16, 24};

  EXPECT_TRUE(throws_error_with([&] { gemm.forward(nullptr, b, b, s); },
                                {"train::cuda::Gemm::forward", "y is null"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.forward(b, b, nullptr, s); },
                                {"train::cuda::Gemm::forward", "w is null"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.backward_input(b, nullptr, b, s); },
                                {"train::cuda::Gemm::backward_input", "dy is null"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.backward_weight(nullptr, b, b, s); },
                                {"train::cuda::Gemm::backward_weight", "dw is null"}));

  EXPECT_TRUE(throws_error_with([&] { gemm.forward(b, b, b, s, Write::overwrite, b); },
                                {"train::cuda::Gemm::forward", "residual is given with "
                                 "Write::overwrite; expected Write::add"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.forward(b, b + 1, b, s); },
                                {"train::cuda::Gemm::forward", "x (address", "16-byte aligned"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.forward(b, b, b, s, Write::add, b + 4); },
                                {"train::cuda::Gemm::forward", "residual (address",
                                 "16-byte aligned"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.backward_input(b + 4, b, b, s); },
                                {"train::cuda::Gemm::backward_input", "dx (address"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.backward_weight(f + 2, b, b, s); },
                                {"train::cuda::Gemm::backward_weight", "dw (address"}));
  EXPECT_TRUE(throws_error_with([&] { gemm.backward_weight(f, b, b + 8 + 3, s); },
                                {"train::cuda::Gemm::backward_weight", "x (address"}));

  EXPECT_TRUE(throws_error_with(
      [&] {
        gemm.forward(b, b, b, {0, 16, 24});
      },
      {"train::cuda::Gemm::forward", "shape.rows is 0; expected > 0"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        gemm.backward_input(b, b, b, {8, -8, 24});
      },
      {"train::cuda::Gemm::backward_input", "shape.in_features is -8"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        gemm.forward(b, b, b, {8, 12, 24});
      },
      {"train::cuda::Gemm::forward", "shape.in_features is 12", "multiple of 8"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        gemm.backward_weight(f, b, b, {8, 16, 20});
      },
      {"train::cuda::Gemm::backward_weight", "shape.out_features is 20", "multiple of 8"}));
}

}  // namespace
}  // namespace ringattn::train

#else

TEST(Gemm, MatchesCpuTwin) {
  RINGATTN_REQUIRE_GPUS(1);
}

#endif
