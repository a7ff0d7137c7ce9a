// forge plan: look at a parallel layout before running it. `plan schedule` builds a pipeline schedule,
// replays it under per-action costs and prints each rank's actions, busy and idle time and peak activations;
// it can draw the timeline (SVG) and write it as a Chrome trace. Later: `plan memory`, `plan search`.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/parallel/pipeline/replay.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/parallel/pipeline/timeline.h"
#include "forge/report/timeline_svg.h"

namespace forge::cli {
using namespace forge::pipeline;
namespace {

struct PlanOptions {
  std::string schedule, svg, trace, costs, costs_from;
  int pp = 0, micro_batches = 0, vpp = 1;
  bool comm = false, pairs = false;
  double latency = 0;
};

// "--costs F,I,W[,FB]": B = I + W; the overlapped pair F&B defaults to F + B (no overlap).
StageCosts parse_costs(const std::string& text) {
  StageCosts c;
  if (text.empty()) return c;
  std::vector<double> values;
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string field =
        text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(field.c_str(), &end);
    if (field.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v) || v <= 0)
      fail("--costs '{}': expected F,I,W or F,I,W,FB, positive numbers (e.g. 1,1,1 or 1,1,1,2.5)", text);
    values.push_back(v);
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  if (values.size() != 3 && values.size() != 4)
    fail("--costs '{}': expected 3 or 4 numbers F,I,W[,FB] (got {})", text, values.size());
  c.forward = values[0];
  c.backward_input = values[1];
  c.backward_weight = values[2];
  if (values.size() == 4) c.forward_backward = values[3];
  return c;
}

// "--costs-from TRACE": per-stage costs from a training run's measured pipeline timeline (log.profile_step
// writes <run_dir>/pipeline_trace.json), the median time (ms) of each kind of action per stage, for the
// schedule being planned: the trace's rank and chunk name the stage under this schedule's placement, so the
// trace must come from the same pp and placement. Returns the measured step (ms).
double costs_from_trace(const std::string& path, const Placement& p, bool needs_split, Costs& costs) {
  nlohmann::json trace;
  try {
    trace = nlohmann::json::parse(read_file(path, "pipeline trace"));
  } catch (const nlohmann::json::exception& e) {
    fail("--costs-from {}: not a JSON trace ({})", path, e.what());
  }
  if (!trace.contains("traceEvents") || !trace["traceEvents"].is_array())
    fail("--costs-from {}: no traceEvents (expected the pipeline_trace.json of a run with log.profile_step)",
         path);
  // [stage][op]: durations in ms.
  std::vector<std::map<std::string, std::vector<double>>> times(static_cast<size_t>(p.stages));
  double begin = 1e300, end = -1e300;
  int rows = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("ph", "") == "M" && e.value("name", "") == "thread_name") ++rows;
    if (e.value("ph", "") != "X") continue;
    const int rank = e.value("tid", -1), chunk = e.contains("args") ? e["args"].value("chunk", -1) : -1;
    const std::string op = e.value("cat", "");
    if (rank < 0 || rank >= p.ranks || chunk < 0 || chunk >= p.chunks)
      fail(
          "--costs-from {}: an action of rank {} chunk {}, outside this schedule's {} ranks x {} chunks: "
          "record "
          "the trace with the same --pp and schedule",
          path, rank, chunk, p.ranks, p.chunks);
    const double ts = e.value("ts", 0.0) / 1000.0, dur = e.value("dur", 0.0) / 1000.0;
    begin = std::min(begin, ts), end = std::max(end, ts + dur);
    times[static_cast<size_t>(p.stage(rank, chunk))][op].push_back(dur);
  }
  if (rows != p.ranks)
    fail("--costs-from {}: the trace has {} pipeline ranks, --pp is {}", path, rows, p.ranks);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? -1.0 : v[v.size() / 2];
  };
  costs.per_stage.assign(static_cast<size_t>(p.stages), {});
  for (int stage = 0; stage < p.stages; ++stage) {
    auto& t = times[static_cast<size_t>(stage)];
    StageCosts& c = costs.per_stage[static_cast<size_t>(stage)];
    c.forward = median(t["forward"]);
    const double input = median(t["backward_input"]), weight = median(t["backward_weight"]);
    const double backward = median(t["backward"]), pair = median(t["forward_backward"]);
    if (c.forward < 0 && pair < 0) fail("--costs-from {}: no forward of stage {} in the trace", path, stage);
    if (needs_split && (input < 0 || weight < 0))
      fail(
          "--costs-from {}: the schedule splits backwards into I and W, but the trace has no backward_input "
          "and backward_weight times of stage {}: record it with a schedule that splits them (zb-h1, zbv, "
          "dualpipe, dualpipev)",
          path, stage);
    // A stage seen only fused (B) or only split (I, W) keeps what it has: B = I + W, or I and W from B.
    c.backward_input = input >= 0 ? input : backward / 2;
    c.backward_weight = weight >= 0 ? weight : backward / 2;
    c.backward = backward >= 0 ? backward : -1;
    c.forward_backward = pair;
    if (c.forward < 0)
      c.forward = pair - (c.backward >= 0 ? c.backward : c.backward_input + c.backward_weight);
  }
  return end - begin;
}

std::string plural(int n, const char* one, const char* many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

int run_schedule(const PlanOptions& o) {
  if (o.latency < 0 || !std::isfinite(o.latency)) fail("--latency {}: expected a number >= 0", o.latency);
  if (!o.costs_from.empty() && !o.costs.empty()) fail("--costs and --costs-from: give one of them");
  Costs costs;
  costs.uniform = parse_costs(o.costs);
  costs.latency = o.latency;
  const ScheduleKind kind = schedule_kind(o.schedule);
  if (o.pairs && kind != ScheduleKind::interleaved)
    fail(
        "--pairs applies to the interleaved schedule (dualpipe and dualpipev have pairs of their own), not "
        "{}",
        o.schedule);
  const Schedule schedule = make_schedule({kind, o.pp, o.micro_batches, o.vpp, o.pairs});
  const Placement& p = schedule.placement;
  double measured_step = -1;
  if (!o.costs_from.empty()) {
    bool split = false;
    for (const auto& list : schedule.actions)
      for (const Action& a : list) split = split || a.op == Op::backward_input;
    measured_step = costs_from_trace(o.costs_from, p, split, costs);
  }
  const Replay replay = pipeline::replay(schedule, costs);

  const StageCosts& c = costs.uniform;
  const double backward = c.backward_input + c.backward_weight;
  const double pair = c.forward_backward >= 0 ? c.forward_backward : c.forward + backward;
  const std::string name =
      kind == ScheduleKind::interleaved ? fmt::format("interleaved (vpp {})", o.vpp) : o.schedule;
  const std::string cost_line =
      fmt::format("F {:g}, I {:g}, W {:g}, B {:g}, F&B {:g}{}", c.forward, c.backward_input,
                  c.backward_weight, backward, pair, c.forward_backward >= 0 ? "" : " (F + B)");

  // The files first: a path that cannot be written is then the only thing printed.
  const std::vector<TimelineSpan> spans = timeline_of(schedule, replay, /*with_comm=*/!o.trace.empty());
  if (!o.svg.empty()) {
    report::TimelineSvgStyle style;
    style.subtitle = "costs per chunk: " + cost_line;
    const std::string title = fmt::format("{}: pp {}, {}, makespan {:g}, bubble {:.1f}%", name, p.ranks,
                                          plural(p.micro_batches, "micro-batch", "micro-batches"),
                                          replay.makespan, 100 * replay.bubble_fraction());
    std::vector<TimelineSpan> compute;
    for (const TimelineSpan& s : spans)
      if (is_compute(s.op)) compute.push_back(s);
    write_file_atomically(o.svg, report::timeline_svg(compute, p.ranks, title, style), "timeline SVG");
  }
  if (!o.trace.empty()) {
    std::vector<std::string> rows;
    for (int r = 0; r < p.ranks; ++r) rows.push_back(fmt::format("pp rank {}", r));
    // One cost unit shows as one millisecond.
    write_file_atomically(o.trace, chrome_trace_json(spans, rows, 1e-3), "Chrome trace");
  }

  std::printf("schedule %s: pp %d, %s, %s (%s per rank)\n", name.c_str(), p.ranks,
              plural(p.micro_batches, "micro-batch", "micro-batches").c_str(),
              plural(p.stages, "stage", "stages").c_str(), plural(p.chunks, "chunk", "chunks").c_str());
  if (costs.per_stage.empty()) {
    std::printf("costs per chunk: %s; latency %g\n\n", cost_line.c_str(), o.latency);
  } else {
    std::printf("costs per stage (ms, medians of %s): F / I / W / B / F&B\n", o.costs_from.c_str());
    for (int s = 0; s < p.stages; ++s) {
      const StageCosts& sc = costs.per_stage[static_cast<size_t>(s)];
      const double b = sc.backward >= 0 ? sc.backward : sc.backward_input + sc.backward_weight;
      std::printf("  stage %d: %.3f / %.3f / %.3f / %.3f / %s\n", s, sc.forward, sc.backward_input,
                  sc.backward_weight, b,
                  sc.forward_backward >= 0 ? fmt::format("{:.3f}", sc.forward_backward).c_str() : "F + B");
    }
    std::printf("latency %g\n\n", o.latency);
  }
  std::fputs(format_schedule(schedule, o.comm).c_str(), stdout);

  std::printf("\n%4s %10s %10s %8s  %s\n", "rank", "busy", "idle", "bubble", "peak activations (chunks)");
  for (int r = 0; r < p.ranks; ++r)
    std::printf("%4d %10g %10g %7.1f%%  %d\n", r, replay.ranks[r].busy, replay.idle(r),
                100 * replay.idle(r) / replay.makespan, replay.ranks[r].peak_activations);
  std::printf("makespan %g, average bubble %.1f%%, max idle %g, max peak activations %d\n", replay.makespan,
              100 * replay.bubble_fraction(), replay.max_idle(), replay.max_peak_activations());
  if (measured_step >= 0)
    std::printf("the traced step took %.3f ms; replayed under its costs: %.3f ms (measured / replay %.3f)\n",
                measured_step, replay.makespan, measured_step / replay.makespan);
  if (!o.svg.empty()) std::printf("wrote %s\n", o.svg.c_str());
  if (!o.trace.empty()) std::printf("wrote %s\n", o.trace.c_str());
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<PlanOptions>();
  auto* plan = app.add_subcommand("plan",
                                  "Look at a parallel layout before running it: pipeline schedules, memory "
                                  "and step time, the best strategy");
  plan->footer(
      "Nothing here needs a GPU or MPI: each subcommand computes on this process only (docs/simulator.md).");

  auto* schedule = plan->add_subcommand(
      "schedule",
      "Build a pipeline schedule, replay it under per-action costs and print each rank's actions, idle time "
      "and peak activations");
  std::string known;
  for (ScheduleKind kind : schedule_kinds())
    known += (known.empty() ? "" : ", ") + std::string(schedule_name(kind));
  schedule->add_option("--schedule", o->schedule, "pipeline schedule: " + known)
      ->required()
      ->type_name("NAME");
  schedule->add_option("--pp", o->pp, "pipeline ranks")->required()->type_name("P");
  schedule->add_option("--microbatches", o->micro_batches, "micro-batches per step")
      ->required()
      ->type_name("M");
  schedule->add_option("--vpp", o->vpp, "model chunks per rank (interleaved only)")
      ->capture_default_str()
      ->type_name("V");
  schedule->add_flag("--comm", o->comm, "list the sends and receives among the actions too");
  schedule->add_flag("--pairs", o->pairs,
                     "interleaved: steady-state forwards and backwards as overlapped pairs (what training "
                     "runs under expert parallelism with parallel.ep_overlap)");
  schedule
      ->add_option("--costs", o->costs,
                   "times of one chunk's forward, backward-input and backward-weight, and of an "
                   "overlapped F&B pair (default 1,1,1 and F&B = F + B; B is I + W)")
      ->type_name("F,I,W[,FB]");
  schedule
      ->add_option(
          "--costs-from", o->costs_from,
          "per-stage costs (ms): the median time of each kind of action in a run's measured pipeline "
          "timeline (<run_dir>/pipeline_trace.json, written with log.profile_step); the run must "
          "have the same --pp and placement, and a schedule with I and W needs a trace that has them")
      ->type_name("TRACE");
  schedule->add_option("--latency", o->latency, "time from the end of a send to its arrival")
      ->capture_default_str()
      ->type_name("L");
  schedule->add_option("--svg", o->svg, "write the replayed timeline as an SVG picture to FILE")
      ->type_name("FILE");
  schedule
      ->add_option("--trace", o->trace,
                   "write the replayed timeline, sends and receives included, as a Chrome trace (JSON; "
                   "chrome://tracing or Perfetto) to FILE; one cost unit shows as 1 ms")
      ->type_name("FILE");
  schedule->footer(
      "Output: the action list of every rank (F forward, B backward, I backward-input, W backward-weight, "
      "F3+B1 an overlapped pair; .c the chunk when a rank holds several), then per rank its busy and idle "
      "time, the idle share of the makespan (bubble) and the most chunks holding activations at once. "
      "Example: forge plan schedule --schedule zb-h1 --pp 4 --microbatches 8 --svg zb-h1.svg");

  auto runners = std::make_shared<std::vector<std::pair<CLI::App*, std::function<int()>>>>();
  add_plan_model_subcommands(plan, *runners);
  commands.push_back({plan, [o, schedule, runners] {
                        if (*schedule) return run_schedule(*o);
                        for (const auto& [app, run] : *runners)
                          if (*app) return run();
                        fail(
                            "plan needs a subcommand: schedule, estimate, search, generate or calibrate (see "
                            "forge plan --help)");
                      }});
}

}  // namespace forge::cli
