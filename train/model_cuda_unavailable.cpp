// make_cuda_model in a ringattn built without its CUDA backend: it exists, so that the trainer
// links either way, and says why it cannot run.
#include "ringattn/config.h"

#if !RINGATTN_WITH_CUDA
#include "ringattn/error.hpp"
#include "train/model.hpp"

namespace ringattn::train {

std::unique_ptr<TrainModel> make_cuda_model(const ModelConfig&, std::int64_t, std::int64_t,
                                            std::shared_ptr<Communicator>, SequenceLayoutKind,
                                            ModelOptions, std::shared_ptr<Communicator>) {
  ringattn::detail::fail_as(ErrorKind::unsupported, "Trainer",
                            "run.backend is cuda; this ringattn was built without CUDA (set "
                            "run.backend=cpu, or configure with -DRINGATTN_CUDA=ON)");
}

double cuda_peak_bf16_flops() {
  return 0.0;
}

double cuda_device_memory_bytes() {
  return 0.0;
}

double cuda_device_memory_in_use_bytes() {
  return 0.0;
}

}  // namespace ringattn::train
#endif
