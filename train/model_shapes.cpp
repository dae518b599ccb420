#include "train/model_shapes.hpp"

#include "ringattn/error.hpp"

namespace ringattn::train {

void validate(const ModelShape& s) {
  constexpr const char* kWhere = "train::validate(ModelShape)";
  const std::pair<const char*, std::int64_t> fields[] = {
      {"vocab", s.vocab},           {"d_model", s.d_model},      {"layers", s.layers},
      {"q_heads", s.q_heads},       {"kv_heads", s.kv_heads},    {"head_dim", s.head_dim},
      {"v_head_dim", s.v_head_dim}, {"ffn_hidden", s.ffn_hidden}};
  for (const auto& [name, value] : fields) {
    if (value <= 0) ringattn::detail::fail(kWhere, name, " is ", value, "; expected > 0");
  }
  if (s.q_heads % s.kv_heads != 0) {
    ringattn::detail::fail(kWhere, "kv_heads is ", s.kv_heads, "; expected a divisor of q_heads (",
                           s.q_heads, ")");
  }
}

std::vector<ParameterInfo> parameter_list(const ModelShape& s) {
  validate(s);
  std::vector<ParameterInfo> list;
  const auto add = [&](std::string name, std::vector<std::int64_t> shape, bool decay) {
    std::int64_t elements = 1;
    for (const std::int64_t extent : shape) elements *= extent;
    list.push_back({std::move(name), std::move(shape), elements, decay});
  };
  add("tok_embedding", {s.vocab, s.d_model}, false);
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string prefix = "layers." + std::to_string(i) + ".";
    add(prefix + "attn_norm", {s.d_model}, false);
    add(prefix + "wqkv", {s.qkv_width(), s.d_model}, true);
    add(prefix + "wo", {s.d_model, s.attention_width()}, true);
    add(prefix + "mlp_norm", {s.d_model}, false);
    add(prefix + "w_gate_up", {2 * s.ffn_hidden, s.d_model}, true);
    add(prefix + "w_down", {s.d_model, s.ffn_hidden}, true);
  }
  add("final_norm", {s.d_model}, false);
  if (!s.tied_embeddings) add("lm_head", {s.vocab, s.d_model}, true);
  return list;
}

std::int64_t parameter_count(const ModelShape& s) {
  std::int64_t count = 0;
  for (const ParameterInfo& p : parameter_list(s)) count += p.elements;
  return count;
}

double model_flops_per_token(const ModelShape& s, std::int64_t seq_len) {
  const double o_width = static_cast<double>(s.attention_width());
  const double qkv = static_cast<double>(s.qkv_width());
  const double per_layer = static_cast<double>(s.d_model) * (qkv + o_width) +
                           3.0 * static_cast<double>(s.d_model) * static_cast<double>(s.ffn_hidden);
  const double matrices =
      static_cast<double>(s.layers) * per_layer + static_cast<double>(s.vocab * s.d_model);
  const double heads_widths = static_cast<double>(s.q_heads * (s.head_dim + s.v_head_dim));
  return 6.0 * matrices +
         3.0 * static_cast<double>(s.layers) * heads_widths * static_cast<double>(seq_len);
}

}  // namespace ringattn::train
