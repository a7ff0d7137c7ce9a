// Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward is split into I (the
// input gradient, on the critical path) and W (the weight gradients, free to move), and W fills the time a
// rank would otherwise wait.
//
// Both keep a fixed order of F and I per rank: ZB-H1 1F1B's, ZB-V the V phases of DualPipeV with its
// overlapped pairs run one after the other. The W are then placed by a list scheduler run under unit costs
// (F = I = W = 1, the paper's assumption for its handcrafted schedules): a free rank runs its next F or I
// when its input is there (an F only while fewer than `cap` chunks hold activations), else its oldest
// deferred W, else waits for the next action to end anywhere.
#include <deque>
#include <map>
#include <queue>
#include <set>
#include <tuple>

#include "forge/core/error.h"
#include "forge/parallel/pipeline/generators.h"

namespace forge::pipeline {
namespace {

struct RankState {
  size_t next = 0;  // the next F or I of the fixed order
  std::deque<std::pair<int, int>> pending_w;
  int in_flight = 0;  // chunks holding activations: F done, W not yet
  double free_at = 0;
  bool waiting = false;
};

// order: each rank's F and I (as backward_input); the W are added to s.actions.
void place_weight_gradients(Schedule& s, int cap, std::vector<std::vector<Action>> order) {
  const Placement& p = s.placement;
  const double cost = 1;
  std::vector<RankState> ranks(p.ranks);
  std::map<std::tuple<int, int, int>, double> forward_end, input_end;  // (rank, chunk, micro-batch)
  auto ended_by = [](const std::map<std::tuple<int, int, int>, double>& ends, Slot slot, int m, double t) {
    auto it = ends.find({slot.rank, slot.chunk, m});
    return it != ends.end() && it->second <= t;
  };
  auto ready = [&](int r, const Action& a, double t) {
    const int stage = p.stage(r, a.chunk);
    if (a.op == Op::forward)
      return stage == 0 || ended_by(forward_end, p.locate(a.micro_batch, stage - 1), a.micro_batch, t);
    if (!ended_by(forward_end, {r, a.chunk}, a.micro_batch, t)) return false;
    return stage == p.stages - 1 || ended_by(input_end, p.locate(a.micro_batch, stage + 1), a.micro_batch, t);
  };

  std::set<double> ends;                 // when the actions scheduled so far end
  using Event = std::pair<double, int>;  // (time, rank): the rank is free at that time
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  for (int r = 0; r < p.ranks; ++r) events.push({0.0, r});
  size_t left = 0;
  for (const auto& list : order) left += list.size() + list.size() / 2;  // every I brings a W
  s.actions.assign(p.ranks, {});
  while (left > 0) {
    FORGE_CHECK(!events.empty(), "schedule {}: placing the W stalled with {} actions left", s.name, left);
    const auto [t, r] = events.top();
    events.pop();
    RankState& st = ranks[r];
    if (t < st.free_at || (st.next == order[r].size() && st.pending_w.empty())) continue;
    st.waiting = false;
    Action a;
    const bool has_next = st.next < order[r].size();
    if (has_next && order[r][st.next].op == Op::forward && st.in_flight >= cap && st.pending_w.empty() &&
        st.next + 1 < order[r].size() && order[r][st.next + 1].op == Op::backward_input)
      std::swap(order[r][st.next], order[r][st.next + 1]);  // no W can free a place: the I goes first
    if (has_next && ready(r, order[r][st.next], t) &&
        (order[r][st.next].op != Op::forward || st.in_flight < cap)) {
      a = order[r][st.next++];
      if (a.op == Op::forward) {
        forward_end[{r, a.chunk, a.micro_batch}] = t + cost;
        ++st.in_flight;
      } else {
        input_end[{r, a.chunk, a.micro_batch}] = t + cost;
        st.pending_w.push_back({a.chunk, a.micro_batch});
      }
    } else if (!st.pending_w.empty()) {
      a = {Op::backward_weight, st.pending_w.front().first, st.pending_w.front().second};
      st.pending_w.pop_front();
      --st.in_flight;
    } else {
      // Wait for the next action to end anywhere: one already running, or one scheduled later.
      st.waiting = true;
      if (auto next_end = ends.upper_bound(t); next_end != ends.end()) events.push({*next_end, r});
      continue;
    }
    s.actions[r].push_back(a);
    --left;
    st.free_at = t + cost;
    ends.insert(st.free_at);
    events.push({st.free_at, r});
    for (int q = 0; q < p.ranks; ++q)
      if (ranks[q].waiting) events.push({st.free_at, q});
  }
}

}  // namespace

Schedule generate_zb_h1(int ranks, int micro_batches) {
  Schedule s = generate_1f1b(ranks, micro_batches);
  s.name = "zb-h1";
  std::vector<std::vector<Action>> order = s.actions;
  for (auto& list : order)
    for (Action& a : list)
      if (a.op == Op::backward) a.op = Op::backward_input;
  place_weight_gradients(s, ranks, std::move(order));  // 1F1B's peak: P micro-batches on rank 0
  return s;
}

Schedule generate_zbv(int ranks, int micro_batches) {
  Schedule s = generate_dualpipe(ranks, micro_batches, true);
  s.name = "zbv";
  std::vector<std::vector<Action>> order(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (const Action& a : s.actions[r]) {
      if (a.op == Op::forward) order[r].push_back(a);
      if (a.op == Op::backward || a.op == Op::backward_input)
        order[r].push_back({Op::backward_input, a.chunk, a.micro_batch});
      if (a.op == Op::forward_backward) {
        order[r].push_back({Op::forward, a.chunk, a.micro_batch});
        order[r].push_back({Op::backward_input, a.chunk_b, a.micro_batch_b});
      }
    }
  }
  // Chunks are half stages: 2P is 1F1B's peak of P stages; the V phases hold one chunk more at their turn.
  place_weight_gradients(s, 2 * ranks + 1, std::move(order));
  return s;
}

}  // namespace forge::pipeline
