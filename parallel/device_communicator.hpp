// The NCCL communicator over the ranks of any MPI communicator, for callers that hold an MPI_Comm
// (the C API). Each rank uses the GPU of its node-local rank. A library built without CUDA
// throws Error (unsupported) (parallel/cuda_unavailable.cpp).
#pragma once

#include <mpi.h>

#include <memory>

#include "parallel/communicator.hpp"

namespace ringattn {

std::shared_ptr<Communicator> nccl_communicator_over(MPI_Comm comm);

}  // namespace ringattn
