// The device entry points of parallel/ (the element-wise operations, the NCCL communicator) in a
// library built without its CUDA backend: they exist, so that callers link either way, and say
// why they cannot run.
#include "ringattn/config.h"

#if !RINGATTN_WITH_CUDA
#include <memory>

#include "parallel/device_communicator.hpp"
#include "parallel/local_block.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"

namespace ringattn {
namespace {
[[noreturn]] void unavailable(const char* where, const char* what) {
  detail::fail_as(ErrorKind::unsupported, where, what,
                  " need a ringattn built with CUDA (configure with -DRINGATTN_CUDA=ON on a "
                  "machine with the CUDA toolkit)");
}
}  // namespace

namespace detail::device {
void fill(const TensorView&, double, void*) {
  unavailable("device::fill", "device tensors");
}
void copy(const TensorView&, const TensorView&, void*) {
  unavailable("device::copy", "device tensors");
}
void add(const TensorView&, const TensorView&, void*) {
  unavailable("device::add", "device tensors");
}
}  // namespace detail::device

std::shared_ptr<Communicator> nccl_world_communicator() {
  unavailable("nccl_world_communicator", "NCCL and device tensors");
}
std::shared_ptr<Communicator> nccl_communicator_over(MPI_Comm) {
  unavailable("nccl_communicator_over", "NCCL and device tensors");
}
void nccl_unique_id_bytes(unsigned char*) { unavailable("nccl_unique_id_bytes", "NCCL unique ids"); }
std::shared_ptr<Communicator> nccl_communicator_from_id(const unsigned char*, int, int) {
  unavailable("nccl_communicator_from_id", "NCCL and device tensors");
}
}  // namespace ringattn
#endif
