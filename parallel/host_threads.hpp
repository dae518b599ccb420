// How many threads the CPU backend of one MPI rank uses when RINGATTN_NUM_THREADS does not say.
//
// mpirun decides where ranks may run: OpenMPI binds each of up to two ranks to one core, more
// ranks to a socket, and `--bind-to none` leaves every CPU to every rank. A rank takes the CPUs it
// may run on (its affinity mask), but no more than its equal part of the node's online CPUs, so
// that ranks whose masks overlap (unbound, or several on one socket) do not each start a thread per
// CPU and time-share the cores.
#pragma once

#include "parallel/mpi_communicator.hpp"

namespace ringattn {

// max(1, min(allowed_cpus, online_cpus / node_ranks)); each argument >= 1, or an error naming it.
int rank_threads(int allowed_cpus, int online_cpus, int node_ranks);

// Sets cpu::num_threads to rank_threads(the CPUs this process may run on, the online CPUs, the
// ranks of `comm` on this node) unless RINGATTN_NUM_THREADS is set; collective over `comm`.
void use_rank_threads(const MpiCommunicator& comm);

}  // namespace ringattn
