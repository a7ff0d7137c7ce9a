// forge report (train/report.h): reading run directories, downsampling, and the page's embedded data.
#include "forge/report/report.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>

#include "forge/core/error.h"

namespace forge::report::report_test {
namespace {

namespace fs = std::filesystem;

class ReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("forge_report_{}_{}", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                       ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  fs::path dir_;
};

// The JSON the page embeds for tools and tests.
nlohmann::json page_data(const std::string& html) {
  const std::string open = "<script type=\"application/json\" id=\"forge-report-data\">";
  const size_t begin = html.find(open);
  EXPECT_NE(begin, std::string::npos);
  const size_t end = html.find("</script>", begin);
  std::string json = html.substr(begin + open.size(), end - begin - open.size());
  return nlohmann::json::parse(json);
}

TEST_F(ReportTest, ReadsCurvesEventsAndExpertLoads) {
  write(
      "metrics.jsonl",
      R"({"step":1,"loss":7.5,"lr":0.001,"grad_norm":2.5,"tokens":100,"tokens_per_s":1000,"mfu":0.4,"peak_memory_bytes":1048576,"fp8":{"scale":{"input":{"min":1,"median":2,"max":4}}}}
{"step":2,"loss":7.0,"lr":0.002,"grad_norm":2.0,"tokens":200,"tokens_per_s":1100,"mfu":0.45,"moe":{"max_violation":0.5,"layers":[{"layer":1,"max_violation":0.5,"load":[3,1]},{"layer":2,"max_violation":0.25,"load":[2,2]}]},"mtp":[{"depth":1,"loss":7.7,"top1":0.1}]}
{"step":2,"eval_loss":7.2,"eval_bits_per_byte":2.9}
{"step":3,"loss":6.5,"lr":0.003,"grad_norm":1.5,"tokens":300}
{"event":"rollback","step":4,"cause":"loss spike","restored_step":2}
{"step":3,"loss":6.6,"lr":0.003,"grad_norm":1.6,"tokens":300,"moe":{"max_violation":0.1,"layers":[{"layer":1,"max_violation":0.1},{"layer":2,"max_violation":0.05}]}}
{"event":"checkpoint","step":3,"reason":"final","dir":"x","seconds":0.1}
)");
  write("config.toml", "[train]\nlr = 0.003\n[model]\nconfig = \"c.json\"\n");
  const RunData r = read_run(dir_);
  EXPECT_EQ(r.label, dir_.filename().string());
  EXPECT_EQ(r.lines, 7);
  EXPECT_EQ(r.skipped_count, 0) << (r.skipped.empty() ? "" : r.skipped[0]);
  // The rollback to step 2 dropped the abandoned step 3; the retrained one took its place.
  ASSERT_NE(r.find("loss"), nullptr);
  EXPECT_EQ(*r.find("loss"), (std::vector<Point>{{1, 100, 7.5}, {2, 200, 7.0}, {3, 300, 6.6}}));
  EXPECT_EQ(*r.find("eval_loss"), (std::vector<Point>{{2, 200, 7.2}}));
  EXPECT_EQ(*r.find("peak_memory_bytes"), (std::vector<Point>{{1, 100, 1048576}}));
  EXPECT_EQ(*r.find("fp8.scale.input.median"), (std::vector<Point>{{1, 100, 2}}));
  EXPECT_EQ(*r.find("mtp.1.loss"), (std::vector<Point>{{2, 200, 7.7}}));
  EXPECT_EQ(*r.find("moe.max_violation"), (std::vector<Point>{{2, 200, 0.5}, {3, 300, 0.1}}));
  EXPECT_EQ(r.find("tokens"), nullptr);  // the x axis, not a curve
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[0].kind, "rollback");
  EXPECT_EQ(r.events[0].step, 4);
  EXPECT_NE(r.events[0].text.find("cause loss spike"), std::string::npos);
  EXPECT_EQ(r.moe_layers, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(r.violation_steps, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.violation[1], (std::vector<double>{0.1, 0.05}));
  EXPECT_EQ(r.load_step, 2);  // step 3's record carries no loads
  EXPECT_EQ(r.load, (std::vector<std::vector<double>>{{3, 1}, {2, 2}}));
  EXPECT_EQ(r.settings.at("train.lr"), "0.003");
  EXPECT_EQ(r.settings.at("model.config"), "c.json");

  const std::string html = render_html({r});
  for (const char* chart :
       {"data-chart=\"loss\"", "data-chart=\"eval_loss\"", "data-chart=\"lr\"", "data-chart=\"peak_memory\"",
        "data-chart=\"fp8_scales\"", "data-chart=\"mtp\"", "data-chart=\"moe_violation\"",
        "data-chart=\"expert_load\"", "data-chart=\"violation\""})
    EXPECT_NE(html.find(chart), std::string::npos) << chart;
  EXPECT_NE(html.find("class=\"f-event\""), std::string::npos);  // the rollback's rule on the loss curve
  EXPECT_NE(html.find("loss spike"), std::string::npos);
  EXPECT_EQ(html.find("NaN"), std::string::npos);
  EXPECT_EQ(html.find("Skipped input"), std::string::npos);
}

TEST_F(ReportTest, PageDataEqualsTheMetrics) {
  // Numbers that print long: the page must carry them exactly.
  std::string text;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0, 10);
  std::vector<double> losses;
  for (int s = 1; s <= 300; ++s) {
    losses.push_back(u(rng));
    text += nlohmann::json({{"step", s}, {"loss", losses.back()}, {"tokens", s * 4096}}).dump() + "\n";
  }
  write("metrics.jsonl", text);
  const std::string html = render_html({read_run(dir_)});
  const nlohmann::json data = page_data(html);
  const nlohmann::json& loss = data["runs"][0]["series"]["loss"];
  ASSERT_EQ(loss.size(), losses.size());
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_EQ(loss[i][0].get<double>(), static_cast<double>(i + 1));
    EXPECT_EQ(loss[i][1].get<double>(), static_cast<double>((i + 1) * 4096));
    EXPECT_EQ(loss[i][2].get<double>(), losses[i]) << "step " << i + 1;
  }
  EXPECT_EQ(data["runs"][0]["summary"]["final_loss"].get<double>(), losses.back());
  EXPECT_EQ(data["runs"][0]["summary"]["steps"].get<double>(), 300);
  EXPECT_NE(html.find(fmt::format("{:.4f}", losses.back())), std::string::npos);  // the summary table
}

// sample.captions' record: its own section (the rate, each example with the differing bytes marked), a short
// events line without the examples, and the record in the page data.
TEST_F(ReportTest, HeldOutCaptionsGetTheirSection) {
  write("metrics.jsonl",
        R"({"step":1,"loss":2.0,"tokens":96})"
        "\n"
        R"({"event":"captions","step":1,"count":600,"exact":460,"token_accuracy":0.895,"examples":[)"
        R"({"index":8,"answer":"a large black circle","reference":"a large black square"},)"
        R"({"index":0,"answer":"a <purple> triangle","reference":"a <purple> triangle"}]})"
        "\n");
  const RunData run = read_run(dir_);
  ASSERT_TRUE(run.captions.has_value());
  ASSERT_EQ(run.events.size(), 1u);
  EXPECT_EQ(run.events[0].text, "count 600, exact 460, token_accuracy 0.895");
  const std::string html = render_html({run});
  EXPECT_NE(html.find("460 of 600 exactly right (76.7%), 89.5% of their tokens"), std::string::npos);
  EXPECT_NE(html.find("a large black <mark>circl</mark>e"), std::string::npos);  // byte by byte
  EXPECT_NE(html.find("a &lt;purple&gt; triangle"), std::string::npos);          // escaped
  EXPECT_EQ(page_data(html)["runs"][0]["captions"]["exact"], 460);
}

TEST_F(ReportTest, MalformedLinesAreSkippedAndNamed) {
  write("metrics.jsonl",
        "{\"step\":1,\"loss\":7.5,\"lr\":0.001}\n"
        "not json at all\n"
        "[1,2]\n"
        "{\"loss\":3}\n"
        "{\"step\":2,\"loss\":\"abc\",\"lr\":0.002}\n"
        "{\"step\":3,\"loss\":null,\"lr\":0.003}\n"
        "\n"
        "{\"step\":4,\"loss\":6.5,\"lr\":0.004}\n"
        "{\"step\":5,\"loss\":6.");  // a killed run's half-written last line
  const RunData r = read_run(dir_);
  EXPECT_EQ(*r.find("loss"), (std::vector<Point>{{1, 0, 7.5}, {4, 0, 6.5}}));
  EXPECT_EQ(r.find("lr")->size(), 4u);  // a bad value costs only itself
  ASSERT_EQ(r.skipped_count, 6);
  EXPECT_EQ(r.skipped[0], "metrics.jsonl line 2: not valid JSON");
  EXPECT_EQ(r.skipped[1], "metrics.jsonl line 3: not a JSON object: [1,2]");
  EXPECT_EQ(r.skipped[2], "metrics.jsonl line 4: no integer \"step\"");
  EXPECT_EQ(r.skipped[3], "metrics.jsonl line 5: \"loss\" is not a number: \"abc\"");
  EXPECT_EQ(r.skipped[4], "metrics.jsonl line 6: \"loss\" is null (a NaN or infinity) at step 3");
  EXPECT_EQ(r.skipped[5],
            "metrics.jsonl line 9: not valid JSON (a half-written last line, as a killed run leaves)");
  const std::string html = render_html({r});
  EXPECT_NE(html.find("Skipped input"), std::string::npos);
  EXPECT_NE(html.find("a half-written last line"), std::string::npos);
  EXPECT_EQ(page_data(html)["runs"][0]["skipped_count"], 6);
}

TEST_F(ReportTest, ARunWithoutMetricsIsAnErrorNamingIt) {
  try {
    read_run(dir_);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir_.string() + ": no readable metrics.jsonl"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(read_run(dir_ / "missing"), Error);
  EXPECT_THROW(read_runs({}), Error);
}

TEST_F(ReportTest, TwoRunsOfOneNameGetDistinctLabels) {
  for (const char* d : {"a/run", "b/run"}) {
    fs::create_directories(dir_ / d);
    std::ofstream(dir_ / d / "metrics.jsonl") << "{\"step\":1,\"loss\":1}\n";
    std::ofstream(dir_ / d / "config.toml") << "[train]\nlr = " << (d[0] == 'a' ? "0.1" : "0.2") << "\n";
  }
  const std::vector<RunData> runs = read_runs({dir_ / "a/run", dir_ / "b/run/"});
  EXPECT_EQ(runs[0].label, "run");
  EXPECT_EQ(runs[1].label, "b/run");
  // A folder of runs stands for them.
  fs::create_directories(dir_ / "sweep");
  fs::rename(dir_ / "a", dir_ / "sweep" / "a");
  fs::rename(dir_ / "b", dir_ / "sweep" / "b");
  const std::vector<RunData> sweep = read_runs({dir_ / "sweep" / "b", dir_ / "sweep" / "a"});
  ASSERT_EQ(sweep.size(), 2u);
  EXPECT_EQ(sweep[0].dir, dir_ / "sweep" / "b" / "run");
  EXPECT_EQ(read_runs({dir_ / "sweep" / "a" / "run", dir_ / "sweep" / "a"}).size(),
            1u);                                     // named twice, drawn once
  EXPECT_THROW(read_runs({dir_ / "sweep"}), Error);  // its sub-folders hold runs only one level down
  const std::string html = render_html(runs);
  EXPECT_NE(html.find("Settings that differ"), std::string::npos);
  EXPECT_NE(html.find("<td class=\"l\"><code>train.lr</code></td><td>0.1</td><td>0.2</td>"),
            std::string::npos);
  EXPECT_NE(html.find("data-run=\"1\""), std::string::npos);
}

TEST_F(ReportTest, BaselineComparisonAndStandaloneCharts) {
  for (const char* d : {"bf16", "fp8"}) {
    fs::create_directories(dir_ / d);
    const double scale = d[0] == 'b' ? 1.0 : 1.02;  // fp8's losses 2% above bf16's
    std::string text;
    for (int s = 1; s <= 60; ++s)
      text += fmt::format("{{\"step\":{},\"loss\":{},\"tokens\":{}}}\n", s, scale * (5 - s * 0.01), 64 * s);
    text += fmt::format("{{\"step\":60,\"eval_loss\":{},\"eval_bits_per_byte\":2}}\n", scale * 4);
    std::ofstream(dir_ / d / "metrics.jsonl") << text;
  }
  const std::vector<RunData> runs = read_runs({dir_ / "bf16", dir_ / "fp8"});
  Options o;
  o.baseline = "bf16";
  const std::string html = render_html(runs, o);
  for (const char* chart : {"data-chart=\"eval_vs_baseline\"", "data-chart=\"loss_vs_baseline\"",
                            "data-series=\"loss.smoothed\"", "mean of 5 points"})
    EXPECT_NE(html.find(chart), std::string::npos) << chart;
  EXPECT_NE(html.find("Held-out loss relative to bf16"), std::string::npos);
  o.baseline = "nope";
  try {
    render_html(runs, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--baseline nope: not one of the runs (bf16, fp8)");
  }
  EXPECT_THROW(write_chart_svgs(runs, dir_ / "charts", o), Error);
  o.baseline = "bf16";
  const std::vector<fs::path> files = write_chart_svgs(runs, dir_ / "charts", o);
  std::set<std::string> names;
  for (const fs::path& f : files) names.insert(f.filename().string());
  for (const char* name : {"loss.svg", "eval_loss.svg", "eval_vs_baseline.svg", "loss_vs_baseline.svg"})
    EXPECT_TRUE(names.count(name)) << name;
  std::ifstream in(dir_ / "charts" / "loss.svg");
  const std::string svg{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<style>"), std::string::npos);  // styled on its own, outside the page
  EXPECT_NE(svg.find(">■ fp8</tspan>"), std::string::npos);
  EXPECT_EQ(svg.find("NaN"), std::string::npos);
}

TEST(ReportDownsample, KeepsTheEndsAndTheExtremesWithinTheBudget) {
  std::vector<Point> points;
  for (int i = 0; i < 1000000; ++i) points.push_back({static_cast<double>(i), 0, std::sin(i * 1e-4)});
  points[123457].value = 50;   // a spike
  points[876543].value = -50;  // a dip
  const std::vector<Point> d = downsample(points, 2000);
  EXPECT_LE(d.size(), 2000u);
  EXPECT_GE(d.size(), 1000u);
  EXPECT_EQ(d.front(), points.front());
  EXPECT_EQ(d.back(), points.back());
  EXPECT_TRUE(
      std::is_sorted(d.begin(), d.end(), [](const Point& a, const Point& b) { return a.step < b.step; }));
  EXPECT_NE(std::find(d.begin(), d.end(), points[123457]), d.end());
  EXPECT_NE(std::find(d.begin(), d.end(), points[876543]), d.end());
  // Every kept point is an input point.
  for (const Point& p : d) EXPECT_EQ(points[static_cast<size_t>(p.step)], p);
  const std::vector<Point> few(points.begin(), points.begin() + 100);
  EXPECT_EQ(downsample(few, 2000), few);
  EXPECT_THROW(downsample(few, 4), Error);
}

TEST_F(ReportTest, AMillionLineRunMakesAPageOfAFewMegabytes) {
  {
    std::ofstream out(dir_ / "metrics.jsonl");
    for (int s = 1; s <= 1000000; ++s)
      out << fmt::format(
          "{{\"step\":{},\"loss\":{},\"lr\":0.0003,\"grad_norm\":{},\"tokens\":{},\"tokens_per_s\":15000.5}}"
          "\n",
          s, 3 + 4.0 / std::sqrt(s), 1 + (s % 97) * 0.01, s * 2048LL);
  }
  const RunData r = read_run(dir_);
  EXPECT_EQ(r.find("loss")->size(), 1000000u);
  const std::string html = render_html({r});
  EXPECT_LT(html.size(), 4u << 20);
  EXPECT_LE(page_data(html)["runs"][0]["series"]["loss"].size(), 2000u);
}

}  // namespace
}  // namespace forge::report::report_test
