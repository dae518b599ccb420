// The window and documents of the C API (the fields appended to the parameter structs in 0.4) on
// host tensors: forward and backward in f32 and f64 against the fp64 oracle given the same Mask,
// rows that see no key (found here from the mask's definition, not from the library), the older
// struct sizes (the default mask whatever lies past them), the sizes refused, and bad masks.
//
// Criteria (TESTING.md): relative error under 1e-12 (f64) and 1e-5 (f32) for O, LSE, dQ, dK and
// dV; O, LSE, dQ of a row that sees nothing and dK, dV of a key that nobody sees exactly 0, -inf,
// 0. The CPU block's tiles are 64 x 64: the document starts and window widths sit on, just
// before and just after the tile edges 64, 128 and 192 of sequences of 200 tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/ringattn.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/random.hpp"

namespace {

using ringattn::DType;
using ringattn::TensorView;

// A row-major host descriptor of `shape` over `data` (f32 or f64).
template <typename T>
ringattn_tensor_t describe(std::vector<T>& data, std::initializer_list<std::int64_t> shape) {
  ringattn_tensor_t t = ringattn::test::describe_at(data.data(), shape);
  t.dtype = sizeof(T) == sizeof(double) ? RINGATTN_F64 : RINGATTN_F32;
  return t;
}

std::vector<double> to_double(const std::vector<float>& x) { return {x.begin(), x.end()}; }
std::vector<double> to_double(const std::vector<double>& x) { return x; }

// One mask, as the C structs take it. starts: one list of `count` (batch_stride 0) or the lists
// of every batch row, batch_stride apart.
struct MaskCase {
  const char* name;
  std::int64_t q_len, k_len;
  bool causal;
  std::int64_t q_start, k_start;
  std::int64_t window_left, window_right;
  std::vector<std::int64_t> starts;
  std::int64_t count, batch_stride;

  ringattn::Mask mask() const {
    ringattn::Mask m{causal, q_start, k_start, window_left, window_right};
    m.documents = {count > 0 ? starts.data() : nullptr, count, batch_stride};
    return m;
  }

  // The definition of the mask (ringattn/attention.hpp), written apart from the library: does the
  // query row i of batch row b see key row j?
  bool visible(std::int64_t b, std::int64_t i, std::int64_t j) const {
    const std::int64_t qp = q_start + i, kp = k_start + j;
    if (causal && kp > qp) return false;
    if (window_left > 0 && qp - kp >= window_left) return false;
    if (window_right > 0 && kp - qp >= window_right) return false;
    auto document = [&](std::int64_t p) {
      std::int64_t n = 0;
      for (std::int64_t d = 0; d < count; ++d) n += starts[b * batch_stride + d] <= p ? 1 : 0;
      return n;
    };
    return count == 0 || document(qp) == document(kp);
  }
};

constexpr std::int64_t kBatch = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 16;

std::vector<MaskCase> mask_cases() {
  return {
      {"causal window 70", 200, 200, true, 0, 0, 70, 0, {}, 0, 0},
      {"window 64 left, 65 right", 200, 200, false, 0, 0, 64, 65, {}, 0, 0},
      {"causal window 1 (the diagonal)", 200, 200, true, 0, 0, 1, 0, {}, 0, 0},
      {"window 30 right only", 200, 200, false, 0, 0, 0, 30, {}, 0, 0},
      {"documents at the tile edges", 200, 200, false, 0, 0, 0, 0, {0, 64, 128, 192}, 4, 0},
      {"causal documents at the tile edges", 200, 200, true, 0, 0, 0, 0, {0, 64, 128, 192}, 4, 0},
      {"documents beside the tile edges", 200, 200, true, 0, 0, 0, 0, {63, 65, 127, 129}, 4, 0},
      // Lists 5 apart (one unused element between them); row 1 has an empty document (a start
      // repeated) and a start past the sequence.
      {"documents per batch row", 200, 200, false, 0, 0, 0, 0,
       {0, 64, 100, 192, -7, 0, 128, 128, 250}, 4, 5},
      {"causal documents per batch row", 200, 200, true, 0, 0, 0, 0,
       {1, 65, 127, 193, -7, 0, 128, 128, 250}, 4, 5},
      {"documents and a window", 200, 200, false, 0, 0, 40, 10, {0, 64, 150}, 3, 0},
      {"causal documents and a window", 200, 200, true, 0, 0, 65, 0, {0, 64, 150}, 3, 0},
      // Query rows at 230..299 against keys at 0..199: the rows before 235 see the window's last
      // keys of their document, the later ones (a document of their own) nothing.
      {"offsets, rows that see nothing", 70, 200, true, 230, 0, 40, 0, {100, 235}, 2, 0},
      {"offsets, documents and a right window", 100, 150, false, 64, 32, 0, 5, {0, 96, 160}, 3, 0},
  };
}

// Forward, prepare and backward of `c` through the C API on random inputs of dtype T, against the
// oracle given the same Mask, and the rows and keys the definition says nothing reaches.
template <typename T>
void check_against_the_oracle(const MaskCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message() << c.name << (sizeof(T) == 8 ? " f64" : " f32"));
  const std::int64_t B = kBatch, Sq = c.q_len, Sk = c.k_len, Hq = kQHeads, Hkv = kKvHeads,
                     D = kHeadDim;
  auto q = ringattn::test::normal_vector<T>(B * Sq * Hq * D, rng);
  auto k = ringattn::test::normal_vector<T>(B * Sk * Hkv * D, rng);
  auto v = ringattn::test::normal_vector<T>(B * Sk * Hkv * D, rng);
  auto dout = ringattn::test::normal_vector<T>(B * Sq * Hq * D, rng);
  auto o = ringattn::test::nan_vector<T>(dout.size());
  auto lse = ringattn::test::nan_vector<T>(B * Hq * Sq);
  auto delta = ringattn::test::nan_vector<T>(lse.size());
  std::vector<T> dq(q.size(), T(0)), dk(k.size(), T(0)), dv(v.size(), T(0));
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  ringattn_forward_params_t p{};
  p.struct_size = sizeof(p);
  p.q = describe(q, {B, Sq, Hq, D});
  p.k = describe(k, {B, Sk, Hkv, D});
  p.v = describe(v, {B, Sk, Hkv, D});
  p.o = describe(o, {B, Sq, Hq, D});
  p.lse = describe(lse, {B, Hq, Sq});
  p.scale = scale;
  p.causal = c.causal ? 1 : 0;
  p.q_start = c.q_start;
  p.k_start = c.k_start;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.document_starts = c.count > 0 ? c.starts.data() : nullptr;
  p.num_documents = c.count;
  p.document_batch_stride = c.batch_stride;
  ASSERT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  ringattn_tensor_t dout_t = describe(dout, {B, Sq, Hq, D}), delta_t = describe(delta, {B, Hq, Sq});
  ASSERT_EQ(ringattn_attention_backward_prepare(&p.o, &dout_t, &delta_t, nullptr), RINGATTN_SUCCESS)
      << ringattn_last_error();
  const ringattn_backward_params_t bp =
      ringattn::test::backward_params_of(p, dout_t, delta_t, describe(dq, {B, Sq, Hq, D}),
                                         describe(dk, {B, Sk, Hkv, D}), describe(dv, {B, Sk, Hkv, D}));
  ASSERT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();

  // The oracle on the same values in f64.
  std::vector<double> qd = to_double(q), kd = to_double(k), vd = to_double(v), dod = to_double(dout);
  std::vector<double> o_ref(o.size()), lse_ref(lse.size()), dq_ref(dq.size()), dk_ref(dk.size()),
      dv_ref(dv.size());
  auto view = [](std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.data(), DType::f64, shape);
  };
  const ringattn::Mask mask = c.mask();
  ringattn::reference::attention_forward(view(qd, {B, Sq, Hq, D}), view(kd, {B, Sk, Hkv, D}),
                                         view(vd, {B, Sk, Hkv, D}), mask, scale,
                                         view(o_ref, {B, Sq, Hq, D}), view(lse_ref, {B, Hq, Sq}));
  ringattn::reference::attention_backward(
      view(qd, {B, Sq, Hq, D}), view(kd, {B, Sk, Hkv, D}), view(vd, {B, Sk, Hkv, D}),
      view(dod, {B, Sq, Hq, D}), mask, scale, view(dq_ref, {B, Sq, Hq, D}),
      view(dk_ref, {B, Sk, Hkv, D}), view(dv_ref, {B, Sk, Hkv, D}));
  const double tolerance = sizeof(T) == 8 ? 1e-12 : 1e-5;
  EXPECT_TRUE(ringattn::test::Close("O", to_double(o), o_ref, tolerance));
  EXPECT_TRUE(ringattn::test::Close("LSE", to_double(lse), lse_ref, tolerance));
  EXPECT_TRUE(ringattn::test::Close("dQ", to_double(dq), dq_ref, tolerance));
  EXPECT_TRUE(ringattn::test::Close("dK", to_double(dk), dk_ref, tolerance));
  EXPECT_TRUE(ringattn::test::Close("dV", to_double(dv), dv_ref, tolerance));

  // What nothing reaches, by the definition: exactly 0, -inf and 0, on every head.
  std::int64_t blind_rows = 0, unseen_keys = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < Sq; ++i) {
      bool any = false;
      for (std::int64_t j = 0; j < Sk && !any; ++j) any = c.visible(b, i, j);
      if (any) continue;
      ++blind_rows;
      for (std::int64_t h = 0; h < Hq; ++h) {
        ASSERT_TRUE(std::isinf(lse[(b * Hq + h) * Sq + i]) && lse[(b * Hq + h) * Sq + i] < 0)
            << "LSE of batch " << b << " head " << h << " row " << i;
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t at = ((b * Sq + i) * Hq + h) * D + d;
          ASSERT_EQ(o[at], T(0)) << "O of batch " << b << " row " << i;
          ASSERT_EQ(dq[at], T(0)) << "dQ of batch " << b << " row " << i;
        }
      }
    }
    for (std::int64_t j = 0; j < Sk; ++j) {
      bool any = false;
      for (std::int64_t i = 0; i < Sq && !any; ++i) any = c.visible(b, i, j);
      if (any) continue;
      ++unseen_keys;
      for (std::int64_t at = (b * Sk + j) * Hkv * D; at < (b * Sk + j + 1) * Hkv * D; ++at) {
        ASSERT_EQ(dk[at], T(0)) << "dK of batch " << b << " key " << j;
        ASSERT_EQ(dv[at], T(0)) << "dV of batch " << b << " key " << j;
      }
    }
  }
  if (std::string(c.name).rfind("offsets", 0) == 0) {
    EXPECT_GT(blind_rows + unseen_keys, 0) << "the case meant to have rows or keys nobody reaches";
  }
}

TEST(CApiMasks, WindowsAndDocumentsMatchTheOracle) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  std::mt19937_64 rng = ringattn::test::make_rng(52);
  for (const MaskCase& c : mask_cases()) {
    check_against_the_oracle<double>(c, rng);
    check_against_the_oracle<float>(c, rng);
  }
}

// The problem of the struct-size tests: f64, causal, B 2, 100 tokens.
struct SmallProblem {
  static constexpr std::int64_t B = 2, S = 100, Hq = 4, Hkv = 2, D = 8;
  std::vector<double> q, k, v, dout, delta;
  std::vector<std::int64_t> starts{0, 30, 64};

  explicit SmallProblem(std::mt19937_64& rng)
      : q(ringattn::test::normal_vector<double>(B * S * Hq * D, rng)),
        k(ringattn::test::normal_vector<double>(B * S * Hkv * D, rng)),
        v(ringattn::test::normal_vector<double>(B * S * Hkv * D, rng)),
        dout(ringattn::test::normal_vector<double>(B * S * Hq * D, rng)) {}

  struct Result {
    ringattn_status_t forward_status = RINGATTN_SUCCESS, backward_status = RINGATTN_SUCCESS;
    std::vector<double> o, lse, dq, dk, dv;
  };

  // Forward and backward with a window and documents in the structs' memory, the structs' sizes
  // set to forward_size and backward_size (0: sizeof).
  Result run(std::size_t forward_size, std::size_t backward_size, bool with_mask) {
    Result r;
    r.o = ringattn::test::nan_vector<double>(dout.size());
    r.lse = ringattn::test::nan_vector<double>(B * Hq * S);
    r.dq.assign(q.size(), 0.0);
    r.dk.assign(k.size(), 0.0);
    r.dv.assign(v.size(), 0.0);
    ringattn_forward_params_t p{};
    p.struct_size = forward_size == 0 ? sizeof(p) : forward_size;
    p.q = describe(q, {B, S, Hq, D});
    p.k = describe(k, {B, S, Hkv, D});
    p.v = describe(v, {B, S, Hkv, D});
    p.o = describe(r.o, {B, S, Hq, D});
    p.lse = describe(r.lse, {B, Hq, S});
    p.scale = 0.3;
    p.causal = 1;
    if (with_mask) {
      p.window_left = 20;
      p.document_starts = starts.data();
      p.num_documents = static_cast<std::int64_t>(starts.size());
    }
    r.forward_status = ringattn_attention_forward(&p, nullptr);
    if (r.forward_status != RINGATTN_SUCCESS) return r;
    // delta from the full-size forward's O, whichever size the backward is given.
    delta.assign(r.lse.size(), 0.0);
    ringattn_tensor_t dout_t = describe(dout, {B, S, Hq, D}), delta_t = describe(delta, {B, Hq, S});
    EXPECT_EQ(ringattn_attention_backward_prepare(&p.o, &dout_t, &delta_t, nullptr),
              RINGATTN_SUCCESS)
        << ringattn_last_error();
    ringattn_backward_params_t bp =
        ringattn::test::backward_params_of(p, dout_t, delta_t, describe(r.dq, {B, S, Hq, D}),
                                           describe(r.dk, {B, S, Hkv, D}),
                                           describe(r.dv, {B, S, Hkv, D}));
    if (backward_size != 0) bp.struct_size = backward_size;
    r.backward_status = ringattn_attention_backward(&bp, nullptr);
    return r;
  }
};

// A struct of 0.3 or earlier (forward: 0.1 to 0.3 share one size; backward: 0.1, 0.2, 0.3) ends
// before the window and documents: a window and documents in the memory past it are not read, and
// the results are bitwise those of a full struct with them zeroed. The full struct with them set
// gives other results (so the comparison can fail).
TEST(CApiMasks, OlderStructSizesGiveTheDefaultMask) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  std::mt19937_64 rng = ringattn::test::make_rng(53);
  SmallProblem problem(rng);
  const SmallProblem::Result plain = problem.run(0, 0, false);
  ASSERT_EQ(plain.forward_status, RINGATTN_SUCCESS) << ringattn_last_error();
  ASSERT_EQ(plain.backward_status, RINGATTN_SUCCESS) << ringattn_last_error();
  const SmallProblem::Result masked = problem.run(0, 0, true);
  ASSERT_EQ(masked.backward_status, RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_NE(masked.o, plain.o);
  EXPECT_NE(masked.dk, plain.dk);

  const std::size_t forward_03 = offsetof(ringattn_forward_params_t, window_left);
  const std::size_t backward_sizes[] = {offsetof(ringattn_backward_params_t, overwrite_key_gradients),
                                        offsetof(ringattn_backward_params_t, key_rotation_cos),
                                        offsetof(ringattn_backward_params_t, window_left)};
  for (std::size_t backward_size : backward_sizes) {
    SCOPED_TRACE(::testing::Message() << "backward struct_size " << backward_size);
    const SmallProblem::Result older = problem.run(forward_03, backward_size, true);
    ASSERT_EQ(older.forward_status, RINGATTN_SUCCESS) << ringattn_last_error();
    ASSERT_EQ(older.backward_status, RINGATTN_SUCCESS) << ringattn_last_error();
    EXPECT_EQ(older.o, plain.o);
    EXPECT_EQ(older.lse, plain.lse);
    EXPECT_EQ(older.dq, plain.dq);
    EXPECT_EQ(older.dk, plain.dk);
    EXPECT_EQ(older.dv, plain.dv);
  }
}

// A struct_size that ends inside a field, between the fields of one version, or past this
// library's struct is refused, naming it and every size taken.
TEST(CApiMasks, OtherStructSizesAreRefusedNamingTheSizesTaken) {
  std::mt19937_64 rng = ringattn::test::make_rng(54);
  SmallProblem problem(rng);
  using F = ringattn_forward_params_t;
  using Bw = ringattn_backward_params_t;
  const std::string forward_sizes =
      "; expected sizeof = " + std::to_string(sizeof(F)) +
      " (set it to sizeof(the struct)), or the size of an older version: " +
      std::to_string(offsetof(F, window_left)) + " (0.1 to 0.3)";
  for (std::size_t size : {offsetof(F, window_left) + 4, offsetof(F, window_right),
                           offsetof(F, document_starts) + 3, offsetof(F, document_batch_stride),
                           sizeof(F) + 8, std::size_t{8}}) {
    const SmallProblem::Result r = problem.run(size, 0, true);
    EXPECT_EQ(r.forward_status, RINGATTN_ERROR_INVALID_ARGUMENT) << "struct_size " << size;
    EXPECT_EQ(std::string(ringattn_last_error()),
              "ringattn_attention_forward: params->struct_size is " + std::to_string(size) +
                  forward_sizes);
  }
  const std::string backward_sizes =
      "; expected sizeof = " + std::to_string(sizeof(Bw)) +
      " (set it to sizeof(the struct)), or the size of an older version: " +
      std::to_string(offsetof(Bw, overwrite_key_gradients)) + " (0.1), " +
      std::to_string(offsetof(Bw, key_rotation_cos)) + " (0.2), " +
      std::to_string(offsetof(Bw, window_left)) + " (0.3)";
  for (std::size_t size : {offsetof(Bw, overwrite_key_gradients) - 8,
                           offsetof(Bw, key_rotation_cos) + 8, offsetof(Bw, num_documents) + 4,
                           sizeof(Bw) + 8}) {
    const SmallProblem::Result r = problem.run(0, size, true);
    ASSERT_EQ(r.forward_status, RINGATTN_SUCCESS) << ringattn_last_error();
    EXPECT_EQ(r.backward_status, RINGATTN_ERROR_INVALID_ARGUMENT) << "struct_size " << size;
    EXPECT_EQ(std::string(ringattn_last_error()),
              "ringattn_attention_backward: params->struct_size is " + std::to_string(size) +
                  backward_sizes);
  }
}

// A window below 0, a count below 0, no list for a positive count, a negative batch stride and
// starts that decrease (in either batch row's list) are refused by the forward and the backward
// alike, the message naming the field and its value.
TEST(CApiMasks, BadMasksAreRefusedNamingTheField) {
  std::mt19937_64 rng = ringattn::test::make_rng(55);
  SmallProblem problem(rng);
  const SmallProblem::Result good = problem.run(0, 0, true);
  ASSERT_EQ(good.backward_status, RINGATTN_SUCCESS) << ringattn_last_error();
  std::vector<std::int64_t> decreasing{0, 50, 40}, second_row_decreasing{0, 10, 20, 30, 5, 90};
  struct Case {
    const char* what;
    std::int64_t window_left, window_right;
    const std::int64_t* starts;
    std::int64_t count, batch_stride;
    std::vector<std::string> message;
  };
  const Case cases[] = {
      {"window_left -1", -1, 0, nullptr, 0, 0, {"window_left is -1; expected 0 (no window)"}},
      {"window_right -3", 0, -3, nullptr, 0, 0, {"window_right is -3; expected 0 (no window)"}},
      {"num_documents -1", 0, 0, problem.starts.data(), -1, 0,
       {"num_documents) is -1; expected 0 (one document) or more"}},
      {"null document_starts", 0, 0, nullptr, 2, 0,
       {"document_starts) is a null pointer with count 2; expected 2 int64 positions"}},
      {"document_batch_stride -3", 0, 0, problem.starts.data(), 3, -3,
       {"document_batch_stride) is -3; expected 0 (one list for every batch row)"}},
      {"decreasing starts", 0, 0, decreasing.data(), 3, 0,
       {"document start 2 of batch row 0 is 40, below start 1 (50)"}},
      {"decreasing starts in batch row 1", 0, 0, second_row_decreasing.data(), 3, 3,
       {"document start 1 of batch row 1 is 5, below start 0 (30)"}},
  };
  for (const Case& c : cases) {
    for (const bool backward : {false, true}) {
      SCOPED_TRACE(::testing::Message() << c.what << (backward ? " (backward)" : " (forward)"));
      std::vector<double> o = good.o, lse = good.lse, dq(good.dq.size(), 0.0),
                          dk(good.dk.size(), 0.0), dv(good.dv.size(), 0.0);
      ringattn_status_t status;
      const char* where = backward ? "ringattn_attention_backward: " : "ringattn_attention_forward: ";
      const std::int64_t B = SmallProblem::B, S = SmallProblem::S, Hq = SmallProblem::Hq,
                         Hkv = SmallProblem::Hkv, D = SmallProblem::D;
      if (!backward) {
        ringattn_forward_params_t p{};
        p.struct_size = sizeof(p);
        p.q = describe(problem.q, {B, S, Hq, D});
        p.k = describe(problem.k, {B, S, Hkv, D});
        p.v = describe(problem.v, {B, S, Hkv, D});
        p.o = describe(o, {B, S, Hq, D});
        p.lse = describe(lse, {B, Hq, S});
        p.scale = 0.3;
        p.window_left = c.window_left;
        p.window_right = c.window_right;
        p.document_starts = c.starts;
        p.num_documents = c.count;
        p.document_batch_stride = c.batch_stride;
        status = ringattn_attention_forward(&p, nullptr);
      } else {
        ringattn_backward_params_t bp{};
        bp.struct_size = sizeof(bp);
        bp.q = describe(problem.q, {B, S, Hq, D});
        bp.k = describe(problem.k, {B, S, Hkv, D});
        bp.v = describe(problem.v, {B, S, Hkv, D});
        bp.dout = describe(problem.dout, {B, S, Hq, D});
        bp.lse = describe(lse, {B, Hq, S});
        bp.delta = describe(problem.delta, {B, Hq, S});
        bp.dq = describe(dq, {B, S, Hq, D});
        bp.dk = describe(dk, {B, S, Hkv, D});
        bp.dv = describe(dv, {B, S, Hkv, D});
        bp.scale = 0.3;
        bp.window_left = c.window_left;
        bp.window_right = c.window_right;
        bp.document_starts = c.starts;
        bp.num_documents = c.count;
        bp.document_batch_stride = c.batch_stride;
        status = ringattn_attention_backward(&bp, nullptr);
      }
      EXPECT_EQ(status, RINGATTN_ERROR_INVALID_ARGUMENT);
      const std::string message = ringattn_last_error();
      EXPECT_EQ(message.rfind(where, 0), 0u) << message;
      for (const std::string& part : c.message) {
        EXPECT_NE(message.find(part), std::string::npos) << message;
      }
    }
  }
}

}  // namespace
