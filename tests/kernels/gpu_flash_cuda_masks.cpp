// The CUDA flash block under sliding windows and packed documents, against the fp64 oracle with the
// FlashAttention criterion (TESTING.md), at every built head dim (and 192/128) and both dtypes:
// document boundaries at, just before and just after the kernels' tile edges (16, 32, 64 and 128
// rows or keys), one-token and empty documents, one list per batch row, windows of 1 and around
// tile sizes, both sides, windows with documents, chunks of a longer sequence whose rows or keys
// see nothing, scores near 1e4, GQA and packed QKV; the atomic and the deterministic backward,
// combine mode over key chunks, and two deterministic runs bitwise equal. Two ctests, each half
// of the cases:
// ringattn-gpu-shards: 2
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

class FlashCudaMasks : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { RINGATTN_REQUIRE_GPUS(1); }
};

TEST_P(FlashCudaMasks, MatchesOracleWithinFlashCriterion) {
  SCOPED_TRACE(seed_trace());
  expect_case_within_criterion(GetParam(), 11);
}

std::vector<Case> mask_cases() {
  std::vector<Case> cases;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (const CudaDims& dims : built_cuda_dims()) {
      const std::int64_t d = dims.head_dim;
      const auto add = [&](const char* label, Case c) {
        c.dtype = dtype;
        c.label = label;
        cases.push_back(with_dims(c, dims));
      };
      Case c{dtype, 1, 300, 300, 4, 2, d, true};
      c.documents = {64, 128, 192, 256};  // at tile edges
      add("docs_at_edges", c);
      c = {dtype, 1, 290, 290, 2, 1, d, false};
      c.documents = {15, 17, 31, 33, 63, 65, 127, 129, 255, 257};  // around them
      add("docs_around_edges", c);
      c = {dtype, 1, 200, 200, 4, 4, d, true};
      c.documents = {-5, 0, 0, 1, 2, 3, 40, 40, 41, 150, 1000};  // empty, one-token, outside
      add("docs_short_empty", c);
      c = {dtype, 2, 180, 180, 4, 1, d, true};
      c.documents = {30, 64, 97, 10, 1000, 1000};  // row 1 padded past the sequence
      c.document_stride = 3;
      add("docs_per_batch_row", c);
      for (std::int64_t window : {1, 32, 64, 65, 129}) {
        c = {dtype, 1, 333, 333, 2, 2, d, true};
        c.window_left = window;
        add(window == 1    ? "window1"
            : window == 32 ? "window32"
            : window == 64 ? "window64"
            : window == 65 ? "window65"
                           : "window129",
            c);
      }
      c = {dtype, 1, 250, 250, 4, 2, d, false};
      c.window_left = 40;
      c.window_right = 70;
      add("window_both_sides", c);
      c = {dtype, 1, 300, 300, 8, 2, d, true};
      c.window_left = 50;
      c.documents = {63, 65, 127, 200};
      add("window_and_docs_gqa4", c);
      c = {dtype, 1, 256, 256, 2, 1, d, true, 0, 0, true};
      c.window_left = 100;
      c.documents = {129};
      add("window_and_docs_packed", c);
      // Queries 1000..1099 against keys 900..1029: rows from 1030 on see no key of the chunk,
      // keys before 950 no row.
      c = {dtype, 1, 100, 130, 2, 1, d, true, 1000, 900};
      c.documents = {950, 1030, 1031, 1100};
      add("chunk_rows_without_keys", c);
      c = {dtype, 1, 100, 70, 2, 2, d, true, 1000, 900};
      c.window_left = 100;
      add("chunk_window_rows_without_keys", c);
      c = {dtype, 1, 1, 200, 2, 1, d, false, 150, 0};
      c.documents = {100, 151};
      add("one_query", c);
      // Scores near 1e4 (q, k ~ 12): maxima jump where a document or the window starts.
      c = {dtype, 1, 260, 260, 2, 1, d, true, 0, 0, false, 12.0};
      c.window_left = 70;
      c.documents = {64, 129};
      add("large_scores", c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Masks, FlashCudaMasks, ::testing::ValuesIn(mask_cases()), case_name);

// Combine mode under documents and a window: the keys arrive in three unequal chunks (one of
// them seen by no row of some documents), merged into a running fp32 (O, LSE).
TEST(FlashCudaMasksCombine, ChunksMergeToTheWholeBlock) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  for (const CudaDims& dims : built_cuda_dims()) {
    SCOPED_TRACE("head_dim " + std::to_string(dims.head_dim) + ", v_head_dim " +
                 std::to_string(dims.v_head_dim));
    Case c = with_dims({DType::bf16, 2, 200, 333, 4, 2, 0, true, 133, 0}, dims);
    c.window_left = 120;
    c.documents = {70, 190, 260};
    DeviceProblem problem(c, 12);
    const AttentionResult ref = problem.oracle();
    const AttentionResult low = problem.low();
    const std::int64_t B = c.batch, Sq = c.q_len, Hq = c.q_heads, D = c.value_dim();
    DeviceBuffer running_o(B * Sq * Hq * D * sizeof(float)), running_lse(B * Hq * Sq * sizeof(float));
    RINGATTN_CUDA_CHECK(cudaMemset(running_o.data(), 0, running_o.bytes()));
    std::vector<float> neg_inf(B * Hq * Sq, -std::numeric_limits<float>::infinity());
    RINGATTN_CUDA_CHECK(cudaMemcpy(running_lse.data(), neg_inf.data(), running_lse.bytes(),
                                   cudaMemcpyHostToDevice));
    const TensorView o_acc =
        TensorView::contiguous(running_o.data(), DType::f32, {B, Sq, Hq, D}, Memory::device);
    const TensorView lse_acc =
        TensorView::contiguous(running_lse.data(), DType::f32, {B, Hq, Sq}, Memory::device);
    const std::int64_t bounds[] = {0, 64, 250, c.k_len};
    for (int chunk = 0; chunk < 3; ++chunk) {
      TensorView k = problem.k_view, v = problem.v_view;
      const std::int64_t first = bounds[chunk], len = bounds[chunk + 1] - first;
      k.data = static_cast<std::uint16_t*>(k.data) + first * k.strides[1];
      v.data = static_cast<std::uint16_t*>(v.data) + first * v.strides[1];
      k.shape[1] = v.shape[1] = len;
      Mask mask = problem.device_mask();
      mask.k_start += first;
      cuda::flash_forward({problem.q_view, k, v, o_acc, lse_acc, problem.scale(), mask, true});
    }
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto o = widen(download<float>(running_o, o_acc.numel()));
    const auto lse = widen(download<float>(running_lse, lse_acc.numel()));
    EXPECT_TRUE(WithinFlashCriterion("combined O", o, low.o, ref.o));
    EXPECT_TRUE(WithinFlashCriterion("combined LSE", lse, low.lse, ref.lse));
  }
}

// The deterministic backward under documents stays bitwise reproducible.
TEST(FlashCudaMasksDeterministic, TwoRunsAreBitwiseEqual) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  for (const CudaDims& dims : built_cuda_dims()) {
    SCOPED_TRACE("head_dim " + std::to_string(dims.head_dim) + ", v_head_dim " +
                 std::to_string(dims.v_head_dim));
    Case c = with_dims({DType::bf16, 2, 500, 500, 8, 2, 0, true}, dims);
    c.documents = {100, 333, 350};
    c.window_left = 200;
    DeviceProblem problem(c, 13);
    const AttentionResult first = problem.run(true);
    const AttentionResult second = problem.run(true);
    EXPECT_EQ(std::memcmp(first.dq.data(), second.dq.data(), first.dq.size() * sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(first.dk.data(), second.dk.data(), first.dk.size() * sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(first.dv.data(), second.dv.data(), first.dv.size() * sizeof(double)), 0);
  }
}

// The GPU streaming reference (cuda::reference_forward/backward, the oracle of long ring checks)
// under the same masks, against the fp64 oracle: fp32 arithmetic, relative 1e-4.
TEST(FlashCudaMasksReference, StreamingReferenceMatchesTheOracle) {
  RINGATTN_REQUIRE_GPUS(1);
  SCOPED_TRACE(seed_trace());
  Case c{DType::bf16, 2, 260, 300, 4, 2, 64, true, 40, 0};
  c.window_left = 90;
  c.documents = {64, 129, 200, 10, 250, 1000};
  c.document_stride = 3;
  DeviceProblem problem(c, 14);
  const AttentionResult ref = problem.oracle();
  const std::int64_t B = c.batch, Sq = c.q_len, Sk = c.k_len, Hq = c.q_heads, Hkv = c.kv_heads,
                     D = c.head_dim;
  DeviceBuffer o(B * Sq * Hq * D * 4), lse(B * Hq * Sq * 4), delta(B * Hq * Sq * 4),
      dq(B * Sq * Hq * D * 4), dk(B * Sk * Hkv * D * 4), dv(B * Sk * Hkv * D * 4);
  const auto view = [](const DeviceBuffer& b, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(b.data(), DType::f32, shape, Memory::device);
  };
  const Mask mask = problem.device_mask();
  cuda::reference_forward(problem.q_view, problem.k_view, problem.v_view, mask, problem.scale(),
                          view(o, {B, Sq, Hq, D}), view(lse, {B, Hq, Sq}));
  cuda::reference_backward(problem.q_view, problem.k_view, problem.v_view, view(o, {B, Sq, Hq, D}),
                           view(lse, {B, Hq, Sq}), problem.dout_view, mask, problem.scale(),
                           view(delta, {B, Hq, Sq}), view(dq, {B, Sq, Hq, D}),
                           view(dk, {B, Sk, Hkv, D}), view(dv, {B, Sk, Hkv, D}));
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(Close("O", widen(download<float>(o, B * Sq * Hq * D)), ref.o, 1e-4));
  EXPECT_TRUE(Close("LSE", widen(download<float>(lse, B * Hq * Sq)), ref.lse, 1e-4));
  EXPECT_TRUE(Close("dQ", widen(download<float>(dq, B * Sq * Hq * D)), ref.dq, 1e-4));
  EXPECT_TRUE(Close("dK", widen(download<float>(dk, B * Sk * Hkv * D)), ref.dk, 1e-4));
  EXPECT_TRUE(Close("dV", widen(download<float>(dv, B * Sk * Hkv * D)), ref.dv, 1e-4));
}

// Document starts in host memory would fault inside the kernels: refused by name before any
// launch, for the forward and the backward.
TEST(FlashCudaMasksChecks, HostDocumentStartsAreRefused) {
  RINGATTN_REQUIRE_GPUS(1);
  Case c{DType::bf16, 1, 64, 64, 2, 2, kBuiltCudaHeadDims[0], true};
  c.documents = {10, 40};
  DeviceProblem problem(c, 15);
  const Mask host = problem.mask();  // the starts' host copy
  EXPECT_TRUE(ThrowsNaming(
      [&] {
        cuda::flash_forward({problem.q_view, problem.k_view, problem.v_view, problem.o_view,
                             problem.lse_view, problem.scale(), host, false});
      },
      {"cuda::flash_forward", "the document starts", "host memory", "expected device memory"}));
  BackwardArgs args{problem.q_view, problem.k_view, problem.v_view, problem.dout_view,
                    problem.lse_view, problem.delta_view, problem.dq_view, problem.dk_view,
                    problem.dv_view, problem.scale(), host};
  EXPECT_TRUE(ThrowsNaming([&] { cuda::flash_backward(args); },
                           {"cuda::flash_backward", "the document starts", "host memory"}));
}

}  // namespace
}  // namespace ringattn::test

#else

TEST(FlashCudaMasks, NeedsCuda) { GTEST_SKIP() << "ringattn was built without CUDA"; }

#endif
