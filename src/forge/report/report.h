// `forge report`: a training run (or several, overlaid) as one self-contained HTML page — loss, learning
// rate, gradient norm, throughput, MFU and memory curves, FP8 scales, MoE balance, rollbacks and
// checkpoints, held-out captions, the op profile, the pipeline timeline and the expert-load heat maps — drawn
// as inline SVG with no network access and no script framework (a few lines of plain script add hover values;
// the page reads the same without them; docs/report.md).
//
// Reading is forgiving: a run directory's metrics.jsonl may end in a half-written line (a killed run) or
// hold values that are not numbers; what is valid is drawn and what was skipped is listed on the page.
// Large runs stay fast and small: every curve is downsampled for drawing to at most Options::max_points
// points, keeping each bucket's first, last, smallest and largest value (so spikes survive).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace forge::report {

// One value of a curve: at `step`, after `tokens` training tokens.
struct Point {
  double step = 0, tokens = 0, value = 0;
  bool operator==(const Point&) const = default;
};

// Something that happened in a run (metrics.jsonl records with an "event" key): a rollback, an anomaly, a
// checkpoint saved or failed, a resume, the simulator's prediction.
struct Event {
  int64_t step = -1;  // -1 when the record has none
  std::string kind;   // the record's "event"
  std::string text;   // one line for the page
};

struct RunData {
  std::filesystem::path dir;
  std::string label;  // the legend's name: the directory's name, made unique among the runs of a report
  // Curves by name: "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_memory_bytes",
  // "dp_overlap", "eval_loss", "eval_bits_per_byte", and the nested fields flattened with dots:
  // "moe.max_violation", "fp8.scale.input.median", "mtp.1.loss", ... In step order; when the run went back
  // (a rollback restores an earlier step, a record repeats a step) the abandoned points are dropped.
  std::map<std::string, std::vector<Point>> series;
  std::vector<Event> events;
  // MoE layers (Hugging Face indices) and their largest load violation at each logged step: the layers x
  // steps heat map. violation[i] belongs to violation_steps[i] and has one value per layer.
  std::vector<int64_t> moe_layers;
  std::vector<int64_t> violation_steps;
  std::vector<std::vector<double>> violation;
  // The tokens routed to each expert of each MoE layer at the last step whose record has them
  // (log.expert_load_every): the layers x experts heat map. load_step = -1: none.
  int64_t load_step = -1;
  std::vector<std::vector<double>> load;         // [moe_layers][experts]
  std::optional<nlohmann::json> captions;        // the last "captions" record (sample.captions)
  std::optional<nlohmann::json> profile;         // <dir>/profile.json (log.profile_step)
  std::optional<nlohmann::json> pipeline_trace;  // <dir>/pipeline_trace.json (with pp > 1)
  std::map<std::string, std::string> settings;   // <dir>/config.toml flattened: "train.lr" -> "0.003"
  int64_t lines = 0;                             // of metrics.jsonl
  // What was not used, one line each ("metrics.jsonl line 57: \"loss\" is not a number: \"abc\""), the first
  // kMaxSkipNotes of skipped_count.
  std::vector<std::string> skipped;
  int64_t skipped_count = 0;
  static constexpr size_t kMaxSkipNotes = 20;

  const std::vector<Point>* find(const std::string& name) const {
    const auto it = series.find(name);
    return it == series.end() || it->second.empty() ? nullptr : &it->second;
  }
};

// Reads a run directory (metrics.jsonl is required; profile.json, pipeline_trace.json and config.toml are
// used when present). Throws forge::Error naming the directory when it has no readable metrics.jsonl.
RunData read_run(const std::filesystem::path& dir);

// At most max_points points (max_points >= 8), in step order: the steps split into max_points / 4 equal
// buckets and each keeps its first, last, smallest and largest point. Fewer points are returned unchanged.
std::vector<Point> downsample(const std::vector<Point>& points, size_t max_points);

struct Options {
  std::string title;          // "" = "forge report: <labels>"
  size_t max_points = 2000;   // per curve, for drawing and for the embedded data
  int64_t profile_rows = 30;  // op-profile table rows per run
  // A run's label: the other runs' held-out and smoothed training losses are also drawn in percent of its
  // ("" = none). render_html and write_chart_svgs refuse a label that is not one of the runs.
  std::string baseline;
};

// The page. Its data (every curve as drawn, the summaries, the skipped lines) is also embedded as JSON in
// <script type="application/json" id="forge-report-data">, for tools and tests.
std::string render_html(const std::vector<RunData>& runs, const Options& options = {});

// read_run of each directory, with labels made unique (two runs both named "run" become "a/run", "b/run").
// A directory without a metrics.jsonl whose sub-folders have one (a sweep) stands for those, in name order.
std::vector<RunData> read_runs(const std::vector<std::filesystem::path>& dirs);

// Every curve chart of the page as a standalone SVG file (styles inside, the runs named at the bottom), for
// markdown documents and slides: DIR/<chart>.svg (loss.svg, eval_loss.svg, ...). Returns the files written.
std::vector<std::filesystem::path> write_chart_svgs(const std::vector<RunData>& runs,
                                                    const std::filesystem::path& dir,
                                                    const Options& options = {});

// render_html written to `output` atomically.
void write_report(const std::vector<RunData>& runs, const std::filesystem::path& output,
                  const Options& options = {});

}  // namespace forge::report
