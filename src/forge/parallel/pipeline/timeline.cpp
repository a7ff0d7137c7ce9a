#include "forge/parallel/pipeline/timeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "forge/core/error.h"
#include "forge/core/xml.h"

namespace forge::pipeline {

std::vector<TimelineSpan> timeline_of(const Schedule& schedule, const Replay& replay, bool with_comm) {
  FORGE_CHECK(replay.ranks.size() == schedule.actions.size(), "timeline_of: a replay of {} ranks for {}",
              replay.ranks.size(), schedule.actions.size());
  std::vector<TimelineSpan> spans;
  for (size_t r = 0; r < schedule.actions.size(); ++r) {
    const std::vector<Action>& actions = schedule.actions[r];
    const std::vector<Timed>& times = replay.ranks[r].times;
    FORGE_CHECK(times.size() == actions.size(), "timeline_of: rank {} has {} times for {} actions", r,
                times.size(), actions.size());
    for (size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (!with_comm && !is_compute(a.op)) continue;
      spans.push_back({static_cast<int>(r), times[i].start, times[i].end, a.op, a.chunk, a.micro_batch,
                       a.chunk_b, a.micro_batch_b, a.peer});
    }
  }
  return spans;
}

std::string chrome_trace_json(const std::vector<TimelineSpan>& spans,
                              const std::vector<std::string>& row_names, double seconds_per_unit) {
  FORGE_CHECK(seconds_per_unit > 0, "chrome_trace_json: seconds_per_unit = {}", seconds_per_unit);
  bool show_chunk = false;
  for (const TimelineSpan& s : spans) show_chunk = show_chunk || s.chunk > 0 || s.chunk_b > 0;
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "pipeline"}}}});
  for (size_t r = 0; r < row_names.size(); ++r) {
    events.push_back(
        {{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"name", row_names[r]}}}});
    events.push_back(
        {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"sort_index", r}}}});
  }
  const double us = seconds_per_unit * 1e6;
  for (const TimelineSpan& s : spans) {
    const Action a{s.op, s.chunk, s.micro_batch, s.chunk_b, s.micro_batch_b, s.peer};
    nlohmann::ordered_json args = {{"chunk", s.chunk}, {"micro_batch", s.micro_batch}};
    if (s.op == Op::forward_backward) {
      args["chunk_b"] = s.chunk_b;
      args["micro_batch_b"] = s.micro_batch_b;
    }
    if (!is_compute(s.op)) args["peer"] = s.peer;
    events.push_back({{"name", to_string(a, show_chunk)},
                      {"cat", op_name(s.op)},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", s.row},
                      {"ts", s.start * us},
                      {"dur", (s.end - s.start) * us},
                      {"args", std::move(args)}});
  }
  nlohmann::ordered_json trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  return trace.dump() + "\n";
}

std::vector<TimelineSpan> spans_from_chrome_trace(const std::string& json, double seconds_per_unit,
                                                  int* rows) {
  FORGE_CHECK(seconds_per_unit > 0, "spans_from_chrome_trace: seconds_per_unit = {}", seconds_per_unit);
  const nlohmann::json trace = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (trace.is_discarded() || !trace.is_object() || !trace.contains("traceEvents") ||
      !trace["traceEvents"].is_array())
    fail("pipeline trace: not a Chrome trace object with a \"traceEvents\" array");
  std::vector<TimelineSpan> spans;
  int tids = 0;
  const double us = seconds_per_unit * 1e6;
  for (const nlohmann::json& e : trace["traceEvents"]) {
    if (!e.is_object() || e.value("ph", "") != "X") continue;
    const std::string cat = e.value("cat", "");
    std::optional<Op> op;
    for (Op o : {Op::forward, Op::backward, Op::backward_input, Op::backward_weight, Op::forward_backward,
                 Op::send_activation, Op::recv_activation, Op::send_gradient, Op::recv_gradient})
      if (cat == op_name(o)) op = o;
    const auto number = [&](const nlohmann::json& object, const char* key) {
      const auto it = object.find(key);
      if (it == object.end() || !it->is_number())
        fail("pipeline trace: event \"{}\" has no number \"{}\"", e.value("name", "?"), key);
      return it->get<double>();
    };
    if (!op) fail("pipeline trace: event \"{}\" has an unknown category \"{}\"", e.value("name", "?"), cat);
    TimelineSpan s;
    s.op = *op;
    s.row = static_cast<int>(number(e, "tid"));
    if (s.row < 0 || s.row > 1 << 16)
      fail("pipeline trace: event \"{}\" on row {}", e.value("name", "?"), s.row);
    s.start = number(e, "ts") / us;
    s.end = s.start + number(e, "dur") / us;
    const nlohmann::json args = e.value("args", nlohmann::json::object());
    s.chunk = static_cast<int>(number(args, "chunk"));
    s.micro_batch = static_cast<int>(number(args, "micro_batch"));
    if (s.op == Op::forward_backward) {
      s.chunk_b = static_cast<int>(number(args, "chunk_b"));
      s.micro_batch_b = static_cast<int>(number(args, "micro_batch_b"));
    }
    if (!is_compute(s.op)) s.peer = static_cast<int>(number(args, "peer"));
    tids = std::max(tids, s.row + 1);
    spans.push_back(s);
  }
  for (const nlohmann::json& e : trace["traceEvents"])
    if (e.is_object() && e.value("name", "") == "thread_name" && e.contains("tid") && e["tid"].is_number())
      tids = std::max(tids, e["tid"].get<int>() + 1);
  if (rows) *rows = tids;
  return spans;
}

}  // namespace forge::pipeline
