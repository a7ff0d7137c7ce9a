// A communicator that moves nothing and records what it was asked to move: the simulator runs one rank of a
// layout in one process (sim/trace.h), and every collective, send and receive that rank would issue lands
// here, with its group, size and whether the caller waits for it at once (the critical path) or later.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/kernels/profiler.h"

namespace forge::sim {

struct CommEvent {
  std::string op;     // "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", ...
  std::string group;  // the communicator's name: "tp", "dp", "ep", ...
  int group_size = 1;
  int64_t bytes = 0;  // this rank's payload: the buffer reduced, the block it sends (all_gather: its own)
  // Issued through the blocking path (Communicator::all_reduce_blocking: tensor parallelism), which MPI runs
  // faster than its non-blocking collectives (the gradient buckets'); a GPU's NCCL runs both alike.
  bool blocking = false;
  // An expert all-to-all waited for later: the ops the rank ran while it was in flight (under expert
  // parallelism's overlap, the shared experts), which can hide it. Empty: nothing ran meanwhile.
  std::vector<ops::OpProfileRow> overlapped = {};
};

// Shared by every communicator of one traced rank: the events in the order they were issued.
struct CommLog {
  std::vector<CommEvent> events;
};

// size ranks, this one `rank`. split() makes a communicator of the size the name implies: sizes maps a
// group name ("tp", "dp", ...) to its size and this rank's place in it; an unknown name fails naming it.
struct DryGroup {
  std::string name;
  int size = 1, rank = 0;
};
std::unique_ptr<comm::Communicator> make_dry_communicator(DryGroup group, std::shared_ptr<CommLog> log,
                                                          std::vector<DryGroup> splits = {});

}  // namespace forge::sim
