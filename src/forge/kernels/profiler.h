// Where a training step's time goes, op by op: while a profile is open, every op a device's table runs is
// timed (outermost ops only: an op that calls another through the table counts once) and grouped by op and
// shape, with the FLOPs and bytes each call implies, so that a step reads as "this GEMM shape ran N times at
// X TFLOP/s, that norm moved Y GB/s". On the CPU the ops are timed on the host (they are synchronous); on a
// GPU each op is bracketed by two events on the compute stream, so timing adds no synchronisation and the
// times are the device's, not the launch's. What no op accounts for (memsets, copies, collectives, the host
// keeping the device waiting) is the difference between the profile's wall time and the ops' sum.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "forge/core/tensor.h"

namespace forge::ops {

// One op and shape (detail) of a profile.
struct OpProfileRow {
  std::string op;      // the op table's member: "gemm", "rmsnorm_forward", ...
  std::string detail;  // its shape and dtypes: "bf16 NT 8192x6144x4096 -> f32"
  int64_t calls = 0;
  double seconds = 0;  // summed over calls
  double flops = 0;    // arithmetic the calls imply (GEMMs, attention, the loss head); 0 for memory-bound ops
  double bytes = 0;    // memory the calls must read and write at least once
};

struct OpProfile {
  Device device = Device::cpu;
  double wall_seconds = 0;         // from profile_begin to profile_end, the device drained at both ends
  double op_seconds = 0;           // the rows' sum
  std::vector<OpProfileRow> rows;  // by seconds, largest first
};

// Opens a profile of `device`'s ops (drains the device first). One profile at a time per process: opening a
// second fails with one line. Ops on other devices run untimed.
void profile_begin(Device device);
// Closes it: drains the device, reads the timings and returns them. Fails with one line when none is open.
OpProfile profile_end();
bool profiling();
// The open profile's rows so far, in the order they first ran: calls, FLOPs and bytes, no times (empty when
// none is open). Two of them taken around some work tell what ops it ran (the simulator's overlap windows).
std::vector<OpProfileRow> profile_counts();

// The profile as a table: rows whose share of the wall time is at least min_share (the rest summed in one
// line), then the ops' sum and the unattributed time. `steps` divides every time (per-step figures).
std::string format_profile(const OpProfile& profile, int steps = 1, double min_share = 0.002);
// The profile as a JSON object (times per step, as format_profile).
std::string profile_json(const OpProfile& profile, int steps = 1);

// The profiled table of `device` while a profile of it is open, else null (used by ops::table).
const struct OpTable* profiled_table(Device device);

}  // namespace forge::ops
