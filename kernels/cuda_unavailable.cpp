// The CUDA entry points of a library built without its CUDA backend: they exist, so that callers
// link either way, and say why they cannot run.
#include "ringattn/config.h"

#if !RINGATTN_WITH_CUDA
#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"

namespace ringattn::cuda {
namespace {
[[noreturn]] void unavailable(const char* where) {
  detail::fail_as(ErrorKind::unsupported, where, "this ringattn was built without CUDA (configure with -DRINGATTN_CUDA=ON on a "
                      "machine with the CUDA toolkit)");
}
}  // namespace

void flash_forward(const ForwardArgs&, void*) { unavailable("cuda::flash_forward"); }
void flash_backward_prepare(const TensorView&, const TensorView&, const TensorView&, void*,
                            const TensorView*) {
  unavailable("cuda::flash_backward_prepare");
}
void flash_backward(const BackwardArgs&, void*) { unavailable("cuda::flash_backward"); }
void reference_forward(const TensorView&, const TensorView&, const TensorView&, const Mask&, double,
                       const TensorView&, const TensorView&, void*) {
  unavailable("cuda::reference_forward");
}
void reference_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                        const TensorView&, const TensorView&, const Mask&, double, const TensorView&,
                        const TensorView&, const TensorView&, const TensorView&, void*) {
  unavailable("cuda::reference_backward");
}
}  // namespace ringattn::cuda
#endif
