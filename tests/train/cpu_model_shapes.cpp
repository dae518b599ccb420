// The transformer's parameter list (train/model_shapes): names, shapes and order; the parameter
// count of the 188M shape against the formula written out here; a V head width of its own
// (v_head_dim, as in multi-head latent attention) in the shapes, the count and the FLOPs, counted
// by hand; validation.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ringattn/error.hpp"
#include "tests/common/attention_testing.hpp"
#include "train/model_shapes.hpp"

namespace ringattn::train {
namespace {

// The 188M reference shape: d_model 1024, 12 layers, 8 heads of 128, 8 kv heads, SwiGLU 2816,
// vocab 32768.
ModelShape shape_188m(bool tied) {
  return {.vocab = 32768,
          .d_model = 1024,
          .layers = 12,
          .q_heads = 8,
          .kv_heads = 8,
          .head_dim = 128,
          .v_head_dim = 128,
          .ffn_hidden = 2816,
          .tied_embeddings = tied};
}

// The count written out term by term.
std::int64_t formula(const ModelShape& s) {
  const std::int64_t d = s.d_model, hd = s.head_dim, vhd = s.v_head_dim;
  const std::int64_t qkv_rows = (s.q_heads + s.kv_heads) * hd + s.kv_heads * vhd;
  const std::int64_t per_layer = d                       // attn_norm
                                 + qkv_rows * d          // wqkv
                                 + d * s.q_heads * vhd   // wo
                                 + d                     // mlp_norm
                                 + 2 * s.ffn_hidden * d  // w_gate_up
                                 + d * s.ffn_hidden;     // w_down
  const std::int64_t embeddings = s.vocab * d * (s.tied_embeddings ? 1 : 2);
  return embeddings + s.layers * per_layer + d;  // + final_norm
}

TEST(ModelShapes, Count188M) {
  const ModelShape tied = shape_188m(true), untied = shape_188m(false);
  const std::int64_t tied_count = parameter_count(tied), untied_count = parameter_count(untied);
  std::printf(
      "188M shape: %lld parameters with the output head tied to the embedding, %lld "
      "untied\n",
      static_cast<long long>(tied_count), static_cast<long long>(untied_count));
  EXPECT_EQ(tied_count, formula(tied));
  EXPECT_EQ(untied_count, formula(untied));
  EXPECT_EQ(untied_count - tied_count, 32768 * 1024);
  // "188M" is the tied model; untied, the separate lm_head adds 33.5M.
  EXPECT_GE(tied_count, 185'000'000);
  EXPECT_LE(tied_count, 192'000'000);
}

TEST(ModelShapes, ListsEveryTensorInOrder) {
  const ModelShape s{.vocab = 11,
                     .d_model = 6,
                     .layers = 2,
                     .q_heads = 4,
                     .kv_heads = 2,
                     .head_dim = 3,
                     .v_head_dim = 3,
                     .ffn_hidden = 5};
  const std::vector<ParameterInfo> list = parameter_list(s);
  struct Expected {
    std::string name;
    std::vector<std::int64_t> shape;
    bool decay;
  };
  std::vector<Expected> expected{{"tok_embedding", {11, 6}, false}};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    expected.push_back({p + "attn_norm", {6}, false});
    expected.push_back({p + "wqkv", {24, 6}, true});  // (4 + 2 * 2) * 3
    expected.push_back({p + "wo", {6, 12}, true});
    expected.push_back({p + "mlp_norm", {6}, false});
    expected.push_back({p + "w_gate_up", {10, 6}, true});
    expected.push_back({p + "w_down", {6, 5}, true});
  }
  expected.push_back({"final_norm", {6}, false});
  expected.push_back({"lm_head", {11, 6}, true});
  ASSERT_EQ(list.size(), expected.size());
  std::int64_t total = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    EXPECT_EQ(list[i].name, expected[i].name) << "parameter " << i;
    EXPECT_EQ(list[i].shape, expected[i].shape) << list[i].name;
    EXPECT_EQ(list[i].weight_decay, expected[i].decay) << list[i].name;
    std::int64_t elements = 1;
    for (std::int64_t extent : expected[i].shape) elements *= extent;
    EXPECT_EQ(list[i].elements, elements) << list[i].name;
    total += elements;
  }
  EXPECT_EQ(parameter_count(s), total);
  EXPECT_EQ(parameter_count(s), formula(s));

  ModelShape tied = s;
  tied.tied_embeddings = true;
  EXPECT_EQ(parameter_list(tied).back().name, "final_norm");
}

TEST(ModelShapes, RejectsBadShapes) {
  ModelShape s = shape_188m(false);
  s.kv_heads = 3;
  EXPECT_TRUE(
      test::ThrowsNaming([&] { parameter_count(s); }, {"kv_heads is 3", "divisor of q_heads (8)"}));
  s.kv_heads = 8;
  s.ffn_hidden = 0;
  EXPECT_TRUE(test::ThrowsNaming([&] { validate(s); }, {"ffn_hidden is 0", "expected > 0"}));
  s.ffn_hidden = 2816;
  s.v_head_dim = 0;
  EXPECT_TRUE(test::ThrowsNaming([&] { validate(s); }, {"v_head_dim is 0", "expected > 0"}));
}

// d_qk 4, d_v 6 (4 query heads on 2 K/V heads): wqkv's rows are q's 4 x 4, k's 2 x 4 and v's
// 2 x 6 = 36, wo takes the 4 x 6 = 24 wide attention output. Counted by hand: the embedding
// 11 x 6 = 66; a layer 6 + 36 x 6 + 6 x 24 + 6 + 10 x 6 + 6 x 5 = 462, two of them; the final
// norm 6; the untied head 66: 1062 (996 tied). FLOPs a token at seq 10: 6 x the matrices (2 x
// (216 + 144 + 60 + 30) + the head's 66 = 966) = 5796, and the causal attention products, QK^T
// over d_qk and PV over d_v at 2 FLOPs a multiply-add, forward and backward (x3), half the
// square: 2 x (4 + 6) x 3 x 0.5 x 2 layers x 4 heads x 10 = 2400.
TEST(ModelShapes, OwnVHeadDimWidensVAndTheOutputProjection) {
  const ModelShape s{.vocab = 11,
                     .d_model = 6,
                     .layers = 2,
                     .q_heads = 4,
                     .kv_heads = 2,
                     .head_dim = 4,
                     .v_head_dim = 6,
                     .ffn_hidden = 5};
  EXPECT_EQ(s.qkv_width(), 36);
  EXPECT_EQ(s.attention_width(), 24);
  const std::vector<ParameterInfo> list = parameter_list(s);
  ASSERT_EQ(list.size(), 15u);
  for (const int layer : {0, 1}) {
    const ParameterInfo& wqkv = list[2 + 6 * layer];
    const ParameterInfo& wo = list[3 + 6 * layer];
    EXPECT_EQ(wqkv.name, "layers." + std::to_string(layer) + ".wqkv");
    EXPECT_EQ(wqkv.shape, (std::vector<std::int64_t>{36, 6}));
    EXPECT_EQ(wo.name, "layers." + std::to_string(layer) + ".wo");
    EXPECT_EQ(wo.shape, (std::vector<std::int64_t>{6, 24}));
  }
  EXPECT_EQ(parameter_count(s), 1062);
  EXPECT_EQ(parameter_count(s), formula(s));
  ModelShape tied = s;
  tied.tied_embeddings = true;
  EXPECT_EQ(parameter_count(tied), 996);
  EXPECT_EQ(model_flops_per_token(s, 10), 5796.0 + 2400.0);
  // d_v = d_qk gives the formula of one head dim, 6 x layers x heads x d x seq.
  ModelShape same = s;
  same.v_head_dim = 4;
  const double matrices = 2.0 * (32 * 6 + 6 * 16 + 60 + 30) + 66;  // 822
  EXPECT_EQ(model_flops_per_token(same, 10), 6.0 * matrices + 6.0 * 2 * 4 * 4 * 10);
}

// The FLOPs per token against a count made from the parameter list (every matrix's elements, the
// tied head counted once more for the output product) plus the causal attention products of
// each layer at every key position of the context: QK^T and PV, forward and backward (x3), 2
// FLOPs per multiply-add, half the square.
TEST(ModelShapes, FlopsPerTokenCountsEveryProduct) {
  for (const bool tied : {false, true}) {
    const ModelShape s = shape_188m(tied);
    double matrix_elements = 0.0;
    for (const ParameterInfo& p : parameter_list(s)) {
      if (p.shape.size() == 2) matrix_elements += static_cast<double>(p.elements);
    }
    // the embedding lookup is no product; the output head is one (tied or not)
    matrix_elements -= static_cast<double>(s.vocab * s.d_model);
    if (tied) matrix_elements += static_cast<double>(s.vocab * s.d_model);
    const std::int64_t seq = 32768;
    const double attention = 2.0 /*QK^T, PV*/ * 2.0 /*FLOPs*/ * 3.0 /*fwd + bwd*/ * 0.5 /*causal*/ *
                             static_cast<double>(s.layers * s.q_heads * s.head_dim * seq);
    const double expected = 6.0 * matrix_elements + attention;
    EXPECT_NEAR(model_flops_per_token(s, seq), expected, 1e-9 * expected) << "tied " << tied;
  }
  // The 188M shape at 32k: 6 * 188M-ish matrices + 6 * 12 * 1024 * 32768.
  const double f = model_flops_per_token(shape_188m(true), 32768);
  EXPECT_GT(f, 6.0 * 180e6 + 2.4e9);
  EXPECT_LT(f, 6.0 * 200e6 + 2.5e9);
}

}  // namespace
}  // namespace ringattn::train
