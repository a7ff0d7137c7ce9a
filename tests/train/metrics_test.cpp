#include "forge/train/metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "forge/core/error.h"

namespace forge::metrics_test {
using namespace forge::train;
namespace {

class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("forge_metrics_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

std::vector<std::string> read_lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string read_stream(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string text;
  for (int c; (c = std::fgetc(f)) != EOF;) text.push_back(static_cast<char>(c));
  return text;
}

TEST(MetricsWriter, OneJsonObjectPerLineFlushedImmediately) {
  TempDir dir;
  MetricsWriter writer(dir.path() / "run");  // creates the run directory
  EXPECT_EQ(writer.path(), dir.path() / "run" / "metrics.jsonl");
  writer.write({{"step", 10}, {"loss", 2.5}, {"lr", 3e-3}, {"grad_norm", 0.41}});
  // Readable before the writer closes: every line is flushed.
  auto lines = read_lines(writer.path());
  ASSERT_EQ(lines.size(), 1u);
  const auto first = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(first["step"], 10);
  EXPECT_DOUBLE_EQ(first["lr"].get<double>(), 3e-3);
  writer.write({{"step", 20}, {"loss", std::numeric_limits<double>::quiet_NaN()}, {"note", "a\nb"}});
  lines = read_lines(writer.path());
  ASSERT_EQ(lines.size(), 2u);
  const auto second = nlohmann::json::parse(lines[1]);
  EXPECT_TRUE(second["loss"].is_null());  // NaN has no JSON spelling
  EXPECT_EQ(second["note"], "a\nb");
  EXPECT_THROW(writer.write(nlohmann::json::array({1, 2})), Error);
}

TEST(MetricsWriter, AppendsOrTruncates) {
  TempDir dir;
  {
    MetricsWriter writer(dir.path());
    writer.write({{"step", 1}});
  }
  {
    MetricsWriter writer(dir.path());
    writer.write({{"step", 2}});
  }
  EXPECT_EQ(read_lines(dir.path() / "metrics.jsonl").size(), 2u);
  // A partial last line (a run killed mid-write) does not swallow the next record.
  { std::ofstream(dir.path() / "metrics.jsonl", std::ios::app) << "{\"step\": 3, \"lo"; }
  {
    MetricsWriter writer(dir.path());
    writer.write({{"step", 4}});
  }
  const auto lines = read_lines(dir.path() / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(nlohmann::json::parse(lines[3])["step"], 4);
  {
    MetricsWriter writer(dir.path(), /*truncate=*/true);
    writer.write({{"step", 5}});
  }
  EXPECT_EQ(read_lines(dir.path() / "metrics.jsonl").size(), 1u);
}

TEST(MetricsWriter, UnwritableRunDirIsAnError) {
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  std::ofstream(dir.path() / "file") << "x";
  try {
    MetricsWriter writer(dir.path() / "file" / "run");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir.path() / "file" / "run").string()), std::string::npos)
        << e.what();
  }
}

TEST(StepLine, FormatsLikeTheDocumentedExample) {
  StepLine s;
  s.step = 120;
  s.total_steps = 2000;
  s.loss = 1.93421;
  s.lr = 2.9512e-3;
  s.grad_norm = 0.41234;
  s.tokens_per_s = 15234;
  s.flops_per_s = 212.34e12;
  s.mfu = 0.41234;
  s.elapsed_s = 192;
  s.eta_s = 430;
  EXPECT_EQ(
      format_step_line(s),
      "step  120/2000 | loss 1.9342 | lr 2.95e-03 | gnorm 0.412 | 15.2k tok/s | 212.3 TFLOP/s | mfu 41.2% | "
      "00:03:12 eta 00:07:10");
}

TEST(StepLine, CpuRatesUnknownPeakAndEta) {
  StepLine s;
  s.step = 3;
  s.total_steps = 10;
  s.loss = 5.5;
  s.lr = 1e-4;
  s.grad_norm = 12.0;
  s.tokens_per_s = 950;
  s.flops_per_s = 45.67e9;
  s.elapsed_s = 3725;
  EXPECT_EQ(format_step_line(s),
            "step  3/10 | loss 5.5000 | lr 1.00e-04 | gnorm 12.000 | 950 tok/s | 45.7 GFLOP/s | 01:02:05 eta "
            "--:--:--");
}

TEST(StepLine, ImageRateAfterTheTokenRate) {
  StepLine s;
  s.step = 20, s.total_steps = 2000, s.loss = 0.5, s.lr = 2.5e-4, s.grad_norm = 0.3;
  s.tokens_per_s = 57800, s.images_per_s = 602, s.flops_per_s = 269.7e9, s.mfu = 0.393;
  s.elapsed_s = 59, s.eta_s = 59;
  EXPECT_EQ(
      format_step_line(s),
      "step   20/2000 | loss 0.5000 | lr 2.50e-04 | gnorm 0.300 | 57.8k tok/s | 602 img/s | 269.7 GFLOP/s | "
      "mfu 39.3% | 00:00:59 eta 00:00:59");
}

TEST(StepLine, Helpers) {
  EXPECT_EQ(format_duration(0), "00:00:00");
  EXPECT_EQ(format_duration(59.6), "00:01:00");
  EXPECT_EQ(format_duration(360000), "100:00:00");
  EXPECT_EQ(format_duration(-1), "--:--:--");
  EXPECT_EQ(format_duration(std::nan("")), "--:--:--");
  EXPECT_EQ(format_count(999), "999");
  EXPECT_EQ(format_count(1000), "1.0k");
  EXPECT_EQ(format_count(3.456e6), "3.46M");
  EXPECT_EQ(format_count(1.2e9), "1.20G");
  EXPECT_EQ(format_flops_rate(0.999e12), "999.0 GFLOP/s");
  EXPECT_EQ(format_flops_rate(1e12), "1.0 TFLOP/s");
  EXPECT_EQ(format_flops_rate(989e12), "989.0 TFLOP/s");
}

TEST(ProgressBar, DrawsInPlaceWhenEnabled) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    ProgressBar bar("loading", 4, ProgressBar::Mode::always, out);
    EXPECT_TRUE(bar.enabled());
    bar.update(1);  // first update draws
    bar.update(2);  // may be throttled (not asserted: that would depend on wall-clock time)
    bar.update(4);  // completion always draws
    bar.finish();
    bar.finish();  // idempotent
  }
  const std::string text = read_stream(out);
  std::fclose(out);
  EXPECT_EQ(text.front(), '\r');
  EXPECT_NE(text.find("loading ["), std::string::npos) << text;
  EXPECT_NE(text.find(" 25% 1/4"), std::string::npos) << text;
  EXPECT_NE(text.find("100% 4/4"), std::string::npos) << text;
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1);
}

TEST(ProgressBar, SilentWhenNotATerminal) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    ProgressBar bar("loading", 4, ProgressBar::Mode::automatic, out);  // a file is not a TTY
    EXPECT_FALSE(bar.enabled());
    for (int i = 0; i <= 4; ++i) bar.update(i);
  }
  {
    ProgressBar bar("never", 0, ProgressBar::Mode::never, out);
    bar.update(7);
  }
  EXPECT_EQ(read_stream(out), "");
  std::fclose(out);
}

}  // namespace
}  // namespace forge::metrics_test
