// Run by tests/comm/comm_test.cpp under mpirun with two ranks: world rank 0 skips an all_reduce that world
// rank 1 waits on, so the communicator's timeout (FORGE_COMM_TIMEOUT, inherited by the split group) must
// end the whole job with one line naming the group, the operation and the rank. World rank 0 meanwhile
// waits in finalize with a longer timeout, so that only rank 1 reports.
#include <string>

#include "forge/comm/comm.h"

//
// With the argument "blocking" the waiting rank uses all_reduce_blocking (a blocking MPI call kept to its
// timeout by a watchdog) instead of a request. With "clean" every rank starts, joins one all_reduce and
// finalizes, a job that succeeds unless FORGE_FAULT_STALL stalls a rank at start-up or exit.
int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool blocking = mode == "blocking";
  forge::comm::Communicator& world = forge::comm::world(/*force_mpi=*/true);
  if (mode == "clean") {
    float x = 1;
    world.all_reduce(&x, 1, forge::comm::Type::f32, forge::comm::ReduceOp::sum).wait();
    const bool summed = x == static_cast<float>(world.size());
    forge::comm::finalize();
    return summed ? 0 : 1;
  }
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
