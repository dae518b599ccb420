// The CPU flash forward (ringattn::cpu::flash_forward) against the fp64 oracle: shapes that break
// the 64 x 64 tiling, GQA, head dims, strided layouts, causal masks with global offsets (fully
// masked tiles and rows), large logits; combine mode over K/V chunks; argument checks.
//
// Criteria (tests/TESTING.md): f64 inputs ||out - ref|| / ||ref|| < 1e-12, f32 inputs < 1e-5
// against the oracle on the same (float) inputs, for O and LSE; LSE = -inf rows exactly. With
// logits near 1e4 the problem itself is ill-conditioned in f32 (a score's rounding error is
// ~1e-3), so there the bound is the FlashAttention one: twice the error of naive attention in the
// input precision on the same inputs (both errors are reported).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::HostTensor;
using test::Layout;
using test::read_view;

template <typename T>
constexpr double kTolerance = std::is_same_v<T, double> ? 1e-12 : 1e-5;

enum class Logits {
  normal,        // q, k, v ~ N(0, 1)
  large_peaked,  // scores ~ N(0, 1e4^2): softmax is nearly one-hot; exp of raw scores overflows
  large_offset,  // scores = 1e4 + O(1): every row's scores near 1e4 with a spread of a few units
};

struct Case {
  const char* name;
  AttentionShape s;
  Mask mask;
  Layout layout = Layout::contiguous;
  Logits logits = Logits::normal;
};

void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

// The input dtype of a parameterised test (f64 and f32: the dtypes of the CPU block).
enum class Precision { f64, f32 };
void PrintTo(Precision p, std::ostream* out) { *out << (p == Precision::f64 ? "f64" : "f32"); }
std::string precision_name(Precision p) { return p == Precision::f64 ? "f64" : "f32"; }

// Random inputs of a case as logical [B, S, H, D] values, already rounded to T.
template <typename T>
struct Inputs {
  std::vector<double> q, k, v;
};

template <typename T>
Inputs<T> make_inputs(const Case& c, std::mt19937_64& rng) {
  const AttentionShape& s = c.s;
  Inputs<T> in;
  in.q = test::normal_vector<double>(s.batch * s.q_len * s.q_heads * s.head_dim, rng);
  in.k = test::normal_vector<double>(s.batch * s.k_len * s.kv_heads * s.head_dim, rng);
  in.v = test::normal_vector<double>(s.batch * s.k_len * s.kv_heads * s.head_dim, rng);
  const double scale = default_scale(s.head_dim);
  if (c.logits == Logits::large_peaked) {
    // scale * q.k has standard deviation a^2 when q, k ~ N(0, a^2).
    for (double& x : in.q) x *= 100.0;
    for (double& x : in.k) x *= 100.0;
  } else if (c.logits == Logits::large_offset) {
    // Dimension 0 of every q and k is about A with A^2 * scale = 1e4 (relative jitter 1e-4), the
    // others N(0, 1): scores = 1e4 + N(0, ~1.4).
    const double a = std::sqrt(1e4 / scale);
    std::normal_distribution<double> jitter(0.0, 1e-4);
    for (std::size_t i = 0; i < in.q.size(); i += s.head_dim) in.q[i] = a * (1.0 + jitter(rng));
    for (std::size_t i = 0; i < in.k.size(); i += s.head_dim) in.k[i] = a * (1.0 + jitter(rng));
  }
  for (auto* values : {&in.q, &in.k, &in.v}) {
    for (double& x : *values) x = static_cast<double>(static_cast<T>(x));
  }
  return in;
}

// The fp64 oracle's O [B, Sq, Hq, D] and LSE [B, Hq, Sq] for the views q, k, v (any dtype).
struct Expected {
  std::vector<double> o, lse;
};

Expected oracle(const TensorView& q, const TensorView& k, const TensorView& v, const Mask& mask,
                double scale) {
  HostTensor<double> o({q.shape[0], q.shape[1], q.shape[2], q.shape[3]});
  HostTensor<double> lse({q.shape[0], q.shape[2], q.shape[1]});
  reference::attention_forward(q, k, v, mask, scale, o.view, lse.view);
  return {o.values(), lse.values()};
}

class FlashForward : public testing::TestWithParam<std::tuple<Case, Precision>> {};

template <typename T>
void run_case(const Case& c) {
  SCOPED_TRACE(test::seed_trace());
  const AttentionShape& s = c.s;
  std::mt19937_64 rng = test::make_rng(10);
  const Inputs<T> in = make_inputs<T>(c, rng);
  test::QkvBuffers<T> qkv(s, c.layout, std::numeric_limits<T>::quiet_NaN());
  test::write_view(qkv.q, in.q);
  test::write_view(qkv.k, in.k);
  test::write_view(qkv.v, in.v);
  const double scale = default_scale(s.head_dim);

  // O goes to a padded view for strided layouts (a write past a row shows in the padding).
  const T sentinel = static_cast<T>(-1234.5);
  test::PaddedTensor<T> o_padded(s.batch, s.q_len, s.q_heads, s.head_dim, sentinel);
  HostTensor<T> o_plain({s.batch, s.q_len, s.q_heads, s.head_dim});
  const TensorView o = c.layout == Layout::contiguous ? o_plain.view : o_padded.view;
  HostTensor<T> lse({s.batch, s.q_heads, s.q_len});

  ForwardArgs args;
  args.q = qkv.q;
  args.k = qkv.k;
  args.v = qkv.v;
  args.o = o;
  args.lse = lse.view;
  args.scale = scale;
  args.mask = c.mask;
  cpu::flash_forward(args);

  const Expected ref = oracle(qkv.q, qkv.k, qkv.v, c.mask, scale);
  EXPECT_EQ(o_padded.padding_changed(), 0) << "writes outside the O view";
  double tolerance_o = kTolerance<T>, tolerance_lse = kTolerance<T>;
  if (c.logits != Logits::normal) {
    std::vector<double> low_o, low_lse;
    test::naive_forward<T>(s, in.q, in.k, in.v, c.mask, scale, low_o, low_lse);
    const test::Diff low_o_diff = test::compare(low_o, ref.o), low_lse_diff = test::compare(low_lse, ref.lse);
    tolerance_o = std::max(tolerance_o, 2.0 * low_o_diff.rel);
    tolerance_lse = std::max(tolerance_lse, 2.0 * low_lse_diff.rel);
    std::printf("  [large logits %s] naive in input precision: O %s\n", c.name,
                test::describe(low_o_diff).c_str());
  }
  EXPECT_TRUE(test::Close("O", read_view(o), ref.o, tolerance_o));
  EXPECT_TRUE(test::Close("LSE", lse.values(), ref.lse, tolerance_lse));
}

TEST_P(FlashForward, MatchesReference) {
  const auto& [c, dtype] = GetParam();
  if (dtype == Precision::f64) {
    run_case<double>(c);
  } else {
    run_case<float>(c);
  }
}

const Case kCases[] = {
    {"S1", {2, 1, 1, 4, 4, 64}, {}},
    {"S1Causal", {2, 1, 1, 4, 1, 64}, {true, 0, 0}},
    {"S17CausalGqa4", {2, 17, 17, 4, 1, 64}, {true, 0, 0}},
    {"S127CausalGqa8D128", {1, 127, 127, 8, 1, 128}, {true, 0, 0}},
    {"S1000D64", {1, 1000, 1000, 2, 2, 64}, {}},
    {"S1000CausalGqa4D128", {1, 1000, 1000, 4, 1, 128}, {true, 0, 0}},
    {"S4097CausalD32", {1, 4097, 4097, 1, 1, 32}, {true, 0, 0}},
    {"Sq17Sk127Gqa4D32Batch3", {3, 17, 127, 8, 2, 32}, {}},
    {"Sq127Sk17FullyVisibleChunk", {2, 127, 17, 4, 2, 64}, {true, 100, 50}},
    // Rows 0..35 see nothing; the K/V chunk starts in the middle of the first row tile.
    {"CausalChunkRowsWithoutKeys", {1, 127, 65, 4, 2, 64}, {true, 64, 100}},
    // Row tile 0 fully masked, row tile 1 partially, all rows without key for the first 70.
    {"CausalChunkMaskedTile", {2, 200, 50, 2, 1, 32}, {true, 0, 70}},
    // The whole block masked: O = 0, LSE = -inf everywhere.
    {"CausalBlockFullyMasked", {1, 127, 17, 2, 2, 64}, {true, 0, 200}},
    {"Sq65Sk129D128Batch2", {2, 65, 129, 2, 1, 128}, {}},
    {"HeadDim7", {2, 33, 70, 3, 3, 7}, {true, 37, 0}},
    {"HeadDim1", {1, 20, 20, 2, 1, 1}, {}},
    {"PackedQkvCausalGqa", {2, 127, 127, 4, 2, 64}, {true, 0, 0}, Layout::packed},
    {"PackedQkvMha", {1, 130, 130, 3, 3, 32}, {}, Layout::packed},
    {"HeadMajorSqNeSk", {2, 100, 130, 4, 4, 32}, {true, 80, 0}, Layout::head_major},
    {"LargePeakedLogits", {1, 200, 200, 2, 1, 64}, {}, Layout::contiguous, Logits::large_peaked},
    {"LargeOffsetLogitsCausal", {1, 300, 300, 2, 2, 64}, {true, 0, 0}, Layout::contiguous,
     Logits::large_offset},
};

INSTANTIATE_TEST_SUITE_P(
    Shapes, FlashForward, testing::Combine(testing::ValuesIn(kCases), testing::Values(Precision::f64, Precision::f32)),
    [](const testing::TestParamInfo<std::tuple<Case, Precision>>& info) {
      return std::string(std::get<0>(info.param).name) + "_" +
             precision_name(std::get<1>(info.param));
    });

// ---------------------------------------------------------------------------------------------
// Combine mode: a running (O, LSE) merged over K/V chunks equals attention over all of them.

struct CombineCase {
  const char* name;
  AttentionShape s;     // k_len: all chunks together
  Mask mask;            // k_start: global start of the first chunk
  std::vector<std::int64_t> bounds;  // chunk c is keys [bounds[c], bounds[c + 1])
  std::vector<int> order;            // the order the chunks are merged in
};

void PrintTo(const CombineCase& c, std::ostream* out) { *out << c.name; }

class FlashForwardCombine : public testing::TestWithParam<std::tuple<CombineCase, Precision>> {};

template <typename T>
void run_combine(const CombineCase& c) {
  SCOPED_TRACE(test::seed_trace());
  const AttentionShape& s = c.s;
  std::mt19937_64 rng = test::make_rng(11);
  test::QkvBuffers<T> qkv(s, Layout::contiguous, T(0));
  test::fill_normal(qkv.q_storage, rng);
  test::fill_normal(qkv.k_storage, rng);
  test::fill_normal(qkv.v_storage, rng);
  const double scale = default_scale(s.head_dim);

  HostTensor<T> o({s.batch, s.q_len, s.q_heads, s.head_dim}, T(0));
  HostTensor<T> lse({s.batch, s.q_heads, s.q_len}, -std::numeric_limits<T>::infinity());
  for (int chunk : c.order) {
    const std::int64_t first = c.bounds[chunk], len = c.bounds[chunk + 1] - first;
    ForwardArgs args;
    args.q = qkv.q;
    args.k = qkv.k;
    args.v = qkv.v;
    args.k.data = qkv.k_storage.data() + first * qkv.k.strides[1];
    args.v.data = qkv.v_storage.data() + first * qkv.v.strides[1];
    args.k.shape[1] = args.v.shape[1] = len;
    args.o = o.view;
    args.lse = lse.view;
    args.scale = scale;
    args.mask = c.mask;
    args.mask.k_start = c.mask.k_start + first;
    args.combine = true;

    const std::vector<T> o_before = o.storage, lse_before = lse.storage;
    cpu::flash_forward(args);
    // Rows that see no key of this chunk keep their running pair bit for bit.
    std::int64_t unchanged_rows = 0, changed = 0;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      for (std::int64_t h = 0; h < s.q_heads; ++h) {
        for (std::int64_t i = 0; i < s.q_len; ++i) {
          if (!c.mask.causal || c.mask.q_start + i >= args.mask.k_start) continue;
          ++unchanged_rows;
          const std::int64_t lo = lse.view.offset(b, h, i), oo = o.view.offset(b, i, h, 0);
          changed += std::memcmp(&lse.storage[lo], &lse_before[lo], sizeof(T)) != 0;
          changed += std::memcmp(&o.storage[oo], &o_before[oo], sizeof(T) * s.head_dim) != 0;
        }
      }
    }
    EXPECT_EQ(changed, 0) << "chunk " << chunk << " changed the running pair of rows that see none "
                          << "of its keys (" << unchanged_rows << " such rows)";
    if (unchanged_rows == s.batch * s.q_heads * s.q_len) {
      EXPECT_EQ(0, std::memcmp(o.storage.data(), o_before.data(), o.storage.size() * sizeof(T)));
      EXPECT_EQ(0, std::memcmp(lse.storage.data(), lse_before.data(), lse.storage.size() * sizeof(T)));
    }
  }
  ASSERT_EQ(c.bounds.back(), s.k_len);
  const Expected ref = oracle(qkv.q, qkv.k, qkv.v, c.mask, scale);
  EXPECT_TRUE(test::Close("O", o.values(), ref.o, kTolerance<T>));
  EXPECT_TRUE(test::Close("LSE", lse.values(), ref.lse, kTolerance<T>));
}

TEST_P(FlashForwardCombine, ChunksEqualOneShot) {
  const auto& [c, dtype] = GetParam();
  if (dtype == Precision::f64) {
    run_combine<double>(c);
  } else {
    run_combine<float>(c);
  }
}

const CombineCase kCombineCases[] = {
    {"NonCausalTwoChunks", {2, 60, 173, 4, 2, 64}, {}, {0, 45, 173}, {0, 1}},
    {"NonCausalThreeChunksReversed", {1, 70, 200, 2, 1, 32}, {}, {0, 1, 130, 200}, {2, 1, 0}},
    // Rows at 100..219. Chunk 1 (keys 130..219) is masked for rows 0..29, chunk 2 (keys 220..299)
    // for every row.
    {"CausalMaskedChunks", {2, 120, 300, 4, 2, 64}, {true, 100, 0}, {0, 130, 220, 300}, {1, 2, 0}},
    // Keys start at 50: rows 0..49 see nothing at all and end at O = 0, LSE = -inf; chunk 2
    // (keys 140..199) is masked for every row (rows at 0..99).
    {"CausalRowsWithoutKeys", {1, 100, 150, 2, 2, 32}, {true, 0, 50}, {0, 20, 90, 150}, {2, 0, 1}},
};

INSTANTIATE_TEST_SUITE_P(
    Chunks, FlashForwardCombine,
    testing::Combine(testing::ValuesIn(kCombineCases), testing::Values(Precision::f64, Precision::f32)),
    [](const testing::TestParamInfo<std::tuple<CombineCase, Precision>>& info) {
      return std::string(std::get<0>(info.param).name) + "_" +
             precision_name(std::get<1>(info.param));
    });

// ---------------------------------------------------------------------------------------------
// Argument checks.

TEST(FlashForwardValidation, CombineNeedsAccumulatorDtypeForO) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(12);
  const AttentionShape s{1, 5, 6, 2, 1, 8};
  test::QkvBuffers<float> qkv(s, Layout::contiguous, 0.0f);
  test::fill_normal(qkv.q_storage, rng);
  test::fill_normal(qkv.k_storage, rng);
  test::fill_normal(qkv.v_storage, rng);
  HostTensor<double> o64({1, 5, 2, 8}, 0.0);
  HostTensor<float> lse({1, 2, 5}, -std::numeric_limits<float>::infinity());
  ForwardArgs args{qkv.q, qkv.k, qkv.v, o64.view, lse.view, 0.25, {}, true};
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); },
                                 {"cpu::flash_forward", "o has dtype f64", "expected f32"}));
  for (double value : o64.storage) ASSERT_EQ(value, 0.0) << "o written before the check failed";
  // Not combining, O takes the dtype of q: f64 is wrong as well.
  args.combine = false;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"o has dtype f64", "expected f32"}));
  // LSE is always in the accumulator dtype.
  HostTensor<float> o32({1, 5, 2, 8});
  HostTensor<double> lse64({1, 2, 5});
  args.o = o32.view;
  args.lse = lse64.view;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"lse has dtype f64", "expected f32"}));
  const TensorView lse_t = TensorView::contiguous(lse.storage.data(), DType::f32, {1, 5, 2});
  args.lse = lse_t;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"lse has shape [1, 5, 2]"}));
}

TEST(FlashForwardValidation, Bf16IsNotACpuDtype) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(13);
  const AttentionShape s{1, 5, 6, 2, 1, 8};
  std::vector<std::uint16_t> q(5 * 2 * 8), k(6 * 8), v(6 * 8), o(5 * 2 * 8, 0x7fc0);
  std::normal_distribution<float> normal;
  for (auto* t : {&q, &k, &v}) {
    for (auto& x : *t) x = float_to_bf16(normal(rng));
  }
  HostTensor<float> lse({1, 2, 5});
  ForwardArgs args;
  args.q = TensorView::contiguous(q.data(), DType::bf16, {1, 5, 2, 8});
  args.k = TensorView::contiguous(k.data(), DType::bf16, {1, 6, 1, 8});
  args.v = TensorView::contiguous(v.data(), DType::bf16, {1, 6, 1, 8});
  args.o = TensorView::contiguous(o.data(), DType::bf16, {1, 5, 2, 8});
  args.lse = lse.view;
  args.scale = default_scale(s.head_dim);
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); },
                                 {"cpu::flash_forward", "q has dtype bf16", "f32 or f64"}));
  EXPECT_EQ(test::count_nan(lse.storage), lse.storage.size()) << "lse written before the check failed";
}

TEST(FlashForwardValidation, SharedChecksNameTheArgument) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(14);
  const AttentionShape s{2, 5, 6, 4, 2, 8};
  test::QkvBuffers<double> qkv(s, Layout::contiguous, 0.0);
  test::fill_normal(qkv.q_storage, rng);
  test::fill_normal(qkv.k_storage, rng);
  test::fill_normal(qkv.v_storage, rng);
  HostTensor<double> o({2, 5, 4, 8}), lse({2, 4, 5});
  const ForwardArgs good{qkv.q, qkv.k, qkv.v, o.view, lse.view, 0.25, {}, false};
  EXPECT_NO_THROW(cpu::flash_forward(good));

  ForwardArgs args = good;
  args.k.memory = Memory::device;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"k is in device memory"}));
  args = good;
  args.v.shape[1] = 5;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"v has shape [2, 5, 2, 8]"}));
  args = good;
  args.q.shape[2] = 3;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"q has 3 heads"}));
  args = good;
  args.scale = -1.0;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"scale is -1"}));
  args = good;
  args.lse.data = nullptr;
  EXPECT_TRUE(test::ThrowsNaming([&] { cpu::flash_forward(args); }, {"lse is a null pointer"}));
}

}  // namespace
}  // namespace ringattn
