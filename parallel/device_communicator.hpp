// The NCCL communicator for the C API, made either over the ranks of an MPI communicator (each rank
// on the GPU of its node-local rank) or, without MPI, from an NCCL unique id that the caller
// hands to every rank (each rank on the CUDA device current when it is made). A library built
// without CUDA throws Error (unsupported) (parallel/cuda_unavailable.cpp).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>

#include "parallel/communicator.hpp"

namespace ringattn {

std::shared_ptr<Communicator> nccl_communicator_over(MPI_Comm comm);

// The bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
inline constexpr std::size_t kNcclUniqueIdBytes = 128;
// Writes a new NCCL unique id to id[0, kNcclUniqueIdBytes).
void nccl_unique_id_bytes(unsigned char* id);
// Collective over the `size` ranks that pass the same id bytes; this rank is `rank`. No MPI call
// is made (see NcclCommunicator).
std::shared_ptr<Communicator> nccl_communicator_from_id(const unsigned char* id, int rank, int size);

}  // namespace ringattn
