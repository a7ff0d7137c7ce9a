// A pipeline timeline (parallel/pipeline/timeline.h) drawn as a standalone SVG picture: one row per rank,
// for docs, `forge plan schedule --svg` and the run report.
#pragma once

#include <string>
#include <vector>

#include "forge/parallel/pipeline/timeline.h"

namespace forge::report {

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
std::string timeline_svg(const std::vector<pipeline::TimelineSpan>& spans, int rows, const std::string& title,
                         const TimelineSvgStyle& style = {});

}  // namespace forge::report
