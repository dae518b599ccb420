// The C API refuses, before touching any memory, what would make the block index outside the
// caller's buffers or write over its own inputs: extents beyond the kernels' limits, element
// counts and spans that overflow int64, negative extents and strides, and outputs that share memory
// with an input or another output. Every refusal is RINGATTN_ERROR_INVALID_ARGUMENT with a message
// naming the tensor, the value and the limit. The descriptors of huge tensors point to small
// buffers: a check that let one through would have the block read far past them.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ringattn/error.hpp"
#include "ringattn/ringattn.h"
#include "src/attention_checks.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/random.hpp"

namespace {

using ringattn::test::describe;
using ringattn::test::describe_at;

constexpr std::int64_t B = 2, S = 33, Hq = 4, Hkv = 2, D = 16;
constexpr std::int64_t k2To40 = std::int64_t{1} << 40;

// The status is INVALID_ARGUMENT and the message holds every part.
::testing::AssertionResult Refused(ringattn_status_t status,
                                   std::initializer_list<std::string> parts) {
  const std::string message = ringattn_last_error();
  if (status != RINGATTN_ERROR_INVALID_ARGUMENT) {
    return ::testing::AssertionFailure() << "status " << status << " (" << message
                                         << "); expected RINGATTN_ERROR_INVALID_ARGUMENT";
  }
  for (const std::string& part : parts) {
    if (message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "the message \"" << message << "\" does not contain \"" << part << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

// "[0x1000, 0x2000)": the byte range of a tensor of `elements` f64 at `data`, as messages print it.
std::string range(const void* data, std::int64_t elements) {
  const auto* begin = static_cast<const unsigned char*>(data);
  return ringattn::detail::concat("[", static_cast<const void*>(begin), ", ",
                                  static_cast<const void*>(begin + elements * 8), ")");
}

struct Problem {
  std::mt19937_64 rng = ringattn::test::make_rng(31);
  std::vector<double> q = ringattn::test::normal_vector<double>(B * S * Hq * D, rng);
  std::vector<double> k = ringattn::test::normal_vector<double>(B * S * Hkv * D, rng);
  std::vector<double> v = ringattn::test::normal_vector<double>(B * S * Hkv * D, rng);
  std::vector<double> o = ringattn::test::nan_vector<double>(B * S * Hq * D);
  std::vector<double> lse = ringattn::test::nan_vector<double>(B * Hq * S);
  std::vector<double> dout = ringattn::test::normal_vector<double>(B * S * Hq * D, rng);
  std::vector<double> delta = ringattn::test::nan_vector<double>(B * Hq * S);
  std::vector<double> dq = std::vector<double>(B * S * Hq * D, 0.0);
  std::vector<double> dk = std::vector<double>(B * S * Hkv * D, 0.0);
  std::vector<double> dv = std::vector<double>(B * S * Hkv * D, 0.0);

  ringattn_forward_params_t forward() {
    ringattn_forward_params_t p{};
    p.struct_size = sizeof(p);
    p.q = describe(q, {B, S, Hq, D});
    p.k = describe(k, {B, S, Hkv, D});
    p.v = describe(v, {B, S, Hkv, D});
    p.o = describe(o, {B, S, Hq, D});
    p.lse = describe(lse, {B, Hq, S});
    p.scale = 0.25;
    p.causal = 1;
    return p;
  }

  ringattn_backward_params_t backward() {
    ringattn_backward_params_t p{};
    p.struct_size = sizeof(p);
    p.q = describe(q, {B, S, Hq, D});
    p.k = describe(k, {B, S, Hkv, D});
    p.v = describe(v, {B, S, Hkv, D});
    p.dout = describe(dout, {B, S, Hq, D});
    p.lse = describe(lse, {B, Hq, S});
    p.delta = describe(delta, {B, Hq, S});
    p.dq = describe(dq, {B, S, Hq, D});
    p.dk = describe(dk, {B, S, Hkv, D});
    p.dv = describe(dv, {B, S, Hkv, D});
    p.scale = 0.25;
    p.causal = 1;
    return p;
  }

  // The forward and backward_prepare, so that backward() describes a consistent call.
  void run_forward_and_prepare() {
    ringattn_forward_params_t p = forward();
    ASSERT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
    ringattn_tensor_t o_t = describe(o, {B, S, Hq, D}), do_t = describe(dout, {B, S, Hq, D});
    ringattn_tensor_t delta_t = describe(delta, {B, Hq, S});
    ASSERT_EQ(ringattn_attention_backward_prepare(&o_t, &do_t, &delta_t, nullptr), RINGATTN_SUCCESS)
        << ringattn_last_error();
  }
};

const std::string kMaxRows = std::to_string(ringattn::detail::kMaxRows);

// 2^40 rows in descriptors over buffers of a few rows: refused by every entry point, by name.
TEST(CApiBounds, RowsBeyondTheKernelsLimit) {
  Problem problem;
  ringattn_forward_params_t p = problem.forward();
  p.q = describe_at(problem.q.data(), {1, k2To40, 1, D});
  p.o = describe_at(problem.o.data(), {1, k2To40, 1, D});
  p.lse = describe_at(problem.lse.data(), {1, 1, k2To40});
  p.k = describe_at(problem.k.data(), {1, S, 1, D});
  p.v = describe_at(problem.v.data(), {1, S, 1, D});
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"ringattn_attention_forward: q has rows 1099511627776 (axis 1",
                       "the kernels take at most " + kMaxRows, "32-bit row indices"}));

  p = problem.forward();
  p.k = describe_at(problem.k.data(), {B, k2To40, Hkv, D});
  p.v = describe_at(problem.v.data(), {B, k2To40, Hkv, D});
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"k has rows 1099511627776", "at most " + kMaxRows}));

  ringattn_backward_params_t bp = problem.backward();
  bp.q = describe_at(problem.q.data(), {1, k2To40, 1, D});
  bp.dout = describe_at(problem.dout.data(), {1, k2To40, 1, D});
  bp.dq = describe_at(problem.dq.data(), {1, k2To40, 1, D});
  bp.lse = describe_at(problem.lse.data(), {1, 1, k2To40});
  bp.delta = describe_at(problem.delta.data(), {1, 1, k2To40});
  bp.k = describe_at(problem.k.data(), {1, S, 1, D});
  bp.v = describe_at(problem.v.data(), {1, S, 1, D});
  bp.dk = describe_at(problem.dk.data(), {1, S, 1, D});
  bp.dv = describe_at(problem.dv.data(), {1, S, 1, D});
  EXPECT_TRUE(Refused(ringattn_attention_backward(&bp, nullptr),
                      {"ringattn_attention_backward: q has rows 1099511627776"}));

  ringattn_tensor_t o_t = describe_at(problem.o.data(), {1, k2To40, 1, D});
  ringattn_tensor_t do_t = describe_at(problem.dout.data(), {1, k2To40, 1, D});
  ringattn_tensor_t delta_t = describe_at(problem.delta.data(), {1, 1, k2To40});
  EXPECT_TRUE(Refused(ringattn_attention_backward_prepare(&o_t, &do_t, &delta_t, nullptr),
                      {"ringattn_attention_backward_prepare: o has rows 1099511627776"}));
}

// Each limit is taken and one past it refused. No query row means nothing is read, so the limit
// itself is tried on k (its rows) or on an empty q (its batch and heads).
TEST(CApiBounds, EachLimitIsTakenAndOnePastItRefused) {
  Problem problem;
  auto call = [&](std::initializer_list<std::int64_t> q_shape,
                  std::initializer_list<std::int64_t> k_shape) {
    ringattn_forward_params_t p = problem.forward();
    p.q = describe_at(problem.q.data(), q_shape);
    p.o = describe_at(problem.o.data(), q_shape);
    p.lse = describe_at(problem.lse.data(), {p.q.shape[0], p.q.shape[2], p.q.shape[1]});
    p.k = describe_at(problem.k.data(), k_shape);
    p.v = describe_at(problem.v.data(), k_shape);
    return ringattn_attention_forward(&p, nullptr);
  };
  using ringattn::detail::kMaxBatch;
  using ringattn::detail::kMaxHeads;
  using ringattn::detail::kMaxRows;
  EXPECT_EQ(call({1, 0, 1, D}, {1, kMaxRows, 1, D}), RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_TRUE(Refused(call({1, 0, 1, D}, {1, kMaxRows + 1, 1, D}),
                      {"k has rows 2147483392", "at most 2147483391"}));
  EXPECT_EQ(call({kMaxBatch, 0, kMaxHeads, D}, {kMaxBatch, S, 1, D}), RINGATTN_SUCCESS)
      << ringattn_last_error();
  EXPECT_TRUE(Refused(call({kMaxBatch + 1, 0, 1, D}, {kMaxBatch + 1, S, 1, D}),
                      {"q has batch 65536 (axis 0 of shape [65536, 0, 1, 16])",
                       "at most 65535 (a CUDA grid dimension)"}));
  EXPECT_TRUE(Refused(call({1, 0, kMaxHeads + 1, D}, {1, S, 1, D}),
                      {"q has heads 65536 (axis 2", "at most 65535"}));
  EXPECT_TRUE(Refused(call({1, 0, 1, D}, {1, S, kMaxHeads + 1, D}),
                      {"k has heads 65536 (axis 2", "at most 65535"}));
  const std::int64_t head_dim = std::int64_t{1} << 31;
  EXPECT_TRUE(Refused(call({1, 1, 1, head_dim}, {1, 1, 1, head_dim}),
                      {"q has head_dim 2147483648 (axis 3", "at most 2147483647"}));
}

// Element counts and spans that int64 cannot hold, and spans past the address space.
TEST(CApiBounds, SizesThatOverflow) {
  Problem problem;
  const std::int64_t m = std::int64_t{1} << 20;
  ringattn_forward_params_t p = problem.forward();
  p.q = describe_at(problem.q.data(), {m, m, m, m});
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"the element count of q (shape [1048576, 1048576, 1048576, 1048576]) "
                       "overflows int64 (1152921504606846976 x 1048576)"}));

  // Every extent within the limits, their product past int64 at the last factor.
  using ringattn::detail::kMaxRows;
  p = problem.forward();
  p.q = describe_at(problem.q.data(), {65535, kMaxRows, 65535, 65535});
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"the element count of q (shape [65535, 2147483391, 65535, 65535]) "
                       "overflows int64 (9223089460252638975 x 65535)"}));

  // Small extents, strides whose span overflows: in elements, then in bytes.
  p = problem.forward();
  p.v.strides[0] = std::int64_t{1} << 62;
  p.v.shape[0] = 3;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"the span of v along axis 0 ((extent - 1) x stride) overflows int64 "
                       "(2 x 4611686018427387904)"}));
  p = problem.forward();
  p.o.strides[0] = std::int64_t{1} << 61;
  EXPECT_TRUE(
      Refused(ringattn_attention_forward(&p, nullptr), {"the span of o in bytes overflows int64"}));

  ringattn_backward_params_t bp = problem.backward();
  bp.dk.strides[1] = std::int64_t{1} << 58;
  EXPECT_TRUE(Refused(ringattn_attention_backward(&bp, nullptr),
                      {"ringattn_attention_backward: the span of dk along axis 1 ((extent - 1) x "
                       "stride) overflows int64 (32 x 288230376151711744)"}));

  // A span that fits in int64 but runs past the top of the address space.
  p = problem.forward();
  p.lse.data = reinterpret_cast<void*>(UINTPTR_MAX - 1023);
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"lse at 0xfffffffffffffc00 spans 2112 bytes (shape [2, 4, 33], strides "
                       "[132, 33, 1]), past the end of the address space"}));
}

TEST(CApiBounds, NegativeExtentsAndStrides) {
  Problem problem;
  ringattn_forward_params_t p = problem.forward();
  p.q.shape[1] = -5;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"q has extent -5 on axis 1 (shape [2, -5, 4, 16]); expected >= 0"}));
  p = problem.forward();
  p.lse.shape[2] = -S;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr), {"lse has extent -33 on axis 2"}));
  p = problem.forward();
  p.k.strides[1] = -Hkv * D;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"k has stride -32 on axis 1; expected >= 1"}));
  ringattn_tensor_t o_t = describe(problem.o, {B, S, Hq, D});
  ringattn_tensor_t do_t = describe(problem.dout, {B, S, Hq, D});
  ringattn_tensor_t delta_t = describe(problem.delta, {B, Hq, S});
  delta_t.strides[0] = -1;
  EXPECT_TRUE(Refused(ringattn_attention_backward_prepare(&o_t, &do_t, &delta_t, nullptr),
                      {"delta has stride -1 on axis 0"}));
}

// Outputs over inputs, and outputs over each other, whole or in part: refused with both ranges,
// before writing anything.
TEST(CApiBounds, OutputsThatOverlapInputsOrEachOther) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  Problem problem;
  ASSERT_NO_FATAL_FAILURE(problem.run_forward_and_prepare());
  const std::vector<double> o_before = problem.o, lse_before = problem.lse;
  const std::int64_t q_elements = B * S * Hq * D, k_elements = B * S * Hkv * D;
  const std::int64_t lse_elements = B * Hq * S;
  ringattn_forward_params_t p = problem.forward();
  p.o.data = problem.q.data();
  EXPECT_TRUE(Refused(
      ringattn_attention_forward(&p, nullptr),
      {"ringattn_attention_forward: o overlaps q (o " + range(problem.q.data(), q_elements) +
       ", q " + range(problem.q.data(), q_elements) + ")"}));
  // Partly: o starts in the last row of q.
  p.o.data = problem.q.data() + q_elements - D;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"o overlaps q (o " + range(problem.q.data() + q_elements - D, q_elements) +
                       ", q " + range(problem.q.data(), q_elements) + ")"}));
  p = problem.forward();
  p.lse.data = problem.o.data() + 7;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"lse overlaps o (lse " + range(problem.o.data() + 7, lse_elements) + ", o " +
                       range(problem.o.data(), q_elements) + ")"}));
  // In combine mode too (it reads and writes o and lse, each in place, and nothing else).
  p = problem.forward();
  p.combine = 1;
  p.lse.data = problem.k.data() + k_elements - lse_elements;
  EXPECT_TRUE(Refused(
      ringattn_attention_forward(&p, nullptr),
      {"lse overlaps k (lse " + range(problem.k.data() + k_elements - lse_elements, lse_elements) +
       ", k " + range(problem.k.data(), k_elements) + ")"}));

  ringattn_backward_params_t bp = problem.backward();
  bp.dq.data = problem.dout.data();
  EXPECT_TRUE(Refused(ringattn_attention_backward(&bp, nullptr),
                      {"ringattn_attention_backward: dq overlaps dout (dq " +
                       range(problem.dout.data(), q_elements) + ", dout " +
                       range(problem.dout.data(), q_elements) + ")"}));
  // dk and dv in one buffer, dv starting halfway through dk.
  std::vector<double> key_grads(k_elements + k_elements / 2, 0.0);
  bp = problem.backward();
  bp.dk.data = key_grads.data();
  bp.dv.data = key_grads.data() + k_elements / 2;
  EXPECT_TRUE(
      Refused(ringattn_attention_backward(&bp, nullptr),
              {"dv overlaps dk (dv " + range(key_grads.data() + k_elements / 2, k_elements) +
               ", dk " + range(key_grads.data(), k_elements) + ")"}));
  bp = problem.backward();
  bp.delta.data = problem.dk.data() + 1;
  EXPECT_TRUE(Refused(ringattn_attention_backward(&bp, nullptr), {"dk overlaps delta"}));

  ringattn_tensor_t o_t = describe(problem.o, {B, S, Hq, D});
  ringattn_tensor_t do_t = describe(problem.dout, {B, S, Hq, D});
  ringattn_tensor_t delta_t = describe(problem.o, {B, Hq, S});
  EXPECT_TRUE(Refused(ringattn_attention_backward_prepare(&o_t, &do_t, &delta_t, nullptr),
                      {"ringattn_attention_backward_prepare: delta overlaps o (delta " +
                       range(problem.o.data(), lse_elements) + ", o " +
                       range(problem.o.data(), q_elements) + ")"}));

  // The refused calls wrote nothing: q, k and v are intact, so a legal forward gives the first
  // one's results (into outputs poisoned again).
  ringattn::test::fill_nan(problem.o);
  ringattn::test::fill_nan(problem.lse);
  p = problem.forward();
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_EQ(problem.o, o_before);
  EXPECT_EQ(problem.lse, lse_before);
}

// Row positions (start + row) and their differences must fit in int64: the last start whose rows
// all fit is taken, and gives the results of starts 0 (a causal mask sees only differences); one
// past it is refused by name, as are starts so far apart that a query minus a key overflows.
TEST(CApiBounds, PositionsThatOverflowInt64) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  Problem problem;
  ASSERT_NO_FATAL_FAILURE(problem.run_forward_and_prepare());
  const std::vector<double> o_at_zero = problem.o, lse_at_zero = problem.lse;
  ringattn::test::fill_nan(problem.o);
  ringattn::test::fill_nan(problem.lse);
  ringattn_forward_params_t p = problem.forward();
  p.q_start = p.k_start = kMax - S;
  ASSERT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_EQ(problem.o, o_at_zero);
  EXPECT_EQ(problem.lse, lse_at_zero);

  p = problem.forward();
  p.q_start = kMax - S + 1;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"ringattn_attention_forward: q_start is 9223372036854775775: the positions "
                       "of the 33 query rows pass int64 (q_start + q_len must be at most "
                       "9223372036854775807)"}));
  ringattn_backward_params_t bp = problem.backward();
  bp.k_start = kMax - 2;
  EXPECT_TRUE(Refused(ringattn_attention_backward(&bp, nullptr),
                      {"ringattn_attention_backward: k_start is 9223372036854775805: the "
                       "positions of the 33 key rows pass int64"}));
  p = problem.forward();
  p.q_start = kMax - S;
  p.k_start = -1;
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr),
                      {"q_start 9223372036854775774 and k_start -1 are too far apart: a query "
                       "position minus a key position overflows int64"}));
  bp = problem.backward();
  bp.q_start = std::numeric_limits<std::int64_t>::min();
  bp.k_start = 0;
  EXPECT_TRUE(Refused(ringattn_attention_backward(&bp, nullptr),
                      {"q_start -9223372036854775808 and k_start 0 are too far apart"}));
}

// Views interleaved in one buffer without a common element are legal: Q, K and V of a packed
// [B, S, Hq + 2 Hkv, D] buffer, and dQ, dK and dV of a packed gradient, give the results of
// separate buffers bit for bit. A view shifted half a row into its neighbour's slot is refused.
TEST(CApiBounds, PackedViewsThatShareNoElementAreTaken) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  Problem problem;
  ASSERT_NO_FATAL_FAILURE(problem.run_forward_and_prepare());
  ringattn_backward_params_t separate = problem.backward();
  ASSERT_EQ(ringattn_attention_backward(&separate, nullptr), RINGATTN_SUCCESS)
      << ringattn_last_error();

  constexpr std::int64_t H = Hq + 2 * Hkv;
  std::vector<double> packed(B * S * H * D), packed_grads(B * S * H * D, 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < S; ++s) {
      for (std::int64_t x = 0; x < Hq * D; ++x) {
        packed[(b * S + s) * H * D + x] = problem.q[(b * S + s) * Hq * D + x];
      }
      for (std::int64_t x = 0; x < Hkv * D; ++x) {
        packed[(b * S + s) * H * D + Hq * D + x] = problem.k[(b * S + s) * Hkv * D + x];
        packed[(b * S + s) * H * D + (Hq + Hkv) * D + x] = problem.v[(b * S + s) * Hkv * D + x];
      }
    }
  }
  auto slot = [&](std::vector<double>& buffer, std::int64_t first_head, std::int64_t heads) {
    ringattn_tensor_t t = describe(buffer, {B, S, heads, D});
    t.data = buffer.data() + first_head * D;
    t.strides[0] = S * H * D;
    t.strides[1] = H * D;
    return t;
  };
  std::vector<double> o(problem.o.size()), lse(problem.lse.size());
  ringattn_forward_params_t p = problem.forward();
  p.q = slot(packed, 0, Hq);
  p.k = slot(packed, Hq, Hkv);
  p.v = slot(packed, Hq + Hkv, Hkv);
  p.o = describe(o, {B, S, Hq, D});
  p.lse = describe(lse, {B, Hq, S});
  ASSERT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_EQ(o, problem.o);
  EXPECT_EQ(lse, problem.lse);

  ringattn_backward_params_t bp = problem.backward();
  bp.q = p.q;
  bp.k = p.k;
  bp.v = p.v;
  bp.dq = slot(packed_grads, 0, Hq);
  bp.dk = slot(packed_grads, Hq, Hkv);
  bp.dv = slot(packed_grads, Hq + Hkv, Hkv);
  ASSERT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < S; ++s) {
      const double* row = packed_grads.data() + (b * S + s) * H * D;
      for (std::int64_t x = 0; x < Hq * D; ++x) {
        ASSERT_EQ(row[x], problem.dq[(b * S + s) * Hq * D + x]) << "dq b " << b << " s " << s;
      }
      for (std::int64_t x = 0; x < Hkv * D; ++x) {
        ASSERT_EQ(row[Hq * D + x], problem.dk[(b * S + s) * Hkv * D + x]) << "dk b " << b;
        ASSERT_EQ(row[(Hq + Hkv) * D + x], problem.dv[(b * S + s) * Hkv * D + x]) << "dv b " << b;
      }
    }
  }

  // dk half a head later: its last head's second half is dv's first head's first half.
  bp.dk.data = static_cast<double*>(bp.dk.data) + D / 2;
  EXPECT_TRUE(Refused(ringattn_attention_backward(&bp, nullptr), {"dv overlaps dk"}));
  // Q's slot as an output of the forward over the same packed buffer.
  p.o = slot(packed, 0, Hq);
  EXPECT_TRUE(Refused(ringattn_attention_forward(&p, nullptr), {"o overlaps q"}));
}

}  // namespace
