// The CUDA flash block against the fp64 oracle with the FlashAttention criterion (TESTING.md),
// over the shape list that breaks tiling, both dtypes, every head dim of the build and 192/128 (V
// of its own width), masks by global position, GQA, packed QKV views, combine mode, the
// deterministic backward, and its argument checks. Four ctests, each a quarter of the cases, so
// that their fp64 oracles run side by side on the host:
// ringattn-gpu-shards: 4
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/gpu.hpp"
#include "tests/common/head_dims.hpp"
#include "tests/common/low_precision_attention.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/device_buffer.hpp"
#include "tests/common/flash_device_problem.hpp"

namespace ringattn::test {
namespace {

class FlashCuda : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { RINGATTN_REQUIRE_GPUS(1); }
};

TEST_P(FlashCuda, MatchesOracleWithinFlashCriterion) {
  SCOPED_TRACE(seed_trace());
  expect_case_within_criterion(GetParam(), 1);
}

std::vector<Case> shape_list() {
  std::vector<Case> cases;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (std::int64_t d : {64, 128}) {
      for (bool causal : {false, true}) {
        cases.push_back({dtype, 2, 1, 1, 2, 2, d, causal});
        cases.push_back({dtype, 1, 17, 17, 4, 4, d, causal});
        cases.push_back({dtype, 2, 127, 127, 4, 1, d, causal});      // MQA
        cases.push_back({dtype, 1, 1000, 1000, 8, 2, d, causal});    // GQA 4
        cases.push_back({dtype, 1, 100, 300, 8, 1, d, causal});      // GQA 8, Sq < Sk
      }
      cases.push_back({dtype, 1, 300, 100, 2, 2, d, true, 200, 0});   // rows past every key
      cases.push_back({dtype, 1, 130, 200, 2, 1, d, true, 0, 60});    // rows before every key
      cases.push_back({dtype, 2, 257, 257, 6, 2, d, true, 0, 0, true});   // packed QKV
      cases.push_back({dtype, 1, 129, 129, 2, 2, d, false, 0, 0, false, 12.0});  // scores ~1e4
      // Scores spread over hundreds: row maxima jump from key tile to key tile, by more and by
      // less than the forward keeps a stale maximum through, and not in every row of a warp;
      // jumps past 128 (log2 units) overflow the probabilities against the old maximum.
      cases.push_back({dtype, 1, 200, 700, 2, 2, d, true, 500, 0, false, 12.0});
      // Scores spread over tens: the maxima move by scaling the tile's probabilities.
      cases.push_back({dtype, 1, 200, 700, 2, 2, d, true, 500, 0, false, 4.0});
    }
  }
  // Every other head dim of the build (on Hopper the wgmma kernels, 32 and 96 in zero-padded
  // panels, 192 and 256 on the wide backward; kernels.flash.sm80 runs the bf16 ones on the sm_80
  // family there too): odd lengths, GQA and MQA, causal or not, Sq < Sk, packed QKV and scores
  // spread over hundreds; at 192 and 256 also the ends of the list above (one row, rows past or
  // before every key, scores near 1e4 and spread over tens, many key blocks).
  for (const std::int64_t d : kBuiltCudaHeadDims) {
    if (d == 64 || d == 128) continue;
    for (DType dtype : {DType::bf16, DType::f16}) {
      cases.push_back({dtype, 1, 17, 17, 4, 4, d, false});
      cases.push_back({dtype, 2, 127, 127, 4, 1, d, true});               // MQA
      cases.push_back({dtype, 1, 300, 300, 8, 2, d, false});              // GQA 4
      cases.push_back({dtype, 1, 300, 300, 8, 2, d, true});
      cases.push_back({dtype, 1, 100, 300, 4, 1, d, true});               // Sq < Sk
      cases.push_back({dtype, 2, 257, 257, 6, 2, d, true, 0, 0, true});  // packed QKV
      cases.push_back({dtype, 1, 200, 700, 2, 2, d, true, 500, 0, false, 12.0});
      if (d < 192) continue;
      cases.push_back({dtype, 2, 1, 1, 2, 2, d, true});
      cases.push_back({dtype, 1, 300, 100, 2, 2, d, true, 200, 0});
      cases.push_back({dtype, 1, 130, 200, 2, 1, d, true, 0, 60});
      cases.push_back({dtype, 1, 129, 129, 2, 2, d, false, 0, 0, false, 12.0});
      cases.push_back({dtype, 1, 200, 700, 2, 2, d, true, 500, 0, false, 4.0});
      cases.push_back({dtype, 1, 700, 700, 4, 2, d, false});
    }
  }
  // Head dim 192 with v_head_dim 128 (multi-head latent attention; on Hopper the wgmma forward and
  // the wide backward, the sm_80 family elsewhere):
  // the list above and the ends of the 64 and 128 one (rows past or before every key, scores near
  // 1e4 and spread over tens, GQA 8 with Sq < Sk, a length past four row tiles).
  if (kBuiltCudaValueDimPair) {
    const CudaDims pair{kCudaPairHeadDim, kCudaPairValueDim};
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (bool causal : {false, true}) {
        cases.push_back(with_dims({dtype, 2, 1, 1, 2, 2, 0, causal}, pair));
        cases.push_back(with_dims({dtype, 1, 17, 17, 4, 4, 0, causal}, pair));
        cases.push_back(with_dims({dtype, 2, 127, 127, 4, 1, 0, causal}, pair));    // MQA
        cases.push_back(with_dims({dtype, 1, 300, 300, 8, 2, 0, causal}, pair));    // GQA 4
        cases.push_back(with_dims({dtype, 1, 100, 300, 8, 1, 0, causal}, pair));    // GQA 8
        cases.push_back(with_dims({dtype, 2, 257, 257, 6, 2, 0, causal, 0, 0, true}, pair));
      }
      cases.push_back(with_dims({dtype, 1, 300, 100, 2, 2, 0, true, 200, 0}, pair));
      cases.push_back(with_dims({dtype, 1, 130, 200, 2, 1, 0, true, 0, 60}, pair));
      cases.push_back(with_dims({dtype, 1, 129, 129, 2, 2, 0, false, 0, 0, false, 12.0}, pair));
      cases.push_back(with_dims({dtype, 1, 200, 700, 2, 2, 0, true, 500, 0, false, 12.0}, pair));
      cases.push_back(with_dims({dtype, 1, 200, 700, 2, 2, 0, true, 500, 0, false, 4.0}, pair));
    }
    cases.push_back(with_dims({DType::bf16, 1, 1000, 1000, 4, 1, 0, true}, pair));
  }
  cases.push_back({DType::bf16, 1, 4097, 4097, 1, 1, 64, true});
  // Few key blocks over many rows: the Hopper backward splits each key block's rows over 4 and 2
  // CTAs (uneven parts, a partial last tile, GQA, batch 2) that add into dK and dV together.
  cases.push_back({DType::bf16, 1, 16400, 200, 2, 1, 128, false});
  cases.push_back({DType::f16, 2, 8200, 130, 4, 2, 64, false});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(ShapeList, FlashCuda, ::testing::ValuesIn(shape_list()), case_name);

TEST(FlashCudaCombine, ChunksMergeToOneShotAttention) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  for (const CudaDims& dims : built_cuda_dims()) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE("head_dim " + std::to_string(dims.head_dim) + ", v_head_dim " +
                 std::to_string(dims.v_head_dim));
    const Case c = with_dims({DType::bf16, 2, 200, 333, 4, 2, 0, causal, 133, 0}, dims);
    DeviceProblem problem(c, 2);
    const AttentionResult ref = problem.oracle();
    const AttentionResult low = problem.low();
    // Running fp32 (O, LSE) starts at (0, -inf); the keys arrive in three unequal chunks.
    const std::int64_t B = c.batch, Sq = c.q_len, Hq = c.q_heads, D = c.value_dim();
    DeviceBuffer running_o(B * Sq * Hq * D * sizeof(float)), running_lse(B * Hq * Sq * sizeof(float));
    RINGATTN_CUDA_CHECK(cudaMemset(running_o.data(), 0, running_o.bytes()));
    std::vector<float> neg_inf(B * Hq * Sq, -std::numeric_limits<float>::infinity());
    RINGATTN_CUDA_CHECK(cudaMemcpy(running_lse.data(), neg_inf.data(), running_lse.bytes(), cudaMemcpyHostToDevice));
    const TensorView o_acc = TensorView::contiguous(running_o.data(), DType::f32, {B, Sq, Hq, D}, Memory::device);
    const TensorView lse_acc = TensorView::contiguous(running_lse.data(), DType::f32, {B, Hq, Sq}, Memory::device);
    const std::int64_t bounds[] = {0, 64, 250, c.k_len};
    for (int chunk = 0; chunk < 3; ++chunk) {
      TensorView k = problem.k_view, v = problem.v_view;
      const std::int64_t first = bounds[chunk], len = bounds[chunk + 1] - first;
      k.data = static_cast<std::uint16_t*>(k.data) + first * k.strides[1];
      v.data = static_cast<std::uint16_t*>(v.data) + first * v.strides[1];
      k.shape[1] = v.shape[1] = len;
      cuda::flash_forward({problem.q_view, k, v, o_acc, lse_acc, problem.scale(),
                           {causal, c.q_start, c.k_start + first}, true});
    }
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto o = widen(download<float>(running_o, o_acc.numel()));
    const auto lse = widen(download<float>(running_lse, lse_acc.numel()));
    EXPECT_TRUE(WithinFlashCriterion(causal ? "combined O (causal)" : "combined O", o, low.o, ref.o));
    EXPECT_TRUE(WithinFlashCriterion(causal ? "combined LSE (causal)" : "combined LSE", lse, low.lse, ref.lse));
  }
  }
}

TEST(FlashCudaDeterministic, TwoRunsAreBitwiseEqual) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  for (const CudaDims& dims : built_cuda_dims()) {
    SCOPED_TRACE("head_dim " + std::to_string(dims.head_dim) + ", v_head_dim " +
                 std::to_string(dims.v_head_dim));
    const std::int64_t len = dims.head_dim == 128 ? 1000 : 300;
    DeviceProblem problem(with_dims({DType::bf16, 2, len, len, 8, 2, 0, true}, dims), 3);
    const AttentionResult first = problem.run(true);
    const AttentionResult second = problem.run(true);
    EXPECT_EQ(std::memcmp(first.dq.data(), second.dq.data(), first.dq.size() * sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(first.dk.data(), second.dk.data(), first.dk.size() * sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(first.dv.data(), second.dv.data(), first.dv.size() * sizeof(double)), 0);
  }
}

// overwrite_key_gradients: dK and dV start as NaN and come out as the block's gradients (zeros for
// the keys no row sees), dQ still adds into its zeros. Causal with three key blocks after every
// query (CTAs without rows); unmasked with two key blocks of 16 row tiles x 4 query heads (rows
// split over CTAs that add: dK and dV zeroed first); head_dim 64 with a 2-key last block; the
// causal case at each other head dim, 192/128 too (and unmasked there); and the split rows at 96
// (zero-padded panels on Hopper).
TEST(FlashCudaOverwrite, KeyGradientsAreWrittenNotRead) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  std::vector<Case> cases = {{DType::bf16, 1, 200, 600, 4, 2, 128, true},
                             {DType::bf16, 1, 4096, 256, 4, 1, 128, false},
                             {DType::f16, 2, 3000, 130, 2, 1, 64, false}};
  for (const CudaDims& dims : built_cuda_dims()) {
    if (dims.v_head_dim != dims.head_dim || (dims.head_dim != 64 && dims.head_dim != 128)) {
      cases.push_back(with_dims({DType::bf16, 1, 200, 600, 4, 2, 0, true}, dims));
    }
    if (dims.v_head_dim == 96 && dims.head_dim == 96) {
      cases.push_back(with_dims({DType::bf16, 1, 4096, 256, 4, 1, 0, false}, dims));
    }
  }
  if (kBuiltCudaValueDimPair) {
    cases.push_back(with_dims({DType::f16, 2, 300, 130, 2, 1, 0, false},
                              {kCudaPairHeadDim, kCudaPairValueDim}));
  }
  for (const Case& c : cases) {
    DeviceProblem problem(c, 4);
    const AttentionResult ref = problem.oracle();
    const AttentionResult low = problem.low();
    for (bool deterministic : {false, true}) {
      SCOPED_TRACE(case_name({c, 0}) + (deterministic ? " deterministic" : ""));
      expect_within_criterion(problem.run(deterministic, true), low, ref);
    }
  }
}

// Overwritten dK and dV in the input dtype: each element is the fp32 overwrite's rounded once.
// Bitwise where both runs form it alike (the same products; only the stores differ): causal, and
// the deterministic mode. Unmasked with atomic dQ, the fp32 run splits long rows over CTAs that
// add their parts with atomics (the rounded one never splits), so the sums differ in order: there
// within the rounding, |out - fp32| <= u |fp32| (1 + 2^-10) + 2^-12 max|fp32| (u = 2^-8 for bf16,
// 2^-11 for f16). The last term covers the fp32 reordering of up to ~64 parts whose sizes exceed
// the sum's where they cancel (2^-24 per addition); a lost or doubled part is of the order of
// max|fp32|. The fp32 runs are held to the oracle above.
TEST(FlashCudaOverwrite, RoundedKeyGradientsAreTheFp32OnesRounded) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  std::vector<Case> cases = {{DType::bf16, 1, 200, 600, 4, 2, 128, true},
                             {DType::bf16, 1, 4096, 256, 4, 1, 128, false},
                             {DType::f16, 2, 3000, 130, 2, 1, 64, false},
                             {DType::bf16, 1, 1000, 1000, 8, 8, 128, true}};
  if (kBuiltCudaValueDimPair) {  // dK of 192 and dV of 128 columns, split over two warps a key
    const CudaDims pair{kCudaPairHeadDim, kCudaPairValueDim};
    cases.push_back(with_dims({DType::bf16, 1, 200, 600, 4, 2, 0, true}, pair));
    cases.push_back(with_dims({DType::f16, 1, 1000, 300, 4, 1, 0, false}, pair));
  }
  for (const Case& c : cases) {
    DeviceProblem problem(c, 5);
    for (bool deterministic : {false, true}) {
      SCOPED_TRACE(case_name({c, 0}) + (deterministic ? " deterministic" : ""));
      const bool bitwise = c.causal || deterministic;
      const double unit = c.dtype == DType::bf16 ? 0x1p-8 : 0x1p-11;
      const AttentionResult wide = problem.run(deterministic, true);
      const AttentionResult rounded = problem.run(deterministic, true, true);
      const std::pair<const char*, const std::vector<double>*> parts[] = {
          {"dK", &wide.dk}, {"dV", &wide.dv}};
      const std::vector<double>* got[] = {&rounded.dk, &rounded.dv};
      for (int i = 0; i < 2; ++i) {
        const std::vector<double>& expected = *parts[i].second;
        ASSERT_EQ(got[i]->size(), expected.size());
        double largest = 0.0;
        for (const double x : expected) largest = std::max(largest, std::abs(x));
        std::size_t wrong = 0, first = expected.size();
        for (std::size_t e = 0; e < expected.size(); ++e) {
          const double out = (*got[i])[e];
          const bool ok =
              bitwise ? out == round_to(c.dtype, expected[e])
                      : std::abs(out - expected[e]) <=
                            unit * std::abs(expected[e]) * (1.0 + 0x1p-10) + 0x1p-12 * largest;
          if (!ok && wrong++ == 0) first = e;
        }
        EXPECT_EQ(wrong, 0u) << parts[i].first
                             << (bitwise ? ": elements unlike the fp32 result rounded"
                                         : ": elements beyond one rounding of the fp32 result")
                             << ", first " << first;
      }
    }
  }
}

// key_rotation: dK's RoPE undone in the kernel equals the call without it rotated back in double
// (test::rotate_keys_back), in the three ways dK is written: added into zeros (row splits with
// atomics where unmasked), overwritten in fp32, rounded to the input dtype. Where both calls form
// the same fp32 sums (causal, or deterministic) the only differences are the rotation's rounding,
// |err| <= 2^-22 (|x c| + |y s| + |x s| + |y c|), and the output's, u |exact| (1 + 2^-10) with
// u = 2^-8 (bf16), 2^-11 (f16), 0 (fp32), or half the subnormals' spacing for a value below the
// smallest normal (f16: 2^-25; RINGATTN_TEST_SEED=10873053109699150316 writes such a dK). Unmasked with atomics the sums differ in order: there
// the bound of RoundedKeyGradientsAreTheFp32OnesRounded's reordering, 2^-12 max|dK|, is added.
// dV is bitwise the call's without rotation where the sums are formed alike.
TEST(FlashCudaKeyRotation, KeyGradientsAreRotatedBack) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  std::vector<Case> cases = {{DType::bf16, 1, 200, 600, 4, 2, 128, true},
                             {DType::bf16, 1, 4096, 256, 4, 1, 128, false},
                             {DType::f16, 2, 3000, 130, 2, 1, 64, false},
                             {DType::bf16, 2, 1000, 1000, 8, 8, 128, true}};
  if (kBuiltCudaValueDimPair) {  // RoPE over dK's 192 columns, each warp holding half of them
    const CudaDims pair{kCudaPairHeadDim, kCudaPairValueDim};
    cases.push_back(with_dims({DType::bf16, 1, 200, 600, 4, 2, 0, true}, pair));
    cases.push_back(with_dims({DType::f16, 2, 700, 300, 4, 2, 0, false}, pair));
  }
  for (const Case& c : cases) {
    DeviceProblem problem(c, 6);
    std::mt19937_64 rng = make_rng(11);
    const test::KeyRotationTables<float> tables =
        test::random_key_rotation<float>(c.k_len, c.head_dim, rng);
    DeviceBuffer cos_buffer(tables.cos.size() * sizeof(float));
    DeviceBuffer sin_buffer(tables.sin.size() * sizeof(float));
    RINGATTN_CUDA_CHECK(cudaMemcpy(cos_buffer.data(), tables.cos.data(), cos_buffer.bytes(),
                                   cudaMemcpyHostToDevice));
    RINGATTN_CUDA_CHECK(cudaMemcpy(sin_buffer.data(), tables.sin.data(), sin_buffer.bytes(),
                                   cudaMemcpyHostToDevice));
    const KeyRotation rotation{
        TensorView::contiguous(cos_buffer.data(), DType::f32, {c.k_len, tables.half}, Memory::device),
        TensorView::contiguous(sin_buffer.data(), DType::f32, {c.k_len, tables.half}, Memory::device)};
    for (bool deterministic : {false, true}) {
      for (int mode = 0; mode < 3; ++mode) {  // added, overwritten fp32, rounded
        const bool overwrite = mode > 0, rounded = mode == 2;
        SCOPED_TRACE(case_name({c, 0}) + (deterministic ? " deterministic" : "") +
                     (mode == 0 ? " added" : mode == 1 ? " overwritten" : " rounded"));
        const bool same_sums = c.causal || deterministic;
        const double unit = !rounded ? 0.0 : c.dtype == DType::bf16 ? 0x1p-8 : 0x1p-11;
        const AttentionResult plain = problem.run(deterministic, overwrite);
        const AttentionResult turned = problem.run(deterministic, overwrite, rounded, rotation);
        std::vector<double> expected, magnitude;
        test::rotate_keys_back(plain.dk, problem.s, tables, expected, magnitude);
        ASSERT_EQ(turned.dk.size(), expected.size());
        double largest = 0.0;
        for (const double x : expected) largest = std::max(largest, std::abs(x));
        std::size_t wrong = 0, first = expected.size();
        for (std::size_t e = 0; e < expected.size(); ++e) {
          const double bound = unit * std::abs(expected[e]) * (1.0 + 0x1p-10) +
                               (rounded ? half_subnormal_spacing(c.dtype) : 0.0) +
                               0x1p-22 * magnitude[e] + (same_sums ? 0.0 : 0x1p-12 * largest);
          if (!(std::abs(turned.dk[e] - expected[e]) <= bound) && wrong++ == 0) first = e;
        }
        EXPECT_EQ(wrong, 0u) << "dK elements beyond the bound, first " << first << ": "
                             << (first < expected.size() ? turned.dk[first] : 0.0) << " against "
                             << (first < expected.size() ? expected[first] : 0.0);
        if (same_sums) {
          std::size_t unlike = 0;
          for (std::size_t e = 0; e < plain.dv.size(); ++e) {
            unlike += turned.dv[e] != (rounded ? round_to(c.dtype, plain.dv[e]) : plain.dv[e]);
          }
          EXPECT_EQ(unlike, 0u) << "dV elements unlike the call's without rotation";
        }
      }
    }
  }
}

// The prepare's dQ zeroing on a strided view (heads 1 and 2 of 4 in each token's row of a wider
// fp32 buffer, as a packed dQKV gradient row): the view comes out zero, every other element keeps
// its value, and delta equals the prepare without zeroing bitwise and a host sum in double to
// fp32 rounding. Odd lengths, every head dim of the build, and O of 128 with a dQ of 192.
TEST(FlashCudaPrepare, ZeroesAStridedDqAndNothingElse) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  for (const CudaDims& dims : built_cuda_dims()) {
    const std::int64_t B = 2, S = 77, H = 2, D = dims.head_dim, Dv = dims.v_head_dim, row = 4 * D;
    SCOPED_TRACE("head_dim " + std::to_string(D) + ", v_head_dim " + std::to_string(Dv));
    DeviceProblem problem(with_dims({DType::bf16, B, S, S, H, H, 0, false}, dims), 9);
    DeviceBuffer o_buffer;
    std::mt19937_64 rng = make_rng(10);
    const std::vector<double> o = random_rounded(DType::bf16, B * S * H * Dv, rng, 1.0);
    const TensorView o_view = problem.upload(o_buffer, o, {B, S, H, Dv});
    const std::vector<float> sentinel(B * S * row, 7.0f);
    DeviceBuffer wide(sentinel.size() * sizeof(float));
    RINGATTN_CUDA_CHECK(cudaMemcpy(wide.data(), sentinel.data(), wide.bytes(), cudaMemcpyHostToDevice));
    const TensorView dq = TensorView::contiguous(wide.as<float>() + D, DType::f32, {B, S, H, D}, Memory::device)
                              .with_strides({S * row, row, D, 1});
    cuda::flash_backward_prepare(o_view, problem.dout_view, problem.delta_view, nullptr, &dq);
    const std::vector<float> zeroing_delta = download<float>(problem.delta, B * H * S);
    RINGATTN_CUDA_CHECK(cudaMemset(problem.delta.data(), 0xff, problem.delta.bytes()));
    cuda::flash_backward_prepare(o_view, problem.dout_view, problem.delta_view);
    const std::vector<float> plain_delta = download<float>(problem.delta, B * H * S);
    const std::vector<float> after = download<float>(wide, sentinel.size());
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(after.size()); ++i) {
      const std::int64_t column = i % row;
      const bool inside = column >= D && column < 3 * D;
      wrong += after[i] != (inside ? 0.0f : 7.0f);
    }
    EXPECT_EQ(wrong, 0) << "elements of the wide buffer with the wrong value after the zeroing";
    EXPECT_EQ(0, std::memcmp(zeroing_delta.data(), plain_delta.data(), plain_delta.size() * sizeof(float)));
    double worst = 0.0;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < S; ++t) {
          double sum = 0.0, magnitude = 0.0;
          for (std::int64_t x = 0; x < Dv; ++x) {
            const std::int64_t at = ((b * S + t) * H + h) * Dv + x;
            sum += o[at] * problem.dout[at];
            magnitude += std::abs(o[at] * problem.dout[at]);
          }
          worst = std::max(worst, std::abs(zeroing_delta[(b * H + h) * S + t] - sum) / magnitude);
        }
    EXPECT_LT(worst, 1e-5) << "delta against a host sum in double, relative to sum |o dO|";
  }
}

TEST(FlashCudaArguments, BadInputIsNamedBeforeAnyLaunch) {
  RINGATTN_REQUIRE_GPUS(1);
  DeviceProblem problem({DType::bf16, 1, 64, 64, 2, 2, 64, false}, 4);
  const double scale = problem.scale();
  ForwardArgs good{problem.q_view, problem.k_view, problem.v_view, problem.o_view, problem.lse_view, scale, {}, false};

  // Host memory labelled as device memory.
  std::vector<std::uint16_t> host(problem.q_view.numel());
  ForwardArgs args = good;
  args.q.data = host.data();
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_forward(args); }, {"q", "host memory", "device memory"}));
  // A head dimension without kernels.
  // (q, k and v may share memory, being read; o has its own.)
  DeviceBuffer wide(64 * 2 * 80 * 2 * 2);
  args = good;
  args.q = TensorView::contiguous(wide.data(), DType::bf16, {1, 64, 2, 80}, Memory::device);
  args.k = args.q;
  args.v = args.q;
  args.o = TensorView::contiguous(static_cast<std::byte*>(wide.data()) + 64 * 2 * 80 * 2, DType::bf16,
                                  {1, 64, 2, 80}, Memory::device);
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_forward(args); },
                           {"head_dim 80 is not supported", built_cuda_head_dims_text()}));
  // Rows that are not 16-byte aligned.
  args = good;
  args.k = args.k.with_strides({64 * 2 * 64, 2 * 64 + 4, 64, 1});
  args.k.shape[1] = 32;
  args.v = args.k;
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_forward(args); }, {"k", "stride 132", "multiple of 8"}));
  // The CPU dtypes.
  // (Tensors of 4-byte elements in their own memory, disjoint from lse.)
  DeviceBuffer wide_f32(64 * 2 * 64 * 4 * 2);
  args = good;
  args.q = TensorView::contiguous(wide_f32.data(), DType::f32, {1, 64, 2, 64}, Memory::device);
  args.k = args.q;
  args.v = args.q;
  args.o = TensorView::contiguous(static_cast<std::byte*>(wide_f32.data()) + 64 * 2 * 64 * 4,
                                  DType::f32, {1, 64, 2, 64}, Memory::device);
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_forward(args); }, {"dtype f32", "bf16 or f16"}));
  // GQA divisibility.
  args = good;
  args.k.shape[2] = args.v.shape[2] = 3;
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_forward(args); }, {"2 heads", "3 heads"}));
  // A dQ to zero of another shape or dtype than O's.
  TensorView dq = problem.dq_view;
  dq.shape[1] = 32;
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_backward_prepare(problem.o_view, problem.dout_view, problem.delta_view, nullptr, &dq); },
                           {"cuda::flash_backward_prepare", "dq has shape [1, 32, 2, 64]"}));
  dq = problem.o_view;
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_backward_prepare(problem.o_view, problem.dout_view, problem.delta_view, nullptr, &dq); },
                           {"dq has dtype bf16", "f32"}));
  // A dQ of another head dim than O's outside the pairs with kernels (192/128).
  DeviceBuffer wide_dq(64 * 2 * 192 * 4);
  dq = TensorView::contiguous(wide_dq.data(), DType::f32, {1, 64, 2, 192}, Memory::device);
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_backward_prepare(problem.o_view, problem.dout_view, problem.delta_view, nullptr, &dq); },
                           {"cuda::flash_backward_prepare", "dq has head_dim 192 but o has 64",
                            built_cuda_head_dims_text()}));
  // Key gradients in the input dtype without overwriting them, and dV's dtype unlike dK's.
  BackwardArgs backward{problem.q_view,  problem.k_view,  problem.v_view,  problem.dout_view,
                        problem.lse_view, problem.delta_view, problem.dq_view, problem.k_view,
                        problem.v_view,  scale,           {},              false};
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_backward(backward); },
                           {"cuda::flash_backward", "dk has dtype bf16", "expected f32"}));
  backward.overwrite_key_gradients = true;
  backward.dv = problem.dv_view;
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_backward(backward); },
                           {"dv has dtype f32", "expected bf16", "dk has the dtype of q"}));
}

}  // namespace
}  // namespace ringattn::test

#else

TEST(FlashCuda, NeedsTheCudaBackend) { RINGATTN_REQUIRE_GPUS(1); }

#endif
