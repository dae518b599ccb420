#include "train/model_cpu.hpp"

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
  s.ffn_hidden = c.ffn_hidden;
  s.tied_embeddings = c.tied_embeddings;
  return s;
}

template class Model<CpuBackend<float>>;
template class Model<CpuBackend<double>>;
static_assert(sizeof(CpuBackend<float>::Act) == kCpuModelElements.act &&
              sizeof(CpuBackend<float>::Acc) == kCpuModelElements.acc &&
              sizeof(CpuBackend<float>::Master) == kCpuModelElements.master);

}  // namespace ringattn::train
