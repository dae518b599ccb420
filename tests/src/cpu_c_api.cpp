// The C API on host tensors: results equal the C++ CPU block (which the kernel tests check against
// the oracle), status codes and ringattn_last_error() for each kind of bad call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/ringattn.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/random.hpp"

namespace {

using ringattn::test::describe;

struct Problem {
  static constexpr std::int64_t B = 2, S = 33, Hq = 4, Hkv = 2, D = 16;
  std::mt19937_64 rng = ringattn::test::make_rng(7);
  std::vector<double> q = ringattn::test::normal_vector<double>(B * S * Hq * D, rng);
  std::vector<double> k = ringattn::test::normal_vector<double>(B * S * Hkv * D, rng);
  std::vector<double> v = ringattn::test::normal_vector<double>(B * S * Hkv * D, rng);
  std::vector<double> o = ringattn::test::nan_vector<double>(B * S * Hq * D);
  std::vector<double> lse = ringattn::test::nan_vector<double>(B * Hq * S);

  ringattn_forward_params_t params() {
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

  // The backward's parameters for the forward's `p`, dout, delta and the gradient buffers.
  ringattn_backward_params_t backward_params(const ringattn_forward_params_t& p,
                                             const ringattn_tensor_t& dout,
                                             const ringattn_tensor_t& delta, std::vector<double>& dq,
                                             std::vector<double>& dk, std::vector<double>& dv) {
    return ringattn::test::backward_params_of(p, dout, delta, describe(dq, {B, S, Hq, D}),
                                              describe(dk, {B, S, Hkv, D}),
                                              describe(dv, {B, S, Hkv, D}));
  }

  // The forward through the C API, then the backward's prepare for a random dO drawn from rng.
  struct Prepared {
    ringattn_forward_params_t p{};
    std::vector<double> dout, delta;
    ringattn_tensor_t dout_t{}, delta_t{};  // describe dout and delta, filled in place
  };
  void forward_and_prepare(Prepared& out, std::mt19937_64& rng) {
    out.p = params();
    ASSERT_EQ(ringattn_attention_forward(&out.p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
    out.dout = ringattn::test::normal_vector<double>(o.size(), rng);
    out.delta.assign(lse.size(), 0.0);
    ringattn_tensor_t o_t = describe(o, {B, S, Hq, D});
    out.dout_t = describe(out.dout, {B, S, Hq, D});
    out.delta_t = describe(out.delta, {B, Hq, S});
    ASSERT_EQ(ringattn_attention_backward_prepare(&o_t, &out.dout_t, &out.delta_t, nullptr),
              RINGATTN_SUCCESS)
        << ringattn_last_error();
  }
};

TEST(CApi, VersionAndStatusStrings) {
  EXPECT_EQ(ringattn_version(), RINGATTN_VERSION_CODE);
  EXPECT_STREQ(ringattn_version_string(), RINGATTN_VERSION_STRING);
  EXPECT_STREQ(ringattn_status_string(RINGATTN_SUCCESS), "success");
  EXPECT_STREQ(ringattn_status_string(RINGATTN_ERROR_INVALID_ARGUMENT), "invalid argument");
}

TEST(CApi, HostForwardAndBackwardEqualTheCppBlock) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  Problem problem;
  ringattn_forward_params_t p = problem.params();
  ASSERT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();

  using ringattn::TensorView;
  auto view = [](std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.data(), ringattn::DType::f64, shape);
  };
  const std::int64_t B = Problem::B, S = Problem::S, Hq = Problem::Hq, Hkv = Problem::Hkv, D = Problem::D;
  std::vector<double> o(problem.o.size()), lse(problem.lse.size());
  const ringattn::Mask mask{true, 0, 0};
  ringattn::cpu::flash_forward({view(problem.q, {B, S, Hq, D}), view(problem.k, {B, S, Hkv, D}),
                                view(problem.v, {B, S, Hkv, D}), view(o, {B, S, Hq, D}),
                                view(lse, {B, Hq, S}), 0.25, mask, false});
  EXPECT_EQ(problem.o, o);
  EXPECT_EQ(problem.lse, lse);

  std::mt19937_64 rng = ringattn::test::make_rng(8);
  std::vector<double> dout = ringattn::test::normal_vector<double>(o.size(), rng);
  std::vector<double> delta(lse.size()), dq(o.size(), 0.0), dk(problem.k.size(), 0.0), dv(dk.size(), 0.0);
  ringattn_tensor_t o_t = describe(problem.o, {B, S, Hq, D}), do_t = describe(dout, {B, S, Hq, D});
  ringattn_tensor_t delta_t = describe(delta, {B, Hq, S});
  ASSERT_EQ(ringattn_attention_backward_prepare(&o_t, &do_t, &delta_t, nullptr), RINGATTN_SUCCESS)
      << ringattn_last_error();
  ringattn_backward_params_t bp = problem.backward_params(p, do_t, delta_t, dq, dk, dv);
  ASSERT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();

  std::vector<double> delta2(lse.size()), dq2(dq.size(), 0.0), dk2(dk.size(), 0.0), dv2(dv.size(), 0.0);
  ringattn::cpu::flash_backward_prepare(view(o, {B, S, Hq, D}), view(dout, {B, S, Hq, D}), view(delta2, {B, Hq, S}));
  ringattn::cpu::flash_backward({view(problem.q, {B, S, Hq, D}), view(problem.k, {B, S, Hkv, D}),
                                 view(problem.v, {B, S, Hkv, D}), view(dout, {B, S, Hq, D}),
                                 view(lse, {B, Hq, S}), view(delta2, {B, Hq, S}), view(dq2, {B, S, Hq, D}),
                                 view(dk2, {B, S, Hkv, D}), view(dv2, {B, S, Hkv, D}), 0.25, mask});
  EXPECT_EQ(delta, delta2);
  EXPECT_EQ(dq, dq2);
  EXPECT_EQ(dk, dk2);
  EXPECT_EQ(dv, dv2);
}

// ringattn_attention_backward_prepare_zero_dq: the same delta as the plain prepare, bitwise, and dq
// (NaN before) zeros, so that the backward adding into it gives the gradients of a zeroed dq; a
// missing dq, a dq of another shape or dtype, and one that overlaps delta are refused by name.
TEST(CApi, PrepareCanZeroDqInTheSamePass) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  Problem problem;
  std::mt19937_64 rng = ringattn::test::make_rng(11);
  Problem::Prepared plain;
  problem.forward_and_prepare(plain, rng);
  const std::int64_t B = Problem::B, S = Problem::S, Hq = Problem::Hq, D = Problem::D;
  std::vector<double> delta = ringattn::test::nan_vector<double>(plain.delta.size());
  std::vector<double> dq = ringattn::test::nan_vector<double>(problem.q.size());
  ringattn_tensor_t o_t = describe(problem.o, {B, S, Hq, D}), delta_t = describe(delta, {B, Hq, S});
  ringattn_tensor_t dq_t = describe(dq, {B, S, Hq, D});
  ASSERT_EQ(ringattn_attention_backward_prepare_zero_dq(&o_t, &plain.dout_t, &delta_t, &dq_t,
                                                        nullptr),
            RINGATTN_SUCCESS)
      << ringattn_last_error();
  EXPECT_EQ(delta, plain.delta);
  EXPECT_EQ(dq, std::vector<double>(dq.size(), 0.0));

  // The backward into the zeroed dq against the same backward into a dq made of zeros.
  std::vector<double> dk(problem.k.size(), 0.0), dv(problem.v.size(), 0.0);
  ringattn_backward_params_t bp = problem.backward_params(plain.p, plain.dout_t, delta_t, dq, dk, dv);
  ASSERT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  std::vector<double> dq2(dq.size(), 0.0), dk2(dk.size(), 0.0), dv2(dv.size(), 0.0);
  bp = problem.backward_params(plain.p, plain.dout_t, plain.delta_t, dq2, dk2, dv2);
  ASSERT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_EQ(dq, dq2);
  EXPECT_EQ(dk, dk2);
  EXPECT_EQ(dv, dv2);

  const auto refused = [&](const ringattn_tensor_t* bad_dq, const std::string& expected) {
    EXPECT_EQ(ringattn_attention_backward_prepare_zero_dq(&o_t, &plain.dout_t, &delta_t, bad_dq,
                                                          nullptr),
              RINGATTN_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(ringattn_last_error()).find(expected), std::string::npos)
        << ringattn_last_error();
  };
  refused(nullptr, "ringattn_attention_backward_prepare_zero_dq: dq is a null pointer");
  ringattn_tensor_t bad = describe(dq, {B, S, Hq - 1, D});
  refused(&bad, "dq has shape [2, 33, 3, 16]");
  std::vector<float> dq_f32(dq.size());
  bad = ringattn::test::describe_at(dq_f32.data(), {B, S, Hq, D});
  bad.dtype = RINGATTN_F32;
  refused(&bad, "dq has dtype f32");
  // dq over o's memory: refused before anything is read or written.
  bad = describe(problem.o, {B, S, Hq, D});
  refused(&bad, "dq overlaps o");
}

// v (and so o, dout and dv) of a head dim of its own, d_v 20 against d_qk 12, each descriptor with
// its own shape: forward, prepare and backward through the C API against the fp64 oracle; an o of
// d_qk is refused with a message naming both head dims.
TEST(CApi, HostCallsTakeAValueHeadDimOfTheirOwn) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  const std::int64_t B = 2, S = 37, Hq = 4, Hkv = 2, D = 12, Dv = 20;
  std::mt19937_64 rng = ringattn::test::make_rng(9);
  auto q = ringattn::test::normal_vector<double>(B * S * Hq * D, rng);
  auto k = ringattn::test::normal_vector<double>(B * S * Hkv * D, rng);
  auto v = ringattn::test::normal_vector<double>(B * S * Hkv * Dv, rng);
  auto dout = ringattn::test::normal_vector<double>(B * S * Hq * Dv, rng);
  auto o = ringattn::test::nan_vector<double>(dout.size());
  auto lse = ringattn::test::nan_vector<double>(B * Hq * S);
  auto delta = ringattn::test::nan_vector<double>(lse.size());
  std::vector<double> dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  ringattn_forward_params_t p{};
  p.struct_size = sizeof(p);
  p.q = describe(q, {B, S, Hq, D});
  p.k = describe(k, {B, S, Hkv, D});
  p.v = describe(v, {B, S, Hkv, Dv});
  p.o = describe(o, {B, S, Hq, Dv});
  p.lse = describe(lse, {B, Hq, S});
  p.scale = scale;
  p.causal = 1;
  p.q_start = 5;
  ASSERT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
  ringattn_tensor_t dout_t = describe(dout, {B, S, Hq, Dv}), delta_t = describe(delta, {B, Hq, S});
  ASSERT_EQ(ringattn_attention_backward_prepare(&p.o, &dout_t, &delta_t, nullptr), RINGATTN_SUCCESS)
      << ringattn_last_error();
  ringattn_backward_params_t bp =
      ringattn::test::backward_params_of(p, dout_t, delta_t, describe(dq, {B, S, Hq, D}),
                                         describe(dk, {B, S, Hkv, D}), describe(dv, {B, S, Hkv, Dv}));
  ASSERT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();

  using ringattn::TensorView;
  auto view = [](std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.data(), ringattn::DType::f64, shape);
  };
  std::vector<double> o_ref(o.size()), lse_ref(lse.size()), dq_ref(dq.size()), dk_ref(dk.size()),
      dv_ref(dv.size());
  const ringattn::Mask mask{true, 5, 0};
  ringattn::reference::attention_forward(view(q, {B, S, Hq, D}), view(k, {B, S, Hkv, D}),
                                         view(v, {B, S, Hkv, Dv}), mask, scale,
                                         view(o_ref, {B, S, Hq, Dv}), view(lse_ref, {B, Hq, S}));
  ringattn::reference::attention_backward(
      view(q, {B, S, Hq, D}), view(k, {B, S, Hkv, D}), view(v, {B, S, Hkv, Dv}),
      view(dout, {B, S, Hq, Dv}), mask, scale, view(dq_ref, {B, S, Hq, D}),
      view(dk_ref, {B, S, Hkv, D}), view(dv_ref, {B, S, Hkv, Dv}));
  EXPECT_TRUE(ringattn::test::Close("O", o, o_ref, 1e-12));
  EXPECT_TRUE(ringattn::test::Close("LSE", lse, lse_ref, 1e-12));
  EXPECT_TRUE(ringattn::test::Close("dQ", dq, dq_ref, 1e-12));
  EXPECT_TRUE(ringattn::test::Close("dK", dk, dk_ref, 1e-12));
  EXPECT_TRUE(ringattn::test::Close("dV", dv, dv_ref, 1e-12));

  std::vector<double> o_qk(B * S * Hq * D);
  p.o = describe(o_qk, {B, S, Hq, D});
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error())
                .find("ringattn_attention_forward: o has head_dim 12 (shape [2, 37, 4, 12]); "
                      "expected 20, the head_dim of v (q and k have head_dim 12)"),
            std::string::npos)
      << ringattn_last_error();
  bp.dout = describe(o_qk, {B, S, Hq, D});
  EXPECT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("dout has head_dim 12"), std::string::npos)
      << ringattn_last_error();
}

// overwrite_key_gradients, appended to the backward's struct in 0.2: set, dk and dv (NaN before)
// come out as the gradients added into zeros would; in a struct_size of the first version (an
// older caller) it is not read, so a 1 in memory past that size still adds into dk and dv.
TEST(CApi, BackwardOverwritesKeyGradientsWhenTheStructHasTheField) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  Problem problem;
  std::mt19937_64 rng = ringattn::test::make_rng(9);
  Problem::Prepared prepared;
  ASSERT_NO_FATAL_FAILURE(problem.forward_and_prepare(prepared, rng));
  const ringattn_forward_params_t& p = prepared.p;
  const ringattn_tensor_t &do_t = prepared.dout_t, &delta_t = prepared.delta_t;
  struct Gradients {
    std::vector<double> dq, dk, dv;
  };
  auto run = [&](std::size_t struct_size, double dkv_before) {
    Gradients g{std::vector<double>(problem.o.size(), 0.0),
                std::vector<double>(problem.k.size(), dkv_before),
                std::vector<double>(problem.k.size(), dkv_before)};
    ringattn_backward_params_t bp = problem.backward_params(p, do_t, delta_t, g.dq, g.dk, g.dv);
    bp.struct_size = struct_size;
    bp.overwrite_key_gradients = 1;
    EXPECT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_SUCCESS) << ringattn_last_error();
    return g;
  };
  const std::size_t first_size = offsetof(ringattn_backward_params_t, overwrite_key_gradients);
  const Gradients added = run(first_size, 0.0);
  const Gradients overwritten = run(sizeof(ringattn_backward_params_t), std::nan(""));
  EXPECT_EQ(overwritten.dq, added.dq);
  EXPECT_EQ(overwritten.dk, added.dk);
  EXPECT_EQ(overwritten.dv, added.dv);
  // The older caller's struct: dk and dv start at 1 and keep it under the gradient.
  const Gradients older = run(first_size, 1.0);
  for (std::size_t i = 0; i < added.dk.size(); ++i) {
    ASSERT_EQ(older.dk[i], 1.0 + added.dk[i]) << "dk[" << i << "]";
    ASSERT_EQ(older.dv[i], 1.0 + added.dv[i]) << "dv[" << i << "]";
  }

  ringattn_backward_params_t bp{};
  bp.struct_size = first_size - 8;
  EXPECT_EQ(ringattn_attention_backward(&bp, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("struct_size is " + std::to_string(first_size - 8)),
            std::string::npos)
      << ringattn_last_error();
}

// key_rotation_cos and key_rotation_sin, appended to the backward's struct in 0.3: dk is the
// call's without them rotated back (test::rotate_keys_back) to f64 rounding, dq and dv bitwise
// the same; zeroed fields, or a struct_size of 0.2 (which ends before them) with tables in memory
// past it, leave dk as without them; a table of the wrong shape is named.
TEST(CApi, BackwardUndoesTheKeysRotationWhenTheStructHasTheTables) {
  SCOPED_TRACE(ringattn::test::seed_trace());
  Problem problem;
  std::mt19937_64 rng = ringattn::test::make_rng(10);
  Problem::Prepared prepared;
  ASSERT_NO_FATAL_FAILURE(problem.forward_and_prepare(prepared, rng));
  const ringattn_forward_params_t& p = prepared.p;
  const ringattn_tensor_t &do_t = prepared.dout_t, &delta_t = prepared.delta_t;
  const std::int64_t B = Problem::B, S = Problem::S, Hq = Problem::Hq, Hkv = Problem::Hkv,
                     D = Problem::D;
  ringattn::test::KeyRotationTables<double> tables =
      ringattn::test::random_key_rotation<double>(S, D, rng);
  struct Gradients {
    std::vector<double> dq, dk, dv;
  };
  auto run = [&](std::size_t struct_size, bool with_tables, std::int64_t table_rows = Problem::S) {
    Gradients g{std::vector<double>(problem.o.size(), 0.0),
                std::vector<double>(problem.k.size(), 0.0),
                std::vector<double>(problem.k.size(), 0.0)};
    ringattn_backward_params_t bp = problem.backward_params(p, do_t, delta_t, g.dq, g.dk, g.dv);
    bp.struct_size = struct_size;
    bp.overwrite_key_gradients = 1;
    if (with_tables) {
      bp.key_rotation_cos = describe(tables.cos, {table_rows, D / 2});
      bp.key_rotation_sin = describe(tables.sin, {table_rows, D / 2});
    }
    const ringattn_status_t status = ringattn_attention_backward(&bp, nullptr);
    return std::make_pair(status, g);
  };
  const auto [plain_status, plain] = run(sizeof(ringattn_backward_params_t), false);
  ASSERT_EQ(plain_status, RINGATTN_SUCCESS) << ringattn_last_error();
  const auto [status, turned] = run(sizeof(ringattn_backward_params_t), true);
  ASSERT_EQ(status, RINGATTN_SUCCESS) << ringattn_last_error();
  std::vector<double> expected, magnitude;
  ringattn::test::rotate_keys_back(plain.dk, {B, S, S, Hq, Hkv, D}, tables, expected, magnitude);
  EXPECT_TRUE(ringattn::test::Close("dk (rotated back)", turned.dk, expected, 1e-12));
  EXPECT_EQ(turned.dq, plain.dq);
  EXPECT_EQ(turned.dv, plain.dv);
  const auto [older_status, older] =
      run(offsetof(ringattn_backward_params_t, key_rotation_cos), true);
  ASSERT_EQ(older_status, RINGATTN_SUCCESS) << ringattn_last_error();
  EXPECT_EQ(older.dk, plain.dk);

  const auto [bad_status, bad] = run(sizeof(ringattn_backward_params_t), true, S - 1);
  EXPECT_EQ(bad_status, RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("key_rotation.cos has shape [32, 8]"),
            std::string::npos)
      << ringattn_last_error();
}

TEST(CApi, BadCallsReturnAStatusAndAMessage) {
  Problem problem;
  EXPECT_EQ(ringattn_attention_forward(nullptr, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("params is a null pointer"), std::string::npos);

  ringattn_forward_params_t p = problem.params();
  p.struct_size = 8;
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("struct_size is 8"), std::string::npos);

  p = problem.params();
  p.k.dtype = 9;
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("k has dtype code 9"), std::string::npos);

  p = problem.params();
  p.v.shape[1] = 32;
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("v has shape [2, 32, 2, 16]"),
            std::string::npos);

  // A v of another head dim is a v_head_dim of its own: o (of q's head dim here) no longer fits.
  p = problem.params();
  p.v.shape[3] = 8;
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error())
                .find("o has head_dim 16 (shape [2, 33, 4, 16]); expected 8, the head_dim of v"),
            std::string::npos)
      << ringattn_last_error();

  p = problem.params();
  p.scale = -1.0;
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ringattn_last_error()).find("scale is -1"), std::string::npos);

  // A successful call clears the message.
  p = problem.params();
  EXPECT_EQ(ringattn_attention_forward(&p, nullptr), RINGATTN_SUCCESS);
  EXPECT_STREQ(ringattn_last_error(), "");
}

}  // namespace
