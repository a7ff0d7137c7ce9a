// Run by tests/comm/comm_test.cpp under mpirun with two ranks: world rank 0 skips an all_reduce that world
// rank 1 waits on, so the communicator's timeout (FORGE_COMM_TIMEOUT, inherited by the split group) must
// end the whole job with one line naming the group, the operation and the rank. World rank 0 meanwhile
// waits in finalize with a longer timeout, so that only rank 1 reports.
#include <string>

#include "forge/comm/comm.h"

// With the argument "blocking" the waiting rank uses all_reduce_blocking (a blocking MPI call kept to its
// timeout by a watchdog) instead of a request.
int main(int argc, char** argv) {
  const bool blocking = argc > 1 && std::string(argv[1]) == "blocking";
  forge::comm::Communicator& world = forge::comm::world(/*force_mpi=*/true);
  // key = -rank reverses the order: world rank 1 is rank 0 of 'pair'.
  std::unique_ptr<forge::comm::Communicator> pair = world.split(0, -world.rank(), "pair");
  if (world.rank() == 1) {
    float x = 1;
    if (blocking)
      pair->all_reduce_blocking(&x, 1, forge::comm::Type::f32, forge::comm::ReduceOp::sum);
    else
      pair->all_reduce(&x, 1, forge::comm::Type::f32, forge::comm::ReduceOp::sum).wait();
  }
  world.set_timeout_seconds(60);
  forge::comm::finalize();  // world rank 0 waits here for a peer that will never come
  return 0;
}
