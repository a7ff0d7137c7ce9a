// The replay: times a schedule's action lists under given per-action costs, and proves they run to the end.
//
// Each rank runs its list in order. A compute action starts when the rank is free and its inputs are there:
// a forward needs the previous stage's output (received, or computed earlier on this rank), a backward its
// own forward and the next stage's gradient (or, on the last stage, only its forward: the loss), a W its I.
// Sends and receives are non-blocking: a send takes `send` seconds of the rank and its message arrives
// `latency` later; a receive is posted at once and its message matched first in, first out per
// (sender, receiver, kind), which is what NCCL does. A rank whose next action needs a message nobody will
// send, or one that comes later in some list that is itself stuck, is a deadlock: the replay reports every
// stuck rank and what it waits for. Finally it checks that every micro-batch ran every stage's F once and
// its B once (or I and W once each), and that no message was left unmatched.
//
// Activations: a chunk of a micro-batch holds its activations from the start of its F to the end of its B
// (or of its W); the peak per rank counts such chunks, the quantity DualPipe's "P + 1" bound is about.
#pragma once

#include <string>
#include <vector>

#include "forge/parallel/pipeline/schedule.h"

namespace forge::pipeline {

// Seconds (or any unit) per action of one chunk; `backward` and `forward_backward` < 0 mean "the sum of
// their parts" (I + W, and F + B: no overlap, unless Costs::pair_host_share says otherwise).
struct StageCosts {
  double forward = 1, backward_input = 1, backward_weight = 1;
  double backward = -1, forward_backward = -1;
  // Of forward and backward: the transfers on their critical path (expert all-to-alls) that an overlapped
  // F&B pair can hide under the other half's compute.
  double forward_comm = 0, backward_comm = 0;
};

// An overlapped F&B pair (expert parallelism's overlap): each half's transfers run under the other's
// compute, all but `host_share` of them (the part a host-progressed transfer takes from the compute), and
// the pair lasts at least as long as the transfers.
double overlapped_pair(double forward, double backward, double forward_comm, double backward_comm,
                       double host_share);

struct Costs {
  StageCosts uniform;                 // every stage, unless per_stage is given
  std::vector<StageCosts> per_stage;  // [stage] (measured; uneven splits)
  double send = 0;                    // time a send occupies its rank
  double latency = 0;                 // from the end of a send to the message's arrival
  // >= 0: F&B pairs overlap their halves' transfers (overlapped_pair) with this host share; < 0: F + B.
  double pair_host_share = -1;

  const StageCosts& of(int stage) const { return per_stage.empty() ? uniform : per_stage.at(stage); }
  double cost(const Action& a, const Placement& p, int rank) const;
};

struct Timed {
  double start = 0, end = 0;
};

struct RankReplay {
  double busy = 0;           // compute and send time
  double end = 0;            // when its last action ends
  int peak_activations = 0;  // chunks holding activations at once
  std::vector<Timed> times;  // [action]
};

struct Replay {
  double makespan = 0;
  std::vector<RankReplay> ranks;
  double idle(int rank) const { return makespan - ranks[rank].busy; }
  double max_idle() const;
  int max_peak_activations() const;
  // Idle over the whole step, averaged over ranks: sum(idle) / (ranks * makespan).
  double bubble_fraction() const;
};

// Replays the schedule; fails with a message naming the stuck ranks, or the first inconsistency.
Replay replay(const Schedule& schedule, const Costs& costs = {});

}  // namespace forge::pipeline
