#include "forge/train/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"

namespace forge::train {

MetricsWriter::MetricsWriter(const std::filesystem::path& run_dir, bool truncate)
    : path_(run_dir / "metrics.jsonl") {
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) fail("{}: cannot create run directory: {}", run_dir.string(), ec.message());
  // A run killed mid-line leaves a partial record; start the next one on a fresh line so every complete
  // line stays parseable.
  bool needs_newline = false;
  if (!truncate && std::filesystem::file_size(path_, ec) > 0 && !ec) {
    if (std::FILE* existing = std::fopen(path_.c_str(), "rb")) {
      std::fseek(existing, -1, SEEK_END);
      needs_newline = std::fgetc(existing) != '\n';
      std::fclose(existing);
    }
  }
  file_ = std::fopen(path_.c_str(), truncate ? "wb" : "ab");
  if (!file_) fail("{}: cannot open for writing: {}", path_.string(), std::strerror(errno));
  if (needs_newline) std::fputc('\n', file_);
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (!record.is_object())
    fail("{}: a metrics record must be a JSON object, got {}", path_.string(), record.type_name());
  // Replacement error handling keeps a bad UTF-8 byte in a string field from losing the whole record.
  std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line.push_back('\n');
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    fail("{}: write failed: {}", path_.string(), std::strerror(errno));
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--:--";
  const auto total = static_cast<int64_t>(std::llround(seconds));
  return fmt::format("{:02}:{:02}:{:02}", total / 3600, total / 60 % 60, total % 60);
}

std::string format_count(double value) {
  if (!std::isfinite(value)) return fmt::format("{}", value);
  const double magnitude = std::fabs(value);
  if (magnitude < 1e3) return fmt::format("{:.0f}", value);
  if (magnitude < 1e6) return fmt::format("{:.1f}k", value / 1e3);
  if (magnitude < 1e9) return fmt::format("{:.2f}M", value / 1e6);
  return fmt::format("{:.2f}G", value / 1e9);
}

std::string format_flops_rate(double flops_per_s) {
  if (flops_per_s >= 1e12) return fmt::format("{:.1f} TFLOP/s", flops_per_s / 1e12);
  return fmt::format("{:.1f} GFLOP/s", flops_per_s / 1e9);
}

std::string format_step_line(const StepLine& s) {
  // total_steps <= 0: not known yet (a time-budget run before its plan), shown as "?".
  const std::string total = s.total_steps > 0 ? std::to_string(s.total_steps) : "?";
  const int width = static_cast<int>(total.size());
  std::string line = fmt::format("step {:>{}}/{} | loss {:.4f} | lr {:.2e} | gnorm {:.3f} | {} tok/s", s.step,
                                 width, total, s.loss, s.lr, s.grad_norm, format_count(s.tokens_per_s));
  if (s.images_per_s >= 0) line += fmt::format(" | {} img/s", format_count(s.images_per_s));
  line += " | " + format_flops_rate(s.flops_per_s);
  if (std::isfinite(s.mfu) && s.mfu >= 0) line += fmt::format(" | mfu {:.1f}%", 100.0 * s.mfu);
  if (!s.extra.empty()) line += " | " + s.extra;
  line += fmt::format(" | {} eta {}", format_duration(s.elapsed_s), format_duration(s.eta_s));
  return line;
}

ProgressBar::ProgressBar(std::string label, int64_t total, Mode mode, std::FILE* stream)
    : label_(std::move(label)), total_(total), stream_(stream), start_(std::chrono::steady_clock::now()) {
  enabled_ = mode == Mode::always || (mode == Mode::automatic && stream_ && ::isatty(::fileno(stream_)));
}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(int64_t done) {
  done_ = done;
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  const bool first = last_draw_ == std::chrono::steady_clock::time_point{};
  if (!first && now - last_draw_ < std::chrono::milliseconds(100) && done != total_) return;
  last_draw_ = now;
  draw(done);
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  if (!enabled_) return;
  draw(done_);
  std::fputc('\n', stream_);
  std::fflush(stream_);
}

void ProgressBar::draw(int64_t done) {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (total_ <= 0) {
    std::fprintf(stream_, "\r%s %lld  %s", label_.c_str(), static_cast<long long>(done),
                 format_duration(elapsed).c_str());
  } else {
    constexpr int kWidth = 30;
    const double fraction = std::clamp(static_cast<double>(done) / static_cast<double>(total_), 0.0, 1.0);
    const int filled = static_cast<int>(fraction * kWidth);
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    std::fprintf(stream_, "\r%s [%s] %3.0f%% %lld/%lld  %s", label_.c_str(), bar.c_str(), 100.0 * fraction,
                 static_cast<long long>(done), static_cast<long long>(total_),
                 format_duration(elapsed).c_str());
  }
  std::fflush(stream_);
}

}  // namespace forge::train
