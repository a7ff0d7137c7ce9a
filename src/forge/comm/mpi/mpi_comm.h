// The MPI backend (host memory, non-blocking MPI collectives). Internal to comm: everyone else reaches it
// through comm::world() and Communicator::split().
#pragma once

#include <memory>

#include "forge/comm/comm.h"

namespace forge::comm::mpi {

// Initialises MPI (MPI_THREAD_FUNNELED) unless it already is, creates forge's MPI objects and returns the
// world communicator (a duplicate of MPI_COMM_WORLD, so forge's traffic never matches anyone else's). A
// watchdog ends the process with one line if that has not completed within timeout_s (> 0).
std::unique_ptr<Communicator> init_world(double timeout_s);

// Meets every rank of the world in a barrier under the world's timeout (reported as "finalize"), before
// MPI_Finalize's own exit fence, which has none: a rank whose peer died or is aborting is reported instead
// of waiting there forever (and OpenMPI 4.1's mpirun can deadlock in its teardown when a rank is inside
// MPI_Finalize while another calls MPI_Abort).
void meet_before_finalize(Communicator& world);

// Frees forge's MPI objects and finalises MPI if init_world() initialised it, under a watchdog that ends the
// process with one line if that has not completed within timeout_s (> 0). Communicators still alive
// afterwards are inert (their destructors skip MPI).
void finalize(double timeout_s);

// True between init_world() and finalize().
bool running();

// MPI_Abort(MPI_COMM_WORLD, 1).
[[noreturn]] void abort_world();

}  // namespace forge::comm::mpi
