// A pipeline step as a timeline: one span per action and rank, from the replay (replay.h) or from the
// executor's measured times, and a Chrome trace (chrome://tracing, Perfetto) of the same spans. The SVG
// picture of a timeline is drawn by the report layer (report/timeline_svg.h).
#pragma once

#include <string>
#include <vector>

#include "forge/parallel/pipeline/replay.h"
#include "forge/parallel/pipeline/schedule.h"

namespace forge::pipeline {

struct TimelineSpan {
  int row = 0;  // pipeline rank
  double start = 0, end = 0;
  Op op = Op::forward;
  int chunk = 0, micro_batch = 0;
  int chunk_b = -1, micro_batch_b = -1;  // forward_backward: the backward half
  int peer = -1;                         // send / recv: the other rank
};

// The schedule's actions at their replayed times, rank by rank in list order: the compute actions, and
// with with_comm the sends and receives too.
std::vector<TimelineSpan> timeline_of(const Schedule& schedule, const Replay& replay, bool with_comm = false);

// The Chrome trace event format: {"traceEvents": [...]} with one complete event ("ph": "X", ts and dur in
// microseconds) per span on pid 0, tid = row, and thread_name metadata naming each row. Spans are in
// units of seconds_per_unit seconds (1 for measured seconds).
std::string chrome_trace_json(const std::vector<TimelineSpan>& spans,
                              const std::vector<std::string>& row_names, double seconds_per_unit);

// The inverse of chrome_trace_json: the spans of a trace it wrote (times in seconds_per_unit units) and the
// number of rows (the largest tid + 1). Throws forge::Error naming the first event it cannot read.
std::vector<TimelineSpan> spans_from_chrome_trace(const std::string& json, double seconds_per_unit,
                                                  int* rows);

}  // namespace forge::pipeline
