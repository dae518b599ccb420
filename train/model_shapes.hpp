// The transformer's parameters: names, shapes and counts, derived from the model's dimensions.
// The one list that the model, the optimizer and the checkpoints walk in the same order.
//
//   tok_embedding            [vocab, d_model]
//   layers.<i>.attn_norm     [d_model]
//   layers.<i>.wqkv          [qkv_width(), d_model]                         rows: q, then k, then v
//   layers.<i>.wo            [d_model, q_heads * v_head_dim]
//   layers.<i>.mlp_norm      [d_model]
//   layers.<i>.w_gate_up     [2 * ffn_hidden, d_model]                      rows: gate, then up
//   layers.<i>.w_down        [d_model, ffn_hidden]
//   final_norm               [d_model]
//   lm_head                  [vocab, d_model]      absent when tied to tok_embedding
//
// Matrices are in the nn.Linear layout [out_features, in_features].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ringattn::train {

struct ModelShape {
  std::int64_t vocab = 0;
  std::int64_t d_model = 0;
  std::int64_t layers = 0;
  std::int64_t q_heads = 0;
  std::int64_t kv_heads = 0;  // divides q_heads (GQA; = q_heads for plain multi-head attention)
  std::int64_t head_dim = 0;  // q's and k's (d_qk)
  std::int64_t v_head_dim = 0;  // v's and the attention output's (d_v)
  std::int64_t ffn_hidden = 0;
  bool tied_embeddings = false;  // the output head reuses tok_embedding

  // A packed QKV row: q_heads and kv_heads of head_dim (q, k), then kv_heads of v_head_dim (v).
  std::int64_t qkv_width() const { return (q_heads + kv_heads) * head_dim + kv_heads * v_head_dim; }
  // A token's attention output, the input of wo.
  std::int64_t attention_width() const { return q_heads * v_head_dim; }
};

struct ParameterInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t elements = 0;
  bool weight_decay = false;  // matrices other than the embedding; not norms' gains
};

// Throws ringattn::Error naming the field when a dimension is not positive or kv_heads does not
// divide q_heads.
void validate(const ModelShape& shape);

// Every parameter tensor, in the order above.
std::vector<ParameterInfo> parameter_list(const ModelShape& shape);

// The number of scalar parameters (the sum of parameter_list's elements).
std::int64_t parameter_count(const ModelShape& shape);

// The FLOPs of one training step (forward and backward) per token at context length seq_len, the
// convention of MFU figures (PaLM's, with the causal mask halving attention):
//
//   6 * (matrix parameters, the output head counted once even when tied: the embedding lookup is
//        not a product)  +  3 * layers * q_heads * (head_dim + v_head_dim) * seq_len
//
// The attention term is 6 * L * H * (d_qk + d_v) * S for the full square (QK^T over d_qk and PV
// over d_v, 2 FLOPs a multiply-add, forward, twice that backward) halved by the causal mask: with
// d_v = d_qk = d, 6 * L * H * d * S.
double model_flops_per_token(const ModelShape& shape, std::int64_t seq_len);

}  // namespace ringattn::train
