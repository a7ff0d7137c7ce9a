// forge report: one or more run directories as one self-contained HTML page (train/report.h).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"
#include "forge/report/report.h"

namespace forge::cli {
namespace {

struct ReportOptions {
  std::vector<std::string> runs;
  std::string output, title, baseline, svg_dir;
  int64_t max_points = 2000;
};

int run_report(const ReportOptions& o) {
  if (o.max_points < 8) fail("--max-points {}: must be at least 8", o.max_points);
  std::vector<std::filesystem::path> dirs(o.runs.begin(), o.runs.end());
  const std::filesystem::path output =
      o.output.empty() ? (dirs.size() == 1 ? dirs[0] / "report.html" : std::filesystem::path("report.html"))
                       : std::filesystem::path(o.output);
  report::Options options;
  options.title = o.title;
  options.baseline = o.baseline;
  options.max_points = static_cast<size_t>(o.max_points);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<report::RunData> runs = report::read_runs(dirs);
  report::write_report(runs, output, options);
  std::vector<std::filesystem::path> svgs;
  if (!o.svg_dir.empty()) svgs = report::write_chart_svgs(runs, o.svg_dir, options);
  int64_t lines = 0, skipped = 0;
  for (const auto& r : runs) lines += r.lines, skipped += r.skipped_count;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s (%zu run%s, %lld metrics lines, %.1f MiB, %.2f s)\n", output.c_str(), runs.size(),
              runs.size() == 1 ? "" : "s", static_cast<long long>(lines),
              static_cast<double>(std::filesystem::file_size(output)) / 1048576.0, seconds);
  for (const auto& r : runs)
    if (r.skipped_count > 0)
      std::printf("%s: skipped %lld line%s or value%s (listed in the report), e.g. %s\n", r.label.c_str(),
                  static_cast<long long>(r.skipped_count), r.skipped_count == 1 ? "" : "s",
                  r.skipped_count == 1 ? "" : "s", r.skipped.front().c_str());
  if (!svgs.empty())
    std::printf("wrote %zu charts to %s (%s, ...)\n", svgs.size(), o.svg_dir.c_str(),
                svgs[0].filename().c_str());
  return 0;
}

}  // namespace

void add_report_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<ReportOptions>();
  CLI::App* report = app.add_subcommand(
      "report",
      "Draw one or more training runs as a self-contained HTML page: loss, held-out loss, learning rate, "
      "gradient norm, throughput, MFU and memory curves, FP8 scales, MoE balance, rollbacks, the op profile, "
      "the pipeline timeline and expert-load heat maps (several runs overlay for comparison)");
  report
      ->add_option(
          "runs", o->runs,
          "run directories (each with a metrics.jsonl), or folders of them (a sweep: every sub-folder "
          "with a metrics.jsonl)")
      ->required();
  report->add_option(
      "-o,--output", o->output,
      "the HTML file to write (default: RUN_DIR/report.html for one run, report.html for several)");
  report->add_option("--title", o->title, "the page's title (default: forge report: <run names>)");
  report->add_option(
      "--baseline", o->baseline,
      "a run's name (its folder's): also draw the others' held-out and smoothed training losses in "
      "percent of its");
  report->add_option("--svg-dir", o->svg_dir,
                     "also write every curve chart as a standalone SVG file into this folder (loss.svg, "
                     "eval_loss.svg, ...), for markdown documents");
  report
      ->add_option(
          "--max-points", o->max_points,
          "points per curve at most: longer curves are downsampled keeping each bucket's first, last, "
          "smallest and largest value")
      ->capture_default_str();
  report->footer(
      "A metrics.jsonl with a half-written last line (a killed run) or values that are not numbers still "
      "renders: "
      "what is valid is drawn and the page lists what was skipped. forge train writes <run_dir>/report.html "
      "at the "
      "end of every run (log.report). See docs/report.md.");
  commands.push_back({report, [o] { return run_report(*o); }});
}

}  // namespace forge::cli
