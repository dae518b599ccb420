#include "train/model_cpu.hpp"

#include <algorithm>
#include <cmath>

#include "parallel/ring_attention.hpp"

#include "train/model_impl.hpp"

namespace ringattn::train {

ModelShape model_shape(const ModelConfig& c) {
  ModelShape s;
  s.vocab = c.vocab_size;
  s.d_model = c.d_model;
  s.layers = c.n_layers;
  s.q_heads = c.n_heads;
  s.kv_heads = c.n_kv_heads;
  s.head_dim = c.resolved_head_dim();
  s.v_head_dim = c.resolved_v_head_dim();
  s.ffn_hidden = c.ffn_hidden;
  s.tied_embeddings = c.tied_embeddings;
  return s;
}

double mlp_arena_elements(const ModelShape& s, double batch, double local_len, double chunk,
                          int ranks, DType act_dtype) {
  const double act_bytes = static_cast<double>(dtype_size(act_dtype));
  const double boundary = 256.0 / act_bytes;  // elements: every Act size divides 256
  const auto stretch = [&](double elements) { return std::ceil(elements / boundary) * boundary; };
  const double d = static_cast<double>(s.d_model), f = static_cast<double>(s.ffn_hidden);
  const double hidden = stretch(chunk * d) + 2.0 * stretch(chunk * 2.0 * f) +
                        2.0 * stretch(chunk * f);
  RingWorkspaceShape ring;
  ring.ranks = ranks;
  ring.batch = static_cast<std::int64_t>(batch);
  ring.local_len = static_cast<std::int64_t>(local_len);
  ring.q_heads = s.q_heads;
  ring.kv_heads = s.kv_heads;
  ring.head_dim = s.head_dim;
  ring.v_head_dim = s.v_head_dim;
  ring.dtype = act_dtype;
  return std::max(hidden, std::ceil(ring_workspace_bytes(ring) / act_bytes));
}

template class Model<CpuBackend<float>>;
template class Model<CpuBackend<double>>;
static_assert(sizeof(CpuBackend<float>::Act) == kCpuModelElements.act &&
              sizeof(CpuBackend<float>::Acc) == kCpuModelElements.acc &&
              sizeof(CpuBackend<float>::Master) == kCpuModelElements.master);

}  // namespace ringattn::train
