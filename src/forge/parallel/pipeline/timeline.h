// A pipeline step as a timeline: one span per action and rank, from the replay (replay.h) or, later, from
// the executor's measured times, and two ways to look at it: an SVG picture (one row per rank, for docs and
// `forge plan schedule --svg`) and a Chrome trace (chrome://tracing, Perfetto) of the same spans.
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

struct TimelineSvgStyle {
  double width_px = 880;   // of the time axis; px_per_unit > 0 overrides it
  double px_per_unit = 0;  // horizontal scale
  double row_height = 20;  // px per rank
  std::string subtitle;    // a smaller second line under the title (e.g. the costs)
};

// A standalone SVG (no scripts or external styles, so it renders as an image in GitHub markdown): one row
// per rank with a light background where it idles, each compute span a box coloured by kind (F, B, I, W;
// later chunks darker) and labelled with its micro-batch, an overlapped F&B pair one box split into its
// forward and backward halves, a time axis and a legend. Sends and receives are not drawn.
std::string timeline_svg(const std::vector<TimelineSpan>& spans, int rows, const std::string& title,
                         const TimelineSvgStyle& style = {});

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
