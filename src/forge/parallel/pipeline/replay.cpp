#include "forge/parallel/pipeline/replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "forge/core/error.h"

namespace forge::pipeline {

double overlapped_pair(double forward, double backward, double forward_comm, double backward_comm,
                       double host_share) {
  const double comm = forward_comm + backward_comm, compute = forward + backward - comm;
  return std::max(compute + host_share * comm, comm);
}

double Costs::cost(const Action& a, const Placement& p, int rank) const {
  const StageCosts& c = of(p.stage(rank, a.chunk));
  const double backward = c.backward >= 0 ? c.backward : c.backward_input + c.backward_weight;
  switch (a.op) {
    case Op::forward:
      return c.forward;
    case Op::backward:
      return backward;
    case Op::backward_input:
      return c.backward_input;
    case Op::backward_weight:
      return c.backward_weight;
    case Op::forward_backward: {
      if (c.forward_backward >= 0) return c.forward_backward;
      const StageCosts& cb = of(p.stage(rank, a.chunk_b));
      const double b = cb.backward >= 0 ? cb.backward : cb.backward_input + cb.backward_weight;
      if (pair_host_share < 0) return c.forward + b;
      return overlapped_pair(c.forward, b, c.forward_comm, cb.backward_comm, pair_host_share);
    }
    case Op::send_activation:
    case Op::send_gradient:
      return send;
    case Op::recv_activation:
    case Op::recv_gradient:
      return 0;
  }
  return 0;
}

double Replay::max_idle() const {
  double m = 0;
  for (size_t r = 0; r < ranks.size(); ++r) m = std::max(m, idle(static_cast<int>(r)));
  return m;
}

int Replay::max_peak_activations() const {
  int m = 0;
  for (const RankReplay& r : ranks) m = std::max(m, r.peak_activations);
  return m;
}

double Replay::bubble_fraction() const {
  if (ranks.empty() || makespan <= 0) return 0;
  double idle_sum = 0;
  for (size_t r = 0; r < ranks.size(); ++r) idle_sum += idle(static_cast<int>(r));
  return idle_sum / (static_cast<double>(ranks.size()) * makespan);
}

namespace {

enum Kind { activation = 0, gradient = 1 };
const char* kind_name(int kind) { return kind == activation ? "activation" : "gradient"; }

struct Message {
  int stage = 0, micro_batch = 0;
  double arrival = 0;
};
struct Channel {
  std::vector<Message> sent;
  size_t posted = 0;  // receives posted so far
};
using ChannelKey = std::tuple<int, int, int>;  // (from, to, kind)
using Unit = std::pair<int, int>;              // (chunk, micro-batch)

struct PostedReceive {
  ChannelKey channel;
  size_t index = 0;
  double posted_at = 0;
  bool used = false;
};

struct RankRun {
  size_t next = 0;
  double free_at = 0;
  int live_activations = 0;
  std::map<Unit, double> forward_end, input_end;  // input_end: the end of its B or I
  std::map<Unit, bool> input_split;               // true: an I (its W still due)
  std::map<Unit, bool> weight_done;
  std::map<std::pair<int, Unit>, PostedReceive> receives;  // (kind, unit)
};

class Replayer {
 public:
  Replayer(const Schedule& s, const Costs& costs) : s_(s), p_(s.placement), costs_(costs), runs_(p_.ranks) {
    FORGE_CHECK(static_cast<int>(s.actions.size()) == p_.ranks, "schedule has {} lists for {} ranks",
                s.actions.size(), p_.ranks);
    out_.ranks.resize(p_.ranks);
    for (int r = 0; r < p_.ranks; ++r) out_.ranks[r].times.resize(s.actions[r].size());
  }

  Replay run() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < p_.ranks; ++r)
        while (runs_[r].next < s_.actions[r].size() && step(r)) progress = true;
    }
    report_stuck();
    check_complete();
    for (int r = 0; r < p_.ranks; ++r) {
      out_.ranks[r].end = runs_[r].free_at;
      out_.makespan = std::max(out_.makespan, runs_[r].free_at);
    }
    return out_;
  }

 private:
  std::string where(int r, const Action& a) const {
    return fmt::format("schedule {}: rank {}, action {} ({})", s_.name, r, runs_[r].next,
                       to_string(a, p_.chunks > 1));
  }

  // The time the input of kind `kind` for `unit` on rank r is there, or < 0 while its message is unsent.
  double input_time(int r, const Action& a, int kind, Unit unit) {
    RankRun& run = runs_[r];
    const int stage = p_.stage(r, unit.first);
    const int neighbour = kind == activation ? stage - 1 : stage + 1;
    const Slot from = p_.locate(unit.second, neighbour);
    if (from.rank == r) {
      const auto& ends = kind == activation ? run.forward_end : run.input_end;
      auto it = ends.find({from.chunk, unit.second});
      if (it == ends.end())
        fail("{} needs the {} of micro-batch {} from its own chunk {}, which has not run before it",
             where(r, a), kind_name(kind), unit.second, from.chunk);
      return it->second;
    }
    auto it = run.receives.find({kind, unit});
    if (it == run.receives.end())
      fail("{} needs the {} of micro-batch {} from rank {}, but no receive for it was posted before",
           where(r, a), kind_name(kind), unit.second, from.rank);
    PostedReceive& recv = it->second;
    const Channel& ch = channels_[recv.channel];
    if (recv.index >= ch.sent.size()) {
      waiting_for_ =
          fmt::format("the {} of micro-batch {} from rank {}", kind_name(kind), unit.second, from.rank);
      return -1;
    }
    const Message& msg = ch.sent[recv.index];
    if (msg.stage != neighbour || msg.micro_batch != unit.second)
      fail(
          "{}: receive #{} of {}s from rank {} expects micro-batch {} of stage {}, but rank {} sent "
          "micro-batch {} "
          "of stage {} in that place (sends and receives between two ranks must come in the same order)",
          where(r, a), recv.index, kind_name(kind), from.rank, unit.second, neighbour, from.rank,
          msg.micro_batch, msg.stage);
    recv.used = true;
    return std::max(recv.posted_at, msg.arrival);
  }

  // Checks the forward of unit may run now and returns the time its input is there (< 0: not yet).
  double forward_ready(int r, const Action& a, Unit unit) {
    if (runs_[r].forward_end.count(unit))
      fail("{} runs the forward of micro-batch {} twice", where(r, a), unit.second);
    if (!p_.serves(r, unit.first, unit.second))
      fail("{}: chunk {} does not compute micro-batch {}", where(r, a), unit.first, unit.second);
    if (p_.stage(r, unit.first) == 0) return 0;
    return input_time(r, a, activation, unit);
  }
  double backward_ready(int r, const Action& a, Unit unit) {
    RankRun& run = runs_[r];
    auto f = run.forward_end.find(unit);
    if (f == run.forward_end.end()) fail("{} runs a backward before its forward", where(r, a));
    if (run.input_end.count(unit))
      fail("{} runs the backward of micro-batch {} twice", where(r, a), unit.second);
    if (p_.stage(r, unit.first) == p_.stages - 1) return f->second;
    const double t = input_time(r, a, gradient, unit);
    return t < 0 ? t : std::max(t, f->second);
  }

  void send(int r, const Action& a, int kind, double at) {
    const Unit unit{a.chunk, a.micro_batch};
    RankRun& run = runs_[r];
    const auto& ends = kind == activation ? run.forward_end : run.input_end;
    if (!ends.count(unit)) fail("{} sends a result it has not computed", where(r, a));
    const int stage = p_.stage(r, a.chunk);
    const int neighbour = kind == activation ? stage + 1 : stage - 1;
    if (neighbour < 0 || neighbour >= p_.stages || p_.locate(a.micro_batch, neighbour).rank != a.peer)
      fail("{}: rank {} does not compute the stage this {} is for", where(r, a), a.peer, kind_name(kind));
    channels_[{r, a.peer, kind}].sent.push_back({stage, a.micro_batch, at + costs_.latency});
  }

  void post(int r, const Action& a, int kind, double at) {
    const Unit unit{a.chunk, a.micro_batch};
    const int stage = p_.stage(r, a.chunk);
    const int neighbour = kind == activation ? stage - 1 : stage + 1;
    if (neighbour < 0 || neighbour >= p_.stages || p_.locate(a.micro_batch, neighbour).rank != a.peer)
      fail("{}: rank {} does not send this {}", where(r, a), a.peer, kind_name(kind));
    Channel& ch = channels_[{a.peer, r, kind}];
    auto [it, fresh] = runs_[r].receives.insert({{kind, unit}, {{a.peer, r, kind}, ch.posted, at, false}});
    if (!fresh) fail("{} posts the same receive twice", where(r, a));
    ++ch.posted;
  }

  void hold(int r) {
    RankRun& run = runs_[r];
    out_.ranks[r].peak_activations = std::max(out_.ranks[r].peak_activations, ++run.live_activations);
  }

  // Runs rank r's next action if it can start; false while it waits for a message.
  bool step(int r) {
    RankRun& run = runs_[r];
    const Action& a = s_.actions[r][run.next];
    const Unit unit{a.chunk, a.micro_batch};
    if (a.chunk < 0 || a.chunk >= p_.chunks) fail("{}: no chunk {}", where(r, a), a.chunk);
    double ready = 0;
    switch (a.op) {
      case Op::forward:
        ready = forward_ready(r, a, unit);
        break;
      case Op::backward:
      case Op::backward_input:
        ready = backward_ready(r, a, unit);
        break;
      case Op::backward_weight:
        if (!run.input_split.count(unit) || !run.input_split[unit])
          fail("{} runs a W without an I before it", where(r, a));
        if (run.weight_done[unit]) fail("{} runs the W of micro-batch {} twice", where(r, a), unit.second);
        ready = run.input_end[unit];
        break;
      case Op::forward_backward: {
        const Unit b{a.chunk_b, a.micro_batch_b};
        if (a.chunk_b < 0 || a.chunk_b >= p_.chunks) fail("{}: no chunk {}", where(r, a), a.chunk_b);
        const double tf = forward_ready(r, a, unit), tb = backward_ready(r, a, b);
        ready = (tf < 0 || tb < 0) ? -1 : std::max(tf, tb);
        break;
      }
      default:
        break;
    }
    if (ready < 0) return false;
    const double start = std::max(run.free_at, ready);
    const double end = start + costs_.cost(a, p_, r);
    switch (a.op) {
      case Op::forward:
        hold(r);
        run.forward_end[unit] = end;
        break;
      case Op::backward:
        run.input_end[unit] = end;
        run.input_split[unit] = false;
        --run.live_activations;
        break;
      case Op::backward_input:
        run.input_end[unit] = end;
        run.input_split[unit] = true;
        break;
      case Op::backward_weight:
        run.weight_done[unit] = true;
        --run.live_activations;
        break;
      case Op::forward_backward: {
        const Unit b{a.chunk_b, a.micro_batch_b};
        hold(r);
        run.forward_end[unit] = end;
        run.input_end[b] = end;
        run.input_split[b] = false;
        --run.live_activations;
        break;
      }
      case Op::send_activation:
        send(r, a, activation, end);
        break;
      case Op::send_gradient:
        send(r, a, gradient, end);
        break;
      case Op::recv_activation:
        post(r, a, activation, start);
        break;
      case Op::recv_gradient:
        post(r, a, gradient, start);
        break;
    }
    out_.ranks[r].times[run.next] = {start, end};
    out_.ranks[r].busy += end - start;
    run.free_at = end;
    ++run.next;
    return true;
  }

  void report_stuck() {
    std::vector<std::string> stuck;
    for (int r = 0; r < p_.ranks; ++r) {
      RankRun& run = runs_[r];
      if (run.next >= s_.actions[r].size()) continue;
      waiting_for_.clear();
      step(r);  // fails on an inconsistency; otherwise sets waiting_for_
      stuck.push_back(fmt::format("rank {} at action {} ({}) waits for {}", r, run.next,
                                  to_string(s_.actions[r][run.next], p_.chunks > 1), waiting_for_));
    }
    if (!stuck.empty()) fail("schedule {} deadlocks: {}", s_.name, fmt::join(stuck, "; "));
  }

  void check_complete() {
    for (int r = 0; r < p_.ranks; ++r) {
      const RankRun& run = runs_[r];
      for (int c = 0; c < p_.chunks; ++c) {
        for (int m : p_.micro_batches_of(r, c)) {
          const Unit u{c, m};
          if (!run.forward_end.count(u))
            fail("schedule {}: rank {} never runs the forward of micro-batch {} on chunk {}", s_.name, r, m,
                 c);
          if (!run.input_end.count(u))
            fail("schedule {}: rank {} never runs the backward of micro-batch {} on chunk {}", s_.name, r, m,
                 c);
          if (run.input_split.at(u) && !run.weight_done.count(u))
            fail("schedule {}: rank {} never runs the W of micro-batch {} on chunk {}", s_.name, r, m, c);
        }
      }
      for (const auto& [key, recv] : run.receives)
        if (!recv.used)
          fail("schedule {}: rank {} receives the {} of micro-batch {} for chunk {} but never uses it",
               s_.name, r, kind_name(key.first), key.second.second, key.second.first);
    }
    for (const auto& [key, ch] : channels_)
      if (ch.sent.size() != ch.posted)
        fail("schedule {}: rank {} sends {} {}s to rank {}, which posts {} receives", s_.name,
             std::get<0>(key), ch.sent.size(), kind_name(std::get<2>(key)), std::get<1>(key), ch.posted);
  }

  const Schedule& s_;
  const Placement& p_;
  const Costs& costs_;
  std::vector<RankRun> runs_;
  std::map<ChannelKey, Channel> channels_;
  std::string waiting_for_;
  Replay out_;
};

}  // namespace

Replay replay(const Schedule& schedule, const Costs& costs) { return Replayer(schedule, costs).run(); }

}  // namespace forge::pipeline
