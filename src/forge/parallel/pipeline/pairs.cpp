// Overlapped pairs in a schedule that has none of its own (generators.h, pair_forward_backward).
#include <optional>

#include "forge/core/error.h"
#include "forge/parallel/pipeline/generators.h"
#include "forge/parallel/pipeline/replay.h"

namespace forge::pipeline {
namespace {

// A forward followed by the backward of another chunk or micro-batch (a backward needs its own forward).
bool pairable(const std::vector<Action>& list, size_t i) {
  if (i + 1 >= list.size() || list[i].op != Op::forward || list[i + 1].op != Op::backward) return false;
  return list[i].chunk != list[i + 1].chunk || list[i].micro_batch != list[i + 1].micro_batch;
}

void pair_at(std::vector<Action>& list, size_t i) {
  list[i] = {Op::forward_backward, list[i].chunk, list[i].micro_batch, list[i + 1].chunk,
             list[i + 1].micro_batch};
  list.erase(list.begin() + static_cast<std::ptrdiff_t>(i) + 1);
}

// The makespan of a compute-only schedule under unit costs with pairs that hide nothing (F&B = F + B), or
// nothing when it cannot run to the end.
std::optional<double> makespan(Schedule s) {
  add_communication(s);
  try {
    return replay(s).makespan;
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace

Schedule pair_forward_backward(const Schedule& compute_only) {
  const std::optional<double> plain = makespan(compute_only);
  FORGE_CHECK(plain, "pair_forward_backward: the unpaired schedule does not run to the end");
  auto keeps = [&](const Schedule& s) {
    const std::optional<double> t = makespan(s);
    return t && *t <= *plain;
  };
  // Every candidate at once (with enough micro-batches that is every steady-state step) ...
  Schedule all = compute_only;
  for (std::vector<Action>& list : all.actions)
    for (size_t i = list.size(); i-- > 0;)
      if (pairable(list, i)) pair_at(list, i);
  if (keeps(all)) return all;
  // ... else one at a time in rank and list order, each kept only if the step still runs to the end and
  // takes no longer (a pair waits for both of its inputs, which can hold up the ranks that feed it).
  Schedule s = compute_only;
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      if (!pairable(s.actions[r], i)) continue;
      Schedule t = s;
      pair_at(t.actions[r], i);
      if (keeps(t)) s = std::move(t);
    }
  return s;
}

}  // namespace forge::pipeline
