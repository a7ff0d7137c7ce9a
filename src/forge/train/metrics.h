// Run metrics: metrics.jsonl (one JSON object per logged step, the machine-readable record every run
// writes), the one-line human log of a step, and a progress bar for long phases.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

namespace forge::train {

// Appends to <run_dir>/metrics.jsonl, one compact JSON object a line, flushed per line so a crashed or
// interrupted run keeps everything logged so far and `tail -f` works.
class MetricsWriter {
 public:
  // Creates run_dir if needed. truncate = false appends (resumed runs continue the same file).
  explicit MetricsWriter(const std::filesystem::path& run_dir, bool truncate = false);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // record must be a JSON object. NaN and infinity are written as null (JSON has no spelling for them).
  void write(const nlohmann::json& record);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

// The run's metrics.jsonl as the trainer's parts write it: opened on the first rank once the run knows
// whether it resumes (a resumed run appends); on the other ranks, and before it is opened, writing does
// nothing.
class RunRecords {
 public:
  void open(const std::filesystem::path& run_dir, bool truncate) { writer_.emplace(run_dir, truncate); }
  bool is_open() const { return writer_.has_value(); }
  void write(const nlohmann::json& record) {
    if (writer_) writer_->write(record);
  }

 private:
  std::optional<MetricsWriter> writer_;
};

struct StepLine {
  int64_t step = 0;         // 1-based count of finished steps
  int64_t total_steps = 0;  // <= 0: unknown, printed as "?"
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  double images_per_s = -1;  // image-text data; negative = none, not printed
  double flops_per_s = 0;    // achieved model FLOP/s (ModelConfig::trained_flops_per_token and _per_image)
  double mfu = -1;           // fraction of peak; negative or NaN = unknown peak, not printed
  double elapsed_s = 0;
  double eta_s = -1;  // negative or NaN = unknown
  std::string extra;  // the family's own measures ("moe maxvio 0.12 | mtp 2.31"), after mfu; "" = none
};

// "step  120/2000 | loss 1.9342 | lr 2.95e-03 | gnorm 0.412 | 15.2k tok/s | 212.3 TFLOP/s | mfu 41.2% |
//  00:03:12 eta 00:07:10" (one line). Rates below 1 TFLOP/s print as GFLOP/s.
std::string format_step_line(const StepLine& line);
std::string format_duration(
    double seconds);                     // "HH:MM:SS" (hours keep growing past 99); "--:--:--" if unknown
std::string format_count(double value);  // 950, 15.2k, 3.45M, 1.20G
std::string format_flops_rate(double flops_per_s);  // "212.3 TFLOP/s" or "45.6 GFLOP/s"

// A progress bar redrawn in place with '\r'. It draws only on a terminal (automatic mode) so logs and
// pipes are not filled with partial lines; redraws are throttled to 10 per second.
class ProgressBar {
 public:
  enum class Mode { automatic, always, never };
  // total <= 0: unknown total, shows the count only.
  ProgressBar(std::string label, int64_t total, Mode mode = Mode::automatic, std::FILE* stream = stderr);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void update(int64_t done);
  // Draws the final state and ends the line; idempotent.
  void finish();
  bool enabled() const { return enabled_; }

 private:
  void draw(int64_t done);

  std::string label_;
  int64_t total_;
  std::FILE* stream_;
  bool enabled_;
  bool finished_ = false;
  int64_t done_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace forge::train
