#include "forge/parallel/pipeline/schedule.h"

#include <fmt/format.h>

#include <algorithm>

#include "forge/core/error.h"
#include "forge/parallel/pipeline/generators.h"

namespace forge::pipeline {

const char* op_name(Op op) {
  switch (op) {
    case Op::forward:
      return "forward";
    case Op::backward:
      return "backward";
    case Op::backward_input:
      return "backward_input";
    case Op::backward_weight:
      return "backward_weight";
    case Op::forward_backward:
      return "forward_backward";
    case Op::send_activation:
      return "send_activation";
    case Op::recv_activation:
      return "recv_activation";
    case Op::send_gradient:
      return "send_gradient";
    case Op::recv_gradient:
      return "recv_gradient";
  }
  return "?";
}

bool is_compute(Op op) { return op <= Op::forward_backward; }
bool is_send(Op op) { return op == Op::send_activation || op == Op::send_gradient; }
bool is_recv(Op op) { return op == Op::recv_activation || op == Op::recv_gradient; }

std::string to_string(const Action& a, bool show_chunk) {
  auto unit = [&](char letter, int chunk, int micro_batch) {
    return show_chunk ? fmt::format("{}{}.{}", letter, micro_batch, chunk)
                      : fmt::format("{}{}", letter, micro_batch);
  };
  switch (a.op) {
    case Op::forward:
      return unit('F', a.chunk, a.micro_batch);
    case Op::backward:
      return unit('B', a.chunk, a.micro_batch);
    case Op::backward_input:
      return unit('I', a.chunk, a.micro_batch);
    case Op::backward_weight:
      return unit('W', a.chunk, a.micro_batch);
    case Op::forward_backward:
      return unit('F', a.chunk, a.micro_batch) + "+" + unit('B', a.chunk_b, a.micro_batch_b);
    case Op::send_activation:
      return "send" + unit('A', a.chunk, a.micro_batch) + fmt::format(">{}", a.peer);
    case Op::recv_activation:
      return "recv" + unit('A', a.chunk, a.micro_batch) + fmt::format("<{}", a.peer);
    case Op::send_gradient:
      return "send" + unit('G', a.chunk, a.micro_batch) + fmt::format(">{}", a.peer);
    case Op::recv_gradient:
      return "recv" + unit('G', a.chunk, a.micro_batch) + fmt::format("<{}", a.peer);
  }
  return "?";
}

Slot Placement::locate(int micro_batch, int stage) const {
  if (mirrored) {
    // Direction 0 (the first half of the micro-batches) runs stage s on rank s, chunk 0; direction 1 runs
    // it on rank P-1-s, chunk 1.
    const bool reverse = micro_batch >= micro_batches / 2;
    return reverse ? Slot{ranks - 1 - stage, 1} : Slot{stage, 0};
  }
  for (int r = 0; r < ranks; ++r)
    for (int c = 0; c < chunks; ++c)
      if (this->stage(r, c) == stage) return {r, c};
  FORGE_CHECK(false, "stage {} is on no rank", stage);
}

bool Placement::serves(int rank, int chunk, int micro_batch) const {
  return locate(micro_batch, stage(rank, chunk)) == Slot{rank, chunk};
}

std::vector<int> Placement::chunks_by_stage(int rank) const {
  std::vector<int> order(static_cast<size_t>(chunks));
  for (int c = 0; c < chunks; ++c) order[static_cast<size_t>(c)] = c;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return stage(rank, a) < stage(rank, b); });
  return order;
}

std::vector<int> Placement::micro_batches_of(int rank, int chunk) const {
  std::vector<int> out;
  for (int m = 0; m < micro_batches; ++m)
    if (serves(rank, chunk, m)) out.push_back(m);
  return out;
}

const std::vector<ScheduleKind>& schedule_kinds() {
  static const std::vector<ScheduleKind> kinds = {ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                                                  ScheduleKind::zb_h1,       ScheduleKind::zbv,
                                                  ScheduleKind::dualpipe,    ScheduleKind::dualpipev};
  return kinds;
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::one_f_one_b:
      return "1f1b";
    case ScheduleKind::interleaved:
      return "interleaved";
    case ScheduleKind::zb_h1:
      return "zb-h1";
    case ScheduleKind::zbv:
      return "zbv";
    case ScheduleKind::dualpipe:
      return "dualpipe";
    case ScheduleKind::dualpipev:
      return "dualpipev";
  }
  return "?";
}

ScheduleKind schedule_kind(std::string_view name) {
  std::vector<std::string_view> known;
  for (ScheduleKind kind : schedule_kinds()) {
    if (name == schedule_name(kind)) return kind;
    known.push_back(schedule_name(kind));
  }
  fail("unknown pipeline schedule '{}' (known: {})", name, fmt::join(known, ", "));
}

int stage_count(const ScheduleRequest& request) {
  if (request.kind == ScheduleKind::interleaved) return request.ranks * request.vpp;
  if (request.kind == ScheduleKind::zbv || request.kind == ScheduleKind::dualpipev) return 2 * request.ranks;
  return request.ranks;
}

namespace {

void check_request(const ScheduleRequest& q) {
  const char* name = schedule_name(q.kind);
  if (q.ranks < 1) fail("schedule {}: pp must be >= 1 (got {})", name, q.ranks);
  if (q.micro_batches < 1)
    fail("schedule {}: micro-batches per step must be >= 1 (got {})", name, q.micro_batches);
  if (q.vpp < 1) fail("schedule {}: vpp must be >= 1 (got {})", name, q.vpp);
  if (q.vpp != 1 && q.kind != ScheduleKind::interleaved)
    fail("schedule {}: vpp = {} is only for schedule interleaved ({} places its own chunks)", name, q.vpp,
         name);
  if (q.kind == ScheduleKind::interleaved) {
    if (q.vpp < 2)
      fail("schedule interleaved needs vpp >= 2 model chunks per rank (got {}; use 1f1b)", q.vpp);
    if (q.micro_batches % q.ranks != 0)
      fail(
          "schedule interleaved needs micro-batches per step divisible by pp = {} (got {}): they run in "
          "groups "
          "of pp per chunk",
          q.ranks, q.micro_batches);
  }
  if (q.kind == ScheduleKind::dualpipe) {
    if (q.ranks % 2 != 0)
      fail("schedule dualpipe needs an even pp (got {}); dualpipev runs on any pp", q.ranks);
    if (q.micro_batches % 2 != 0 || q.micro_batches < 2 * q.ranks)
      fail("schedule dualpipe needs an even number of micro-batches per step, at least 2 * pp = {} (got {})",
           2 * q.ranks, q.micro_batches);
  }
  if (q.kind == ScheduleKind::dualpipev && q.micro_batches < 2 * q.ranks)
    fail("schedule dualpipev needs at least 2 * pp = {} micro-batches per step (got {})", 2 * q.ranks,
         q.micro_batches);
  if (q.kind == ScheduleKind::zbv && q.micro_batches < 2 * q.ranks)
    fail("schedule zbv needs at least 2 * pp = {} micro-batches per step (got {}): its warm-up fills the V",
         2 * q.ranks, q.micro_batches);
}

}  // namespace

std::string schedule_refusal(const ScheduleRequest& request) {
  try {
    check_request(request);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

Schedule make_schedule(const ScheduleRequest& request) {
  check_request(request);
  const int ranks = request.ranks, micro_batches = request.micro_batches;
  Schedule s;
  switch (request.kind) {
    case ScheduleKind::one_f_one_b:
      s = generate_1f1b(ranks, micro_batches);
      break;
    case ScheduleKind::interleaved:
      s = generate_interleaved(ranks, request.vpp, micro_batches);
      if (request.overlapped_pairs) s = pair_forward_backward(s);
      break;
    case ScheduleKind::zb_h1:
      s = generate_zb_h1(ranks, micro_batches);
      break;
    case ScheduleKind::zbv:
      s = generate_zbv(ranks, micro_batches);
      break;
    case ScheduleKind::dualpipe:
      s = generate_dualpipe(ranks, micro_batches, false);
      break;
    case ScheduleKind::dualpipev:
      s = generate_dualpipe(ranks, micro_batches, true);
      break;
  }
  s.name = schedule_name(request.kind);
  add_communication(s);
  return s;
}

std::string uneven_layer_counts(int64_t layers, int stages) {
  std::vector<int64_t> counts(static_cast<size_t>(stages), layers / stages);
  for (int64_t i = 0; i < layers % stages; ++i) ++counts[static_cast<size_t>(stages - 1 - i)];
  return fmt::format("{}", fmt::join(counts, ","));
}

std::vector<int64_t> stage_layer_counts(int64_t layers, int stages, const std::string& counts,
                                        const std::string& stages_from) {
  std::vector<int64_t> out;
  if (counts.empty()) {
    if (stages > layers)
      fail("{} makes {} pipeline stages, more than the model's {} layers: every stage needs at least one",
           stages_from, stages, layers);
    if (layers % stages != 0)
      fail(
          "{} makes {} pipeline stages, which do not divide num_hidden_layers = {}; place them unevenly with "
          "parallel.pp_layers (e.g. \"{}\")",
          stages_from, stages, layers, uneven_layer_counts(layers, stages));
    out.assign(stages, layers / stages);
    return out;
  }
  size_t begin = 0;
  while (begin <= counts.size()) {
    const size_t end = std::min(counts.find(',', begin), counts.size());
    const std::string entry = counts.substr(begin, end - begin);
    size_t used = 0;
    int64_t n = -1;
    try {
      n = std::stoll(entry, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (entry.empty() || used != entry.size())
      fail("parallel.pp_layers = \"{}\": '{}' is not a layer count (write one count per stage: \"3,5,5,3\")",
           counts, entry);
    if (n < 1)
      fail("parallel.pp_layers = \"{}\": stage {} gets {} layers; every stage needs at least one", counts,
           out.size(), n);
    out.push_back(n);
    begin = end + 1;
  }
  if (static_cast<int>(out.size()) != stages)
    fail("parallel.pp_layers = \"{}\" has {} entries, but {} makes {} stages", counts, out.size(),
         stages_from, stages);
  int64_t total = 0;
  for (int64_t n : out) total += n;
  if (total != layers)
    fail("parallel.pp_layers = \"{}\" places {} layers, but the model has num_hidden_layers = {}", counts,
         total, layers);
  return out;
}

void add_communication(Schedule& schedule) {
  const Placement& p = schedule.placement;
  for (int r = 0; r < p.ranks; ++r) {
    const std::vector<Action>& compute = schedule.actions[r];
    // recvs_before[i]: the receives posted just before compute action i; sends_after[i]: sent right after it.
    std::vector<std::vector<Action>> recvs_before(compute.size() + 1), sends_after(compute.size());
    auto add_forward = [&](size_t i, int chunk, int micro_batch) {
      const int stage = p.stage(r, chunk);
      if (stage > 0) {
        const Slot from = p.locate(micro_batch, stage - 1);
        if (from.rank != r)
          recvs_before[i == 0 ? 0 : i - 1].push_back(
              {Op::recv_activation, chunk, micro_batch, -1, -1, from.rank});
      }
      if (stage < p.stages - 1) {
        const Slot to = p.locate(micro_batch, stage + 1);
        if (to.rank != r)
          sends_after[i].push_back({Op::send_activation, chunk, micro_batch, -1, -1, to.rank});
      }
    };
    auto add_backward = [&](size_t i, int chunk, int micro_batch) {
      const int stage = p.stage(r, chunk);
      if (stage < p.stages - 1) {
        const Slot from = p.locate(micro_batch, stage + 1);
        if (from.rank != r)
          recvs_before[i == 0 ? 0 : i - 1].push_back(
              {Op::recv_gradient, chunk, micro_batch, -1, -1, from.rank});
      }
      if (stage > 0) {
        const Slot to = p.locate(micro_batch, stage - 1);
        if (to.rank != r) sends_after[i].push_back({Op::send_gradient, chunk, micro_batch, -1, -1, to.rank});
      }
    };
    for (size_t i = 0; i < compute.size(); ++i) {
      const Action& a = compute[i];
      FORGE_CHECK(is_compute(a.op), "add_communication wants compute-only lists (rank {}: {})", r,
                  op_name(a.op));
      if (a.op == Op::forward || a.op == Op::forward_backward) add_forward(i, a.chunk, a.micro_batch);
      if (a.op == Op::backward || a.op == Op::backward_input) add_backward(i, a.chunk, a.micro_batch);
      if (a.op == Op::forward_backward) add_backward(i, a.chunk_b, a.micro_batch_b);
    }
    std::vector<Action> out;
    for (size_t i = 0; i < compute.size(); ++i) {
      out.insert(out.end(), recvs_before[i].begin(), recvs_before[i].end());
      out.push_back(compute[i]);
      out.insert(out.end(), sends_after[i].begin(), sends_after[i].end());
    }
    schedule.actions[r] = std::move(out);
  }
}

std::string format_schedule(const Schedule& schedule, bool with_comm) {
  const bool show_chunk = schedule.placement.chunks > 1;
  std::string out;
  for (size_t r = 0; r < schedule.actions.size(); ++r) {
    out += fmt::format("rank {}:", r);
    for (const Action& a : schedule.actions[r])
      if (with_comm || is_compute(a.op)) out += fmt::format(" {}", to_string(a, show_chunk));
    out += "\n";
  }
  return out;
}

}  // namespace forge::pipeline
