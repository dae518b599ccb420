// The backend switch of the local block: host tensors run the CPU block, device tensors the
// CUDA one. The C API, the ring and the tools call these.
#include "ringattn/attention.hpp"

namespace ringattn {

void flash_forward(const ForwardArgs& args, void* stream) {
  if (args.q.memory == Memory::device) return cuda::flash_forward(args, stream);
  cpu::flash_forward(args);
}

void flash_backward_prepare(const TensorView& o, const TensorView& dout, const TensorView& delta,
                            void* stream, const TensorView* dq_to_zero) {
  if (o.memory == Memory::device) {
    return cuda::flash_backward_prepare(o, dout, delta, stream, dq_to_zero);
  }
  cpu::flash_backward_prepare(o, dout, delta, dq_to_zero);
}

void flash_backward(const BackwardArgs& args, void* stream) {
  if (args.q.memory == Memory::device) return cuda::flash_backward(args, stream);
  cpu::flash_backward(args);
}

}  // namespace ringattn
