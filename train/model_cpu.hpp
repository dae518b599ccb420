// The model on the CPU backend (train/model.hpp, train/backend_cpu.hpp): fp32 for training, fp64
// for gradient checks.
#pragma once

#include "train/backend_cpu.hpp"
#include "train/model.hpp"

namespace ringattn::train {

template <typename T>
using CpuModel = Model<CpuBackend<T>>;

extern template class Model<CpuBackend<float>>;
extern template class Model<CpuBackend<double>>;

}  // namespace ringattn::train
