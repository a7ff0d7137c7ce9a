// Pipeline schedules as data. A schedule is one list of actions per pipeline rank: forward (F), backward
// (B = backward_input then backward_weight), backward_input (I), backward_weight (W), an overlapped
// forward + backward pair (DualPipe's F&B), and the sends and receives between ranks. Each compute action
// names its chunk (which of the rank's model chunks) and micro-batch. One generator per schedule builds the
// lists; the executor runs any of them, and the replay (replay.h) times them and proves they cannot
// deadlock. Every rank generates the same schedule from the same request, so nothing is exchanged.
//
// Placement: the model is cut into `stages` consecutive stages; rank r holds `chunks` of them (1F1B and
// ZB-H1: stage r; interleaved: stages c*P + r; ZB-V and DualPipeV: stage r and stage 2P-1-r, the "V";
// DualPipe: stage r for the first half of the micro-batches, which enter at rank 0, and a mirrored copy of
// stage P-1-r for the second half, which enter at rank P-1).
//
// Communication: a message is an activation (a forward output, sent down the stages) or a gradient (a
// backward_input output, sent up). Between two ranks each kind travels on its own first-in first-out
// channel, the order NCCL matches sends and receives in; the generators send right after the producing
// action and post the receive one compute action ahead of its consumer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace forge::pipeline {

// The schedules (parallel.schedule): 1f1b, interleaved, zb-h1, zbv, dualpipe, dualpipev.
enum class ScheduleKind : uint8_t { one_f_one_b, interleaved, zb_h1, zbv, dualpipe, dualpipev };
// Every kind, in the order above.
const std::vector<ScheduleKind>& schedule_kinds();
// "1f1b", "interleaved", "zb-h1", "zbv", "dualpipe", "dualpipev".
const char* schedule_name(ScheduleKind kind);
// The kind a name spells; an unknown name fails with one line listing the known ones.
ScheduleKind schedule_kind(std::string_view name);

enum class Op : uint8_t {
  forward,           // F of (chunk, micro_batch)
  backward,          // B: backward_input and backward_weight of (chunk, micro_batch) together
  backward_input,    // I: the input gradient only; its W follows later
  backward_weight,   // W: the weight gradients of an earlier I
  forward_backward,  // F of (chunk, micro_batch) overlapped with the B of (chunk_b, micro_batch_b)
  send_activation,   // the forward output of (chunk, micro_batch) to peer
  recv_activation,   // the forward input of (chunk, micro_batch) from peer
  send_gradient,     // the input gradient of (chunk, micro_batch) to peer
  recv_gradient,     // the output gradient of (chunk, micro_batch) from peer
};
const char* op_name(Op op);  // "forward", ...
bool is_compute(Op op);
bool is_send(Op op);
bool is_recv(Op op);

struct Action {
  Op op = Op::forward;
  int chunk = 0;
  int micro_batch = 0;
  int chunk_b = -1, micro_batch_b = -1;  // forward_backward: the backward half
  int peer = -1;                         // send / recv: the other pipeline rank

  bool operator==(const Action&) const = default;
};
// "F3", "B3.1" (chunk 1), "I3", "W3", "F3+B1", "sendA3>1", "recvG3<2".
std::string to_string(const Action& a, bool show_chunk);

struct Slot {
  int rank = 0, chunk = 0;
  bool operator==(const Slot&) const = default;
};

struct Placement {
  int ranks = 1;              // pipeline ranks P
  int chunks = 1;             // model chunks per rank
  int stages = 1;             // stages of one micro-batch's path
  int micro_batches = 1;      // per step
  bool mirrored = false;      // DualPipe: every rank holds two copies' chunks, one per direction
  std::vector<int> stage_of;  // [rank * chunks + chunk]: the stage that chunk computes

  int stage(int rank, int chunk) const { return stage_of[rank * chunks + chunk]; }
  // Where micro-batch m computes stage s.
  Slot locate(int micro_batch, int stage) const;
  // Whether (rank, chunk) computes micro-batch m (DualPipe: each chunk serves one direction's half).
  bool serves(int rank, int chunk, int micro_batch) const;
  // The micro-batches (rank, chunk) computes, in order.
  std::vector<int> micro_batches_of(int rank, int chunk) const;
  // The rank's chunks in increasing stage order (the order two ranks holding copies of the same stages visit
  // them in for collectives over those copies).
  std::vector<int> chunks_by_stage(int rank) const;
  bool is_first_stage(int rank, int chunk) const { return stage(rank, chunk) == 0; }
  bool is_last_stage(int rank, int chunk) const { return stage(rank, chunk) == stages - 1; }
};

struct Schedule {
  std::string name;  // schedule_name of its kind (messages and drawings)
  Placement placement;
  std::vector<std::vector<Action>> actions;  // [rank]
};

struct ScheduleRequest {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int ranks = 1;          // pp
  int micro_batches = 1;  // per step (gradient accumulation steps)
  int vpp = 1;            // interleaved: model chunks per rank
  // interleaved: steady-state forwards and backwards as overlapped pairs (pair_forward_backward in
  // generators.h; expert parallelism's overlap). The DualPipe schedules have their own pairs; the others
  // none.
  bool overlapped_pairs = false;
};

// The stages a request cuts the model into: P, P * vpp, or 2P for the V schedules.
int stage_count(const ScheduleRequest& request);
// Why make_schedule would refuse the request (one line naming the setting), or "" when it can run.
std::string schedule_refusal(const ScheduleRequest& request);
// Builds the schedule, sends and receives included. A request a schedule cannot run (P odd for DualPipe,
// too few micro-batches, ...) fails with one line naming the setting.
Schedule make_schedule(const ScheduleRequest& request);

// The decoder layers of each of `stages` stages: `counts` ("3,5,5,3": one entry per stage, each >= 1, adding
// up to `layers`), or with counts empty an even split, which needs `stages` to divide `layers`. Failures are
// one line naming parallel.pp_layers, or the stage count as `stages_from` describes it
// ("parallel.pp = 4").
std::vector<int64_t> stage_layer_counts(int64_t layers, int stages, const std::string& counts,
                                        const std::string& stages_from);
// A parallel.pp_layers value for `stages` stages that do not divide `layers` (1 <= stages <= layers): as even
// as it gets, the extra layers on the last stages ("3,3,3,4,4,...").
std::string uneven_layer_counts(int64_t layers, int stages);

// The schedule's compute actions in order, with the sends and receives the placement implies added: a send
// right after the action producing a message for another rank, each receive before the compute action
// preceding its consumer. The generators build compute-only lists and call it.
void add_communication(Schedule& schedule);

// One line per rank: "rank 0: F0 F1 I0 W0 ...". With comm, sends and receives too.
std::string format_schedule(const Schedule& schedule, bool with_comm = false);

}  // namespace forge::pipeline
