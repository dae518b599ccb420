// The CPU flash block under sliding windows and packed documents (Mask::window_left,
// window_right, documents): forward, combine mode and backward against the fp64 oracle, and the
// oracle itself against the independent long-double naive attention. The masks are placed by
// construction where the block's 64 x 64 tiles could go wrong: document boundaries at, just before
// and just after tile edges, windows of 1, 63, 64, 65 and more than a sequence, empty documents,
// one list per batch row, chunks of a longer sequence (q_start, k_start) whose rows see nothing,
// and scores near 1e4.
//
// Criteria (TESTING.md): f64 ||out - ref|| / ||ref|| < 1e-12, f32 < 1e-5; rows that see no key
// have O = 0 and LSE = -inf exactly and add nothing to any gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ringattn/attention.hpp"
#include "tests/common/attention_testing.hpp"
#include "tests/common/cpu_flash_testing.hpp"
#include "tests/common/random.hpp"

namespace ringattn {
namespace {

using test::FlashCase;
using test::FlashProblem;
using test::kTolerance;
using test::Layout;
using test::Precision;

// Document start lists that outlive the cases (Mask holds a pointer).
const std::int64_t kAtTileEdges[] = {64, 128};
const std::int64_t kAroundTileEdges[] = {63, 65, 127, 129, 191};
const std::int64_t kShortDocuments[] = {1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 150, 151};
const std::int64_t kEmptyAndOutside[] = {-5, 0, 0, 40, 40, 40, 100, 500, 500};
// Two batch rows, three starts each: the second row padded with a start past the sequence.
const std::int64_t kPerBatchRow[] = {30, 64, 97, 10, 1000, 1000};
// A chunk of a longer sequence: positions 1000.. for queries and 900.. for keys.
const std::int64_t kChunkDocuments[] = {950, 1030, 1031, 1100};

Mask with_documents(Mask mask, const std::int64_t* starts, std::int64_t count,
                    std::int64_t batch_stride = 0) {
  mask.documents = {starts, count, batch_stride};
  return mask;
}
Mask with_window(Mask mask, std::int64_t left, std::int64_t right) {
  mask.window_left = left;
  mask.window_right = right;
  return mask;
}

constexpr Mask kCausal{true, 0, 0};
constexpr Mask kFull{false, 0, 0};

std::vector<FlashCase> cases() {
  return {
      {"DocsAtTileEdgesCausal", {1, 192, 192, 2, 1, 32}, with_documents(kCausal, kAtTileEdges, 2)},
      {"DocsAroundTileEdges", {1, 200, 200, 4, 2, 16}, with_documents(kFull, kAroundTileEdges, 5)},
      {"ShortDocsCausalGqa4", {1, 160, 160, 4, 1, 24}, with_documents(kCausal, kShortDocuments, 13)},
      {"EmptyAndOutsideDocs", {1, 130, 130, 2, 2, 16},
       with_documents(kCausal, kEmptyAndOutside, 9)},
      {"PerBatchRowDocs", {2, 120, 120, 2, 1, 16},
       with_documents(kCausal, kPerBatchRow, 3, 3)},
      {"Window1Causal", {1, 130, 130, 2, 1, 16}, with_window(kCausal, 1, 0)},
      {"Window63Causal", {1, 200, 200, 2, 2, 16}, with_window(kCausal, 63, 0)},
      {"Window64Causal", {1, 200, 200, 2, 1, 16}, with_window(kCausal, 64, 0)},
      {"Window65CausalPacked", {2, 150, 150, 4, 2, 16}, with_window(kCausal, 65, 0), Layout::packed},
      {"WindowLongerThanSequence", {1, 100, 100, 2, 1, 16}, with_window(kCausal, 1000, 0)},
      {"WindowBothSides", {1, 180, 180, 2, 1, 16}, with_window(kFull, 40, 70)},
      {"WindowRightOnly", {1, 140, 140, 2, 2, 16}, with_window(kFull, 0, 1)},
      {"WindowAndDocsCausal", {1, 200, 200, 4, 2, 16},
       with_window(with_documents(kCausal, kAroundTileEdges, 5), 50, 0)},
      {"WindowAndDocsHeadMajor", {1, 170, 170, 2, 1, 16},
       with_window(with_documents(kFull, kShortDocuments, 13), 9, 9), Layout::head_major},
      // A chunk of queries 1000..1099 against keys 900..1029: rows in the document from 1031 on
      // see no key of this chunk; under the window, rows far from the keys see none either.
      {"ChunkDocsRowsWithoutKeys", {1, 100, 130, 2, 1, 16},
       with_documents({true, 1000, 900}, kChunkDocuments, 4)},
      {"ChunkWindowRowsWithoutKeys", {1, 100, 70, 2, 2, 16}, with_window({true, 1000, 900}, 100, 0)},
      {"ChunkDocsValueDims", {1, 100, 130, 2, 1, 24, 40},
       with_window(with_documents({false, 1000, 900}, kChunkDocuments, 4), 0, 30)},
      {"LargeLogitsDocsWindow", {1, 140, 140, 2, 1, 16},
       with_window(with_documents(kCausal, kAroundTileEdges, 5), 70, 0), Layout::contiguous,
       test::Logits::large_offset},
  };
}

class FlashMasks : public testing::TestWithParam<std::tuple<FlashCase, Precision>> {};

template <typename T>
void run_case(const FlashCase& c) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(77);
  FlashProblem<T> p(c, rng);
  p.forward();
  p.prepare();
  const auto ref = p.oracle_forward();
  double tol_o = kTolerance<T>, tol_lse = kTolerance<T>;
  if (c.logits != test::Logits::normal) {
    // Scores near 1e4 carry rounding of ~1e4 u: twice the naive attention's error in T.
    std::vector<double> lo, llse;
    test::naive_forward<T>(p.s, p.q, p.k, p.v, p.mask, p.scale, lo, llse);
    tol_o = std::max(tol_o, 2.0 * test::compare(lo, ref.o).rel);
    tol_lse = std::max(tol_lse, 2.0 * test::compare(llse, ref.lse).rel);
  }
  EXPECT_TRUE(test::Close("O", p.o.values(), ref.o, tol_o));
  EXPECT_TRUE(test::Close("LSE", p.lse.values(), ref.lse, tol_lse));
  test::check_backward(p, c.layout, rng);
}

TEST_P(FlashMasks, ForwardAndBackwardMatchTheOracle) {
  const auto& [c, precision] = GetParam();
  if (precision == Precision::f64) {
    run_case<double>(c);
  } else {
    run_case<float>(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, FlashMasks,
                         testing::Combine(testing::ValuesIn(cases()),
                                          testing::Values(Precision::f64, Precision::f32)),
                         test::case_precision_name);

// The oracle against the long-double naive attention written apart from it, on every case: a
// mistake in the definition shared by the oracle and the block would show here.
TEST(FlashMasksOracle, MatchesTheIndependentNaiveAttention) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(78);
  for (const FlashCase& c : cases()) {
    // Scores near 1e4 leave fp64 itself ~1e-12 relative: that case checks the block only.
    if (c.logits != test::Logits::normal) continue;
    SCOPED_TRACE(c.name);
    FlashProblem<double> p(c, rng);
    const auto ref = p.oracle_forward();
    std::vector<double> o, lse;
    test::naive_forward<long double>(p.s, p.q, p.k, p.v, p.mask, p.scale, o, lse);
    EXPECT_TRUE(test::Close("O", ref.o, o, 1e-12));
    EXPECT_TRUE(test::Close("LSE", ref.lse, lse, 1e-12));
    const auto grads = p.oracle();
    std::vector<double> dq, dk, dv;
    test::naive_backward<long double>(p.s, p.q, p.k, p.v, p.g, p.mask, p.scale, dq, dk, dv);
    EXPECT_TRUE(test::Close("dQ", grads.dq, dq, 1e-12));
    EXPECT_TRUE(test::Close("dK", grads.dk, dk, 1e-12));
    EXPECT_TRUE(test::Close("dV", grads.dv, dv, 1e-12));
  }
}

// Rows and keys that nothing connects: O = 0 and LSE = -inf exactly, and their gradients zero,
// counted so the cases above cannot pass without exercising them.
TEST(FlashMasksOracle, CasesHoldRowsWithoutKeysAndKeysWithoutRows) {
  SCOPED_TRACE(test::seed_trace());
  std::mt19937_64 rng = test::make_rng(79);
  for (const char* name : {"ChunkDocsRowsWithoutKeys", "ChunkWindowRowsWithoutKeys"}) {
    SCOPED_TRACE(name);
    for (const FlashCase& c : cases()) {
      if (std::string(c.name) != name) continue;
      FlashProblem<double> p(c, rng);
      p.forward();
      std::int64_t empty_rows = 0;
      const std::vector<double> lse = p.lse.values(), o = p.o.values();
      for (std::size_t i = 0; i < lse.size(); ++i) empty_rows += std::isinf(lse[i]) && lse[i] < 0;
      EXPECT_GT(empty_rows, 0);
      const auto grads = p.oracle();
      std::int64_t zero_keys = 0;
      const std::int64_t d = c.s.head_dim;
      for (std::size_t j = 0; j < grads.dk.size(); j += d) {
        bool zero = true;
        for (std::int64_t x = 0; x < d; ++x) zero = zero && grads.dk[j + x] == 0.0;
        zero_keys += zero;
      }
      EXPECT_GT(zero_keys, 0);
    }
  }
}

}  // namespace
}  // namespace ringattn
