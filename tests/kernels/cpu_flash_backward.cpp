// The CPU flash backward (flash_backward_prepare + flash_backward) against the fp64 oracle's
// textbook backward: the shapes of the forward tests, the add-into contract, the sum over K/V
// chunks with the final O/LSE (how the ring calls it), determinism across thread counts, and the
// argument checks.
//
// Criteria (tests/TESTING.md): f64 inputs ||out - ref|| / ||ref|| < 1e-12, f32 inputs < 1e-5
// against the oracle on the same (float) inputs, for dQ, dK, dV (and delta). With logits near
// 1e4 the f32 problem is ill-conditioned (scores carry ~1e-3 absolute rounding error), so there
// the bound is twice the error of the naive backward in the input precision.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/cpu_flash_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::FlashCase;
using test::FlashProblem;
using test::GradBuffers;
using test::HostTensor;
using test::kTolerance;
using test::Layout;
using test::Logits;
using test::Precision;
using test::read_view;
using test::ThreadCountGuard;

class FlashBackward : public testing::TestWithParam<std::tuple<FlashCase, Precision>> {};

template <typename T>
void run_case(const FlashCase& c) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(20);
  FlashProblem<T> p(c, rng);
  p.forward();
  p.prepare();
  test::check_backward(p, c.layout, rng);
}

TEST_P(FlashBackward, MatchesReference) {
  const auto& [c, dtype] = GetParam();
  if (dtype == Precision::f64) {
    run_case<double>(c);
  } else {
    run_case<float>(c);
  }
}

const FlashCase kCases[] = {
    {"S1", {2, 1, 1, 4, 4, 64}, {}},
    {"S17CausalGqa4", {2, 17, 17, 4, 1, 64}, {true, 0, 0}},
    {"S127CausalGqa8D128", {1, 127, 127, 8, 1, 128}, {true, 0, 0}},
    {"S1000D64", {1, 1000, 1000, 1, 1, 64}, {}},
    {"S1000CausalGqa4D64", {1, 1000, 1000, 4, 1, 64}, {true, 0, 0}},
    {"S4097CausalD32", {1, 4097, 4097, 1, 1, 32}, {true, 0, 0}},
    {"Sq17Sk127Gqa4D32Batch3", {3, 17, 127, 8, 2, 32}, {}},
    {"Sq127Sk17FullyVisibleChunk", {2, 127, 17, 4, 2, 64}, {true, 100, 50}},
    {"CausalChunkRowsWithoutKeys", {1, 127, 65, 4, 2, 64}, {true, 64, 100}},
    {"CausalChunkMaskedTile", {2, 200, 50, 2, 1, 32}, {true, 0, 70}},
    {"CausalBlockFullyMasked", {1, 127, 17, 2, 2, 64}, {true, 0, 200}},
    {"Sq65Sk129D128Batch2", {2, 65, 129, 2, 1, 128}, {}},
    {"HeadDim7", {2, 33, 70, 3, 3, 7}, {true, 37, 0}},
    {"PackedQkvCausalGqa", {2, 127, 127, 4, 2, 64}, {true, 0, 0}, Layout::packed},
    {"HeadMajorSqNeSk", {2, 100, 130, 4, 4, 32}, {true, 80, 0}, Layout::head_major},
    {"LargeOffsetLogitsCausal", {1, 300, 300, 2, 2, 64}, {true, 0, 0}, Layout::contiguous,
     Logits::large_offset},
};

INSTANTIATE_TEST_SUITE_P(Shapes, FlashBackward,
                         testing::Combine(testing::ValuesIn(kCases),
                                          testing::Values(Precision::f64, Precision::f32)),
                         test::case_precision_name);

// ---------------------------------------------------------------------------------------------
// The add-into contract: a second call adds the gradient again.

template <typename T>
void run_adds_twice() {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(21);
  FlashProblem<T> p(FlashCase{"", {2, 70, 90, 4, 2, 32}, {true, 30, 0}}, rng);
  p.forward();
  p.prepare();
  GradBuffers<T> grads(p.s, Layout::contiguous, rng);
  const BackwardArgs args = p.backward_args(grads.buffers);
  cpu::flash_backward(args);
  cpu::flash_backward(args);
  auto ref = p.oracle();
  for (auto* values : {&ref.dq, &ref.dk, &ref.dv}) {
    for (double& x : *values) x *= 2.0;
  }
  EXPECT_TRUE(test::Close("dQ (R + 2 dQ)", grads.added_q(), ref.dq, kTolerance<T>));
  EXPECT_TRUE(test::Close("dK (R + 2 dK)", grads.added_k(), ref.dk, kTolerance<T>));
  EXPECT_TRUE(test::Close("dV (R + 2 dV)", grads.added_v(), ref.dv, kTolerance<T>));
}

TEST(FlashBackwardContract, AddsIntoGradientsF64) { run_adds_twice<double>(); }
TEST(FlashBackwardContract, AddsIntoGradientsF32) { run_adds_twice<float>(); }

// overwrite_key_gradients: dK and dV hold the block's gradients whatever they held before (R), also
// for keys 75..89 that no row sees (rows at 5..74, causal); dQ still adds into R.
template <typename T>
void run_overwrite() {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(23);
  FlashProblem<T> p(FlashCase{"", {2, 70, 90, 4, 2, 32}, {true, 5, 0}}, rng);
  p.forward();
  p.prepare();
  GradBuffers<T> grads(p.s, Layout::contiguous, rng);
  BackwardArgs args = p.backward_args(grads.buffers);
  args.overwrite_key_gradients = true;
  cpu::flash_backward(args);
  const auto ref = p.oracle();
  EXPECT_TRUE(test::Close("dQ (R + dQ)", grads.added_q(), ref.dq, kTolerance<T>));
  EXPECT_TRUE(test::Close("dK (overwritten)", read_view(grads.buffers.k), ref.dk, kTolerance<T>));
  EXPECT_TRUE(test::Close("dV (overwritten)", read_view(grads.buffers.v), ref.dv, kTolerance<T>));
}

TEST(FlashBackwardContract, OverwritesKeyGradientsF64) { run_overwrite<double>(); }
TEST(FlashBackwardContract, OverwritesKeyGradientsF32) { run_overwrite<float>(); }

// key_rotation: dK receives (added, or overwritten) the oracle's gradient rotated back in double by
// the tables' transposes (test::rotate_keys_back); dQ and dV are those of the call without it.
template <typename T>
void run_key_rotation() {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(25);
  FlashProblem<T> p(FlashCase{"", {2, 70, 90, 4, 2, 32}, {true, 30, 0}}, rng);
  p.forward();
  p.prepare();
  test::KeyRotationTables<T> tables = test::random_key_rotation<T>(p.s.k_len, p.s.head_dim, rng);
  const auto ref = p.oracle();
  std::vector<double> ref_k, magnitude;
  test::rotate_keys_back(ref.dk, p.s, tables, ref_k, magnitude);
  for (const bool overwrite : {false, true}) {
    SCOPED_TRACE(overwrite ? "overwrite" : "add");
    GradBuffers<T> grads(p.s, Layout::contiguous, rng);
    BackwardArgs args = p.backward_args(grads.buffers);
    args.overwrite_key_gradients = overwrite;
    args.key_rotation = {
        TensorView::contiguous(tables.cos.data(), test::dtype_of<T>(), {p.s.k_len, tables.half}),
        TensorView::contiguous(tables.sin.data(), test::dtype_of<T>(), {p.s.k_len, tables.half})};
    cpu::flash_backward(args);
    const std::vector<double> dk = overwrite ? read_view(grads.buffers.k) : grads.added_k();
    const std::vector<double> dv = overwrite ? read_view(grads.buffers.v) : grads.added_v();
    EXPECT_TRUE(test::Close("dK (rotated back)", dk, ref_k, kTolerance<T>));
    EXPECT_TRUE(test::Close("dV", dv, ref.dv, kTolerance<T>));
    EXPECT_TRUE(test::Close("dQ (R + dQ)", grads.added_q(), ref.dq, kTolerance<T>));
  }
}

TEST(FlashBackwardContract, KeyRotationIsUndoneOnKeyGradientsF64) { run_key_rotation<double>(); }
TEST(FlashBackwardContract, KeyRotationIsUndoneOnKeyGradientsF32) { run_key_rotation<float>(); }

// ---------------------------------------------------------------------------------------------
// The ring's use: the final O/LSE of the whole row, K/V in chunks; each chunk's dK/dV lands in
// its own slice, dQ sums over the chunks. Together: the one-shot gradient.

template <typename T>
void run_chunked(const FlashCase& c, const std::vector<std::int64_t>& bounds,
                 const std::vector<int>& order) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(22);
  FlashProblem<T> p(c, rng);
  p.forward();  // one-shot forward over every key: the final O and LSE
  p.prepare();
  GradBuffers<T> grads(p.s, Layout::contiguous, rng);
  ASSERT_EQ(bounds.back(), p.s.k_len);
  for (int chunk : order) {
    const std::int64_t first = bounds[chunk], len = bounds[chunk + 1] - first;
    BackwardArgs args = p.backward_args(grads.buffers);
    for (TensorView* t : {&args.k, &args.v, &args.dk, &args.dv}) {
      t->data = static_cast<T*>(t->data) + first * t->strides[1];
      t->shape[1] = len;
    }
    args.mask.k_start = c.mask.k_start + first;
    cpu::flash_backward(args);
  }
  const auto ref = p.oracle();
  EXPECT_TRUE(test::Close("dQ", grads.added_q(), ref.dq, kTolerance<T>));
  EXPECT_TRUE(test::Close("dK", grads.added_k(), ref.dk, kTolerance<T>));
  EXPECT_TRUE(test::Close("dV", grads.added_v(), ref.dv, kTolerance<T>));
}

TEST(FlashBackwardChunks, NonCausalTwoChunksF64) {
  run_chunked<double>(FlashCase{"", {2, 60, 173, 4, 2, 64}, {}}, {0, 45, 173}, {1, 0});
}
TEST(FlashBackwardChunks, NonCausalTwoChunksF32) {
  run_chunked<float>(FlashCase{"", {2, 60, 173, 4, 2, 64}, {}}, {0, 45, 173}, {1, 0});
}
// Rows at 100..219; chunk 1 (keys 130..219) masked for rows 0..29, chunk 2 for every row.
TEST(FlashBackwardChunks, CausalMaskedChunksF64) {
  run_chunked<double>(FlashCase{"", {2, 120, 300, 4, 2, 64}, {true, 100, 0}}, {0, 130, 220, 300},
                      {2, 0, 1});
}
TEST(FlashBackwardChunks, CausalMaskedChunksF32) {
  run_chunked<float>(FlashCase{"", {2, 120, 300, 4, 2, 64}, {true, 100, 0}}, {0, 130, 220, 300},
                     {2, 0, 1});
}
// Keys from 50: rows 0..49 see nothing (LSE = -inf), chunk 2 is masked for every row.
TEST(FlashBackwardChunks, CausalRowsWithoutKeysF64) {
  run_chunked<double>(FlashCase{"", {1, 100, 150, 2, 2, 32}, {true, 0, 50}}, {0, 20, 90, 150},
                      {0, 1, 2});
}
TEST(FlashBackwardChunks, CausalRowsWithoutKeysF32) {
  run_chunked<float>(FlashCase{"", {1, 100, 150, 2, 2, 32}, {true, 0, 50}}, {0, 20, 90, 150},
                     {0, 1, 2});
}

// ---------------------------------------------------------------------------------------------
// Determinism: the thread count does not change a bit of O, LSE, delta, dQ, dK, dV.

template <typename T>
void run_determinism() {
  SCOPED_TRACE(test::seed_trace());
  ThreadCountGuard guard;
  const FlashCase c{"", {2, 200, 300, 4, 2, 64}, {true, 100, 0}};
  std::vector<std::vector<unsigned char>> first;
  for (int threads : {1, 3, 2}) {
    cpu::set_num_threads(threads);
    ASSERT_EQ(cpu::num_threads(), threads);
    std::mt19937_64 rng = test::make_rng(23);  // the same inputs every time
    FlashProblem<T> p(c, rng);
    p.forward();
    p.prepare();
    GradBuffers<T> grads(p.s, Layout::contiguous, rng);
    cpu::flash_backward(p.backward_args(grads.buffers));
    std::vector<std::vector<unsigned char>> bytes;
    for (const TensorView* t : {&p.o.view, &p.lse.view, &p.delta.view, &grads.buffers.q,
                                &grads.buffers.k, &grads.buffers.v}) {
      bytes.push_back(test::view_bytes(*t));
    }
    if (first.empty()) {
      first = bytes;
      continue;
    }
    const char* names[] = {"O", "LSE", "delta", "dQ", "dK", "dV"};
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      EXPECT_TRUE(bytes[i] == first[i]) << names[i] << " with " << threads
                                        << " threads differs from 1 thread";
    }
  }
}

TEST(FlashBackwardDeterminism, BitwiseAcrossThreadCountsF64) { run_determinism<double>(); }
TEST(FlashBackwardDeterminism, BitwiseAcrossThreadCountsF32) { run_determinism<float>(); }

// ---------------------------------------------------------------------------------------------
// Argument checks.

class FlashBackwardValidation : public testing::Test {
 protected:
  FlashBackwardValidation()
      : rng(test::make_rng(24)), p(FlashCase{"", {2, 5, 6, 4, 2, 8}, {}}, rng),
        grads(p.s, Layout::contiguous, rng) {
    p.forward();
    p.prepare();
  }
  BackwardArgs good() const { return p.backward_args(grads.buffers); }

  std::mt19937_64 rng;
  FlashProblem<double> p;
  GradBuffers<double> grads;
};

TEST_F(FlashBackwardValidation, ValidCallSucceeds) { EXPECT_NO_THROW(cpu::flash_backward(good())); }

TEST_F(FlashBackwardValidation, GradientsInAccumulatorDtype) {
  HostTensor<float> dq32({2, 5, 4, 8}, 0.0f);
  BackwardArgs args = good();
  args.dq = dq32.view;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); },
                                 {"cpu::flash_backward", "dq has dtype f32", "expected f64"}));
  for (float value : dq32.storage) ASSERT_EQ(value, 0.0f);
  const std::vector<unsigned char> dk_before = test::view_bytes(grads.buffers.k);
  args = good();
  args.dv = TensorView::contiguous(dq32.storage.data(), DType::f32, {2, 6, 2, 8});
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); }, {"dv has dtype f32"}));
  EXPECT_TRUE(test::view_bytes(grads.buffers.k) == dk_before) << "dk written before the check failed";
}

TEST_F(FlashBackwardValidation, ShapesAndPointers) {
  BackwardArgs args = good();
  args.delta = TensorView::contiguous(p.delta.storage.data(), DType::f64, {2, 5, 4});
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); },
                                 {"delta has shape [2, 5, 4]", "expected [2, 4, 5]"}));
  args = good();
  args.lse.shape[2] = 4;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); }, {"lse has shape [2, 4, 4]"}));
  args = good();
  args.dk.shape[1] = 5;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); }, {"dk has shape [2, 5, 2, 8]"}));
  args = good();
  args.dout.data = nullptr;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); }, {"dout is a null pointer"}));
  args = good();
  args.dq.memory = Memory::device;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); }, {"dq is in device memory"}));
  args = good();
  args.scale = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); }, {"scale is", "nan"}));
}

TEST_F(FlashBackwardValidation, KeyRotationTables) {
  std::vector<double> table(6 * 4, 0.5);
  std::vector<float> table32(6 * 4, 0.5f);
  const TensorView good_table = TensorView::contiguous(table.data(), DType::f64, {6, 4});
  BackwardArgs args = good();
  args.key_rotation = {good_table, TensorView::contiguous(table.data(), DType::f64, {5, 4})};
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); },
                                 {"key_rotation.sin has shape [5, 4]", "expected [6, 4]"}));
  args.key_rotation = {TensorView::contiguous(table32.data(), DType::f32, {6, 4}), good_table};
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); },
                                 {"key_rotation.cos has dtype f32", "expected f64"}));
  args.key_rotation = {good_table, TensorView::contiguous(table.data(), DType::f64, {6, 4})
                                       .with_strides({1, 6})};
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); },
                                 {"key_rotation.sin has stride 6 along its last axis"}));
  args.key_rotation = {good_table, TensorView{}};
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); },
                                 {"key_rotation.sin has rank 0", "expected rank 2"}));

  // An odd head_dim has no pairs (i, i + D / 2) to rotate.
  std::mt19937_64 odd_rng = test::make_rng(26);
  FlashProblem<double> odd(FlashCase{"", {1, 5, 6, 2, 1, 7}, {}}, odd_rng);
  odd.forward();
  odd.prepare();
  GradBuffers<double> odd_grads(odd.s, Layout::contiguous, odd_rng);
  BackwardArgs odd_args = odd.backward_args(odd_grads.buffers);
  odd_args.key_rotation = {TensorView::contiguous(table.data(), DType::f64, {6, 3}),
                           TensorView::contiguous(table.data(), DType::f64, {6, 3})};
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(odd_args); },
                                 {"key_rotation needs an even head_dim", "head_dim 7"}));
}

TEST_F(FlashBackwardValidation, Prepare) {
  HostTensor<float> delta32({2, 4, 5});
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward_prepare(p.o.view, p.dout.view, delta32.view); },
                                 {"cpu::flash_backward_prepare", "delta has dtype f32", "expected f64"}));
  EXPECT_EQ(test::count_nan(delta32.storage), delta32.storage.size());
  const TensorView delta_t = TensorView::contiguous(p.delta.storage.data(), DType::f64, {2, 5, 4});
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward_prepare(p.o.view, p.dout.view, delta_t); },
                                 {"delta has shape [2, 5, 4]"}));
  TensorView dout = p.dout.view;
  dout.shape[1] = 4;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward_prepare(p.o.view, dout, p.delta.view); },
                                 {"dout has shape [2, 4, 4, 8]"}));
}

// dq_to_zero: a strided dQ (heads 1-4 of 6 in each token's row) comes out zero, the rest of the
// row keeps its value, delta is bitwise the plain prepare's; a dQ of another shape is named.
TEST_F(FlashBackwardValidation, PrepareZeroesDqAndNothingElse) {
  const std::int64_t B = 2, S = 5, H = 4, D = 8, row = 6 * D;
  HostTensor<double> wide({B, S, 6, D}, 7.0);
  const TensorView dq = TensorView::contiguous(wide.storage.data() + D, DType::f64, {B, S, H, D})
                            .with_strides({S * row, row, D, 1});
  const std::vector<double> plain = p.delta.values();
  p.delta.poison();
  cpu::flash_backward_prepare(p.o.view, p.dout.view, p.delta.view, &dq);
  EXPECT_EQ(p.delta.values(), plain);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < wide.storage.size(); ++i) {
    const std::int64_t column = static_cast<std::int64_t>(i) % row;
    wrong += wide.storage[i] != (column >= D && column < 5 * D ? 0.0 : 7.0);
  }
  EXPECT_EQ(wrong, 0u);
  TensorView short_dq = dq;
  short_dq.shape[1] = 4;
  EXPECT_TRUE(test::ThrowsNaming(
      [&] { cpu::flash_backward_prepare(p.o.view, p.dout.view, p.delta.view, &short_dq); },
      {"cpu::flash_backward_prepare", "dq has shape [2, 4, 4, 8]"}));
}

TEST(FlashBackwardValidationBf16, Bf16IsNotACpuDtype) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(25);
  std::normal_distribution<float> normal;
  std::vector<std::uint16_t> q(5 * 2 * 8), k(6 * 8), v(6 * 8), g(5 * 2 * 8), o(5 * 2 * 8);
  for (auto* t : {&q, &k, &v, &g, &o}) {
    for (auto& x : *t) x = float_to_bf16(normal(rng));
  }
  HostTensor<float> lse({1, 2, 5}, 0.5f), delta({1, 2, 5}, 0.25f);
  HostTensor<float> dq({1, 5, 2, 8}, 0.0f), dk({1, 6, 1, 8}, 0.0f), dv({1, 6, 1, 8}, 0.0f);
  BackwardArgs args;
  args.q = TensorView::contiguous(q.data(), DType::bf16, {1, 5, 2, 8});
  args.k = TensorView::contiguous(k.data(), DType::bf16, {1, 6, 1, 8});
  args.v = TensorView::contiguous(v.data(), DType::bf16, {1, 6, 1, 8});
  args.dout = TensorView::contiguous(g.data(), DType::bf16, {1, 5, 2, 8});
  args.lse = lse.view;
  args.delta = delta.view;
  args.dq = dq.view;
  args.dk = dk.view;
  args.dv = dv.view;
  args.scale = 0.25;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward(args); },
                                 {"cpu::flash_backward", "q has dtype bf16", "f32 or f64"}));
  const TensorView o_view = TensorView::contiguous(o.data(), DType::bf16, {1, 5, 2, 8});
  const TensorView delta16 = TensorView::contiguous(o.data(), DType::bf16, {1, 2, 5});
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_backward_prepare(o_view, args.dout, delta16); },
                                 {"cpu::flash_backward_prepare", "o has dtype bf16"}));
}

}  // namespace
}  // namespace ringattn
