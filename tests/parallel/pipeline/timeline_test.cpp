// The timeline of a replayed schedule: the SVG draws one box per compute action (an F&B pair as two halves
// inside one outline) over one idle background per rank, with a title and a legend, as balanced XML; the
// Chrome trace parses as JSON and holds one complete event per action at its replayed time.
#include "forge/parallel/pipeline/timeline.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "forge/parallel/pipeline/replay.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/report/timeline_svg.h"

namespace forge::pipeline::timeline_test {
namespace {
using report::timeline_svg;

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

int compute_actions(const Schedule& s, Op only_op, bool only) {
  int n = 0;
  for (const auto& list : s.actions)
    for (const Action& a : list)
      if (is_compute(a.op) && (!only || a.op == only_op)) ++n;
  return n;
}

// Every tag closed in order: <a><b/></a> yes, <a><b></a> no. Returns the first problem, or "".
std::string unbalanced(const std::string& xml) {
  std::vector<std::string> open;
  for (size_t at = xml.find('<'); at != std::string::npos; at = xml.find('<', at + 1)) {
    const size_t end = xml.find('>', at);
    if (end == std::string::npos) return "a tag never ends";
    const std::string tag = xml.substr(at + 1, end - at - 1);
    if (tag.empty()) return "an empty tag";
    if (tag.back() == '/') continue;
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) return "</" + name + "> closes nothing open";
      open.pop_back();
      continue;
    }
    open.push_back(tag.substr(0, tag.find(' ')));
  }
  return open.empty() ? "" : "<" + open.back() + "> is never closed";
}

struct Drawn {
  Schedule schedule;
  Replay replay;
  std::vector<TimelineSpan> spans;
  std::string svg;
};

Drawn draw(const std::string& name, int ranks, int micro_batches, double pair = -1) {
  Drawn d{make_schedule({schedule_kind(name), ranks, micro_batches, 1}), {}, {}, {}};
  Costs costs;
  costs.uniform.forward_backward = pair;
  d.replay = replay(d.schedule, costs);
  d.spans = timeline_of(d.schedule, d.replay);
  d.svg = timeline_svg(d.spans, ranks, name + " title", {.subtitle = "the costs"});
  return d;
}

TEST(PipelineTimeline, SvgDrawsOneBoxPerComputeActionOverOneBackgroundPerRank) {
  const Drawn d = draw("1f1b", 4, 8);
  EXPECT_EQ(d.spans.size(), 4u * 8 * 2);
  EXPECT_EQ(count(d.svg, "class=\"op "), compute_actions(d.schedule, Op::forward, false));
  EXPECT_EQ(count(d.svg, "class=\"op F\""), 4 * 8);
  EXPECT_EQ(count(d.svg, "class=\"op B\""), 4 * 8);
  EXPECT_EQ(count(d.svg, "class=\"idle\""), 4);
  EXPECT_EQ(count(d.svg, "class=\"background\""), 1);
  EXPECT_EQ(count(d.svg, "class=\"pair\""), 0);
  // Nothing else is a rect: the fixed ones are the background, the rows and the legend's swatches.
  EXPECT_EQ(count(d.svg, "<rect"), count(d.svg, "class=\"op ") + 4 + 1 + count(d.svg, "class=\"legend\""));
  for (int r = 0; r < 4; ++r) EXPECT_NE(d.svg.find(">rank " + std::to_string(r) + "<"), std::string::npos);
}

TEST(PipelineTimeline, SvgCarriesTitleLegendAndIsBalancedStandaloneXml) {
  for (const std::string name : {"1f1b", "zb-h1", "zbv", "dualpipe", "dualpipev"}) {
    const Drawn d = draw(name, 4, 8);
    EXPECT_EQ(d.svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u) << name;
    EXPECT_EQ(unbalanced(d.svg), "") << name;
    EXPECT_EQ(d.svg.find("<script"), std::string::npos) << name;
    EXPECT_NE(d.svg.find(">" + name + " title</text>"), std::string::npos) << name;
    EXPECT_NE(d.svg.find(">the costs</text>"), std::string::npos) << name;
    EXPECT_NE(d.svg.find(">F forward</text>"), std::string::npos) << name;
    EXPECT_NE(d.svg.find(">idle</text>"), std::string::npos) << name;
    EXPECT_GT(count(d.svg, "class=\"legend\""), 0) << name;
  }
  const Drawn zb = draw("zb-h1", 4, 8);
  EXPECT_NE(zb.svg.find(">I backward (input)</text>"), std::string::npos);
  EXPECT_NE(zb.svg.find(">W backward (weights)</text>"), std::string::npos);
  EXPECT_EQ(count(zb.svg, "class=\"op I\""), 4 * 8);
  EXPECT_EQ(count(zb.svg, "class=\"op W\""), 4 * 8);
  // Titles are escaped.
  const std::string svg = timeline_svg(zb.spans, 4, "a < b & c");
  EXPECT_NE(svg.find(">a &lt; b &amp; c</text>"), std::string::npos);
  EXPECT_EQ(unbalanced(svg), "");
}

TEST(PipelineTimeline, SvgSplitsEachOverlappedPairIntoForwardAndBackwardHalves) {
  for (const std::string name : {"dualpipe", "dualpipev"}) {
    const Drawn d = draw(name, 4, 8, 2.5);
    const int pairs = compute_actions(d.schedule, Op::forward_backward, true);
    ASSERT_GT(pairs, 0) << name;
    EXPECT_EQ(count(d.svg, "class=\"op F pair\""), pairs) << name;
    EXPECT_EQ(count(d.svg, "class=\"op B pair\""), pairs) << name;
    EXPECT_EQ(count(d.svg, "class=\"pair\""), pairs) << name;
    EXPECT_EQ(count(d.svg, "class=\"op "), compute_actions(d.schedule, Op::forward, false) + pairs) << name;
    EXPECT_NE(d.svg.find(">F&amp;B overlapped pair</text>"), std::string::npos) << name;
    // The two halves of a pair have equal widths and meet.
    const std::regex half("class=\"op ([FB]) pair\" x=\"([0-9.]+)\" y=\"[0-9.]+\" width=\"([0-9.]+)\"");
    std::vector<std::smatch> halves(std::sregex_iterator(d.svg.begin(), d.svg.end(), half),
                                    std::sregex_iterator());
    ASSERT_EQ(halves.size(), 2u * pairs) << name;
    for (size_t i = 0; i + 1 < halves.size(); i += 2) {
      EXPECT_EQ(halves[i][1], "F");
      EXPECT_EQ(halves[i + 1][1], "B");
      EXPECT_EQ(halves[i][3], halves[i + 1][3]);
      EXPECT_NEAR(std::stod(halves[i][2]) + std::stod(halves[i][3]), std::stod(halves[i + 1][2]), 0.11);
    }
  }
}

TEST(PipelineTimeline, SvgShadesTheSecondChunkDarkerInTheSameHue) {
  const Drawn d = draw("zbv", 4, 8);
  const std::regex forward_fill("class=\"op F\"[^>]* fill=\"(#[0-9a-f]{6})\"");
  std::set<std::string> fills;
  for (auto it = std::sregex_iterator(d.svg.begin(), d.svg.end(), forward_fill); it != std::sregex_iterator();
       ++it)
    fills.insert((*it)[1]);
  EXPECT_EQ(fills.size(), 2u);
  EXPECT_NE(d.svg.find("darker: later chunk"), std::string::npos);
  EXPECT_EQ(draw("1f1b", 4, 8).svg.find("darker: later chunk"), std::string::npos);
}

TEST(PipelineTimeline, ChromeTraceHasOneCompleteEventPerActionAtItsReplayedTime) {
  const Drawn d = draw("zb-h1", 4, 8);
  const std::vector<std::string> rows = {"pp rank 0", "pp rank 1", "pp rank 2", "pp rank 3"};
  const double seconds_per_unit = 1e-3;
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(d.spans, rows, seconds_per_unit));
  ASSERT_TRUE(trace.contains("traceEvents"));
  std::vector<nlohmann::json> complete;
  std::set<std::pair<int, std::string>> thread_names;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "X") complete.push_back(e);
    if (e["ph"] == "M" && e["name"] == "thread_name")
      thread_names.insert({e["tid"].get<int>(), e["args"]["name"].get<std::string>()});
  }
  EXPECT_EQ(thread_names, (std::set<std::pair<int, std::string>>{
                              {0, "pp rank 0"}, {1, "pp rank 1"}, {2, "pp rank 2"}, {3, "pp rank 3"}}));
  ASSERT_EQ(complete.size(), static_cast<size_t>(compute_actions(d.schedule, Op::forward, false)));
  size_t i = 0;
  for (size_t r = 0; r < d.schedule.actions.size(); ++r)
    for (size_t k = 0; k < d.schedule.actions[r].size(); ++k) {
      const Action& a = d.schedule.actions[r][k];
      if (!is_compute(a.op)) continue;
      const nlohmann::json& e = complete[i++];
      const Timed& t = d.replay.ranks[r].times[k];
      EXPECT_EQ(e["pid"], 0);
      EXPECT_EQ(e["tid"], r);
      EXPECT_EQ(e["name"], to_string(a, false));
      EXPECT_EQ(e["cat"], op_name(a.op));
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), t.start * 1e3);
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), (t.end - t.start) * 1e3);
      EXPECT_EQ(e["args"]["micro_batch"], a.micro_batch);
    }
}

TEST(PipelineTimeline, CommunicationSpansAreOptional) {
  const Schedule s = make_schedule({ScheduleKind::dualpipe, 4, 8, 1});
  const Replay r = replay(s);
  size_t all = 0;
  for (const auto& list : s.actions) all += list.size();
  EXPECT_EQ(timeline_of(s, r, true).size(), all);
  EXPECT_EQ(timeline_of(s, r).size(), static_cast<size_t>(compute_actions(s, Op::forward, false)));
  // The SVG leaves the sends and receives out; the trace keeps them, each with its peer.
  const std::vector<TimelineSpan> spans = timeline_of(s, r, true);
  EXPECT_EQ(timeline_svg(spans, 4, "t"), timeline_svg(timeline_of(s, r), 4, "t"));
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(spans, {"a", "b", "c", "d"}, 1));
  int sends = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && std::string(e["cat"]).rfind("send_", 0) == 0) {
      ++sends;
      EXPECT_TRUE(e["args"].contains("peer"));
    }
  EXPECT_GT(sends, 0);
}

}  // namespace
}  // namespace forge::pipeline::timeline_test
