// forge report end to end: real short runs (forge train writes report.html itself), loaded in a real browser
// (headless Chromium, installed by scripts/install-deps.sh) without console messages, screenshotted, and the
// screenshot read back with libpng to find the curves' pixels; an overlay of two runs (a dense one and a
// DeepSeek-V3 one on two pipeline ranks, with its pipeline timeline and expert heat maps); a killed run's
// truncated metrics.jsonl; and bad input, one line each.
#include <gtest/gtest.h>
#include <png.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>

#include "tools/cli_harness.h"

namespace forge::testing::cli::report_cli_test {
namespace {

const fs::path kRepo = fs::path(FORGE_FIXTURE_DIR).parent_path().parent_path();

// Chromium's binary: Debian's `chromium`, or FORGE_CHROMIUM.
std::string chromium() {
  if (const char* c = std::getenv("FORGE_CHROMIUM"); c && *c) return c;
  return "chromium";
}

struct Browser {
  int status = -1;
  std::string console;  // the page's console messages ("INFO:CONSOLE" lines of Chromium's log)
  std::string dom;      // the DOM after loading
  std::string log;      // everything Chromium said
};

// Loads `page` in headless Chromium: dumps its DOM, and with `screenshot` also writes a PNG of a
// width x height window.
Browser load(const fs::path& page, const fs::path& scratch, const fs::path& screenshot = {}, int width = 1240,
             int height = 1400) {
  Browser b;
  const std::string flags =
      " --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run "
      "--disable-extensions --enable-logging=stderr --v=0 --user-data-dir=" +
      (scratch / "chromium-profile").string();
  const fs::path err = scratch / "chromium.log", out = scratch / "dom.html";
  const std::string url = "file://" + fs::absolute(page).string();
  std::string command =
      chromium() + flags + " --dump-dom " + url + " > " + out.string() + " 2> " + err.string();
  if (!screenshot.empty())
    command += "; " + chromium() + flags + " --screenshot=" + screenshot.string() +
               " --window-size=" + std::to_string(width) + "," + std::to_string(height) + " " + url +
               " 2>> " + err.string() + " > /dev/null";
  const int raw = std::system(("timeout 120 sh -c '" + command + "'").c_str());
  b.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  b.log = read_file(err);
  b.dom = read_file(out);
  std::istringstream lines(b.log);
  for (std::string line; std::getline(lines, line);)
    if (line.find(":CONSOLE") != std::string::npos) b.console += line + "\n";
  return b;
}

// Pixels of exactly this colour in a PNG (libpng's simplified API, read as RGB).
int64_t count_color(const fs::path& png, uint32_t rgb) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&image, png.c_str())) return -1;
  image.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> pixels(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, pixels.data(), 0, nullptr)) return -1;
  int64_t n = 0;
  for (size_t i = 0; i + 2 < pixels.size(); i += 3)
    n += (static_cast<uint32_t>(pixels[i]) << 16 | static_cast<uint32_t>(pixels[i + 1]) << 8 |
          pixels[i + 2]) == rgb;
  return n;
}

constexpr uint32_t kFirstRun = 0x1f77b4, kSecondRun = 0xd62728;  // report_html.cpp's first two run colours

nlohmann::json page_data(const std::string& html) {
  const std::string open = "<script type=\"application/json\" id=\"forge-report-data\">";
  const size_t begin = html.find(open);
  if (begin == std::string::npos) return {};
  const size_t end = html.find("</script>", begin);
  return nlohmann::json::parse(html.substr(begin + open.size(), end - begin - open.size()));
}

class ReportCli : public ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    std::string corpus;
    for (int i = 0; i < 300; ++i)
      corpus += "And the evening and the morning were the day " + std::to_string(i % 9) + ".\n";
    write("corpus.txt", corpus);
    write("llama.json", R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64})");
  }
  std::string train_args(const std::string& model, const std::string& run, const std::string& extra = "") {
    return "train --set model.config=" + model + " --set data.corpus=" + path("corpus.txt") +
           " --set data.tokenizer=bytes --set data.seq_len=32 --set train.micro_batch=2 --set train.steps=40"
           " --set train.warmup=5 --set eval.every=10 --set eval.batches=1 --set data.heldout_fraction=0.05"
           " --set log.peak_gflops=100 --set sample.tokens=0 --set log.every=2 --set log.profile_step=20"
           " --set log.run_dir=" +
           path(run) + extra;
  }
  // The page without its curves, for the screenshot to compare with.
  fs::path without_curves(const fs::path& page) {
    const std::string html = read_file(page);
    const std::string stripped = std::regex_replace(html, std::regex("<path class=\"f-curve\"[^>]*/>"), "");
    EXPECT_NE(stripped.size(), html.size());
    return write(page.stem().string() + "-no-curves.html", stripped);
  }
};

TEST_F(ReportCli, AShortRunsReportLoadsInChromiumWithItsCurvesDrawn) {
  // A NaN loss at step 25: the run rolls back, and the page shows it (an event row, a rule on the loss
  // curve).
  const Outcome trained = run_forge(train_args(path("llama.json"), "dense",
                                               " --set resilience.snapshot_every=10 "
                                               "--set \"resilience.inject=nan_loss step=25\""),
                                    {.environment = "OMP_NUM_THREADS=1"});
  ASSERT_EQ(trained.status, 0) << trained.output;
  const fs::path page = dir_ / "dense" / "report.html";
  EXPECT_NE(trained.output.find("report: " + page.string()), std::string::npos) << trained.output;
  ASSERT_TRUE(fs::exists(page));

  // The page's numbers are metrics.jsonl's.
  const std::string html = read_file(page);
  const nlohmann::json data = page_data(html);
  ASSERT_FALSE(data.is_null());
  std::map<int64_t, double> losses;
  {
    std::ifstream in(dir_ / "dense" / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json r = nlohmann::json::parse(line);
      if (r.contains("loss") && !r.contains("event"))
        losses[r["step"].get<int64_t>()] = r["loss"].get<double>();
    }
  }
  const nlohmann::json& drawn = data["runs"][0]["series"]["loss"];
  ASSERT_EQ(drawn.size(), losses.size());
  for (const nlohmann::json& p : drawn) EXPECT_EQ(p[2].get<double>(), losses.at(p[0].get<int64_t>()));
  for (const char* part : {"data-chart=\"loss\"", "data-chart=\"eval_loss\"", "data-chart=\"peak_memory\"",
                           "data-chart=\"profile\"", "Op profile", "class=\"f-event\"",
                           "<td class=\"l kind rollback\">rollback</td>"})
    EXPECT_NE(html.find(part), std::string::npos) << part;

  const Browser b = load(page, dir_, dir_ / "dense.png");
  ASSERT_EQ(b.status, 0) << b.log;
  EXPECT_EQ(b.console, "") << "the page logged to the console";
  EXPECT_NE(b.dom.find("data-chart=\"loss\""), std::string::npos);
  EXPECT_NE(b.dom.find("<html lang=\"en\" data-ready=\"1\">"),
            std::string::npos);  // its script ran to the end
  // The curves' pixels: the first run's colour, far more of it than the page shows without its curves.
  const Browser bare = load(without_curves(page), dir_, dir_ / "bare.png");
  ASSERT_EQ(bare.status, 0) << bare.log;
  const int64_t with = count_color(dir_ / "dense.png", kFirstRun),
                without = count_color(dir_ / "bare.png", kFirstRun);
  ASSERT_GE(with, 0) << "cannot read the screenshot";
  EXPECT_GT(with - without, 1500) << with << " vs " << without;
}

TEST_F(ReportCli, TwoRunsOverlaidWithPipelineTimelineAndExpertLoads) {
  const Outcome dense =
      run_forge(train_args(path("llama.json"), "dense"), {.environment = "OMP_NUM_THREADS=1"});
  ASSERT_EQ(dense.status, 0) << dense.output;
  // DeepSeek-V3 (MoE, MTP) on two pipeline ranks: the profiled step's timeline and the expert loads.
  nlohmann::json config =
      nlohmann::json::parse(read_file(fs::path(FORGE_FIXTURE_DIR) / "deepseek_v3_mtp2.config.json"));
  config["vocab_size"] = 256;  // the byte tokenizer's
  const std::string moe_model = write("deepseek.json", config.dump());
  const Outcome moe =
      run_forge(train_args(moe_model, "moe",
                           " --set parallel.pp=2 --set parallel.pp_layers=1,2 --set train.grad_accum=4 "
                           "--set log.expert_load_every=10 --set log.report=false"),
                under_mpirun(2));
  ASSERT_EQ(moe.status, 0) << moe.output;
  EXPECT_FALSE(fs::exists(dir_ / "moe" / "report.html"));  // log.report=false
  ASSERT_TRUE(fs::exists(dir_ / "moe" / "pipeline_trace.json"));

  const Outcome o =
      run_forge("report " + path("dense") + " " + path("moe") + " --output " + path("both.html"));
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("wrote " + path("both.html") + " (2 runs"), std::string::npos) << o.output;
  const std::string html = read_file(dir_ / "both.html");
  for (const char* part :
       {"Settings that differ", "data-chart=\"moe_violation\"", "data-chart=\"expert_load\"",
        "data-chart=\"violation\"", "data-chart=\"mtp\"", "Pipeline timeline",
        "class=\"timeline\" data-run=\"1\"", "<code>parallel.pp</code>"})
    EXPECT_NE(html.find(part), std::string::npos) << part;
  const nlohmann::json data = page_data(html);
  ASSERT_EQ(data["runs"].size(), 2u);
  EXPECT_EQ(data["runs"][1]["expert_load"]["step"], 40);
  EXPECT_EQ(data["runs"][1]["expert_load"]["layers"], (std::vector<int>{1, 2, 3, 4}));  // MTP's blocks too

  const Browser b = load(dir_ / "both.html", dir_, dir_ / "both.png", 1240, 2400);
  ASSERT_EQ(b.status, 0) << b.log;
  EXPECT_EQ(b.console, "") << "the page logged to the console";
  const Browser bare = load(without_curves(dir_ / "both.html"), dir_, dir_ / "bare.png", 1240, 2400);
  for (uint32_t color : {kFirstRun, kSecondRun})
    EXPECT_GT(count_color(dir_ / "both.png", color) - count_color(dir_ / "bare.png", color), 1000)
        << std::hex << color;
}

TEST_F(ReportCli, AKilledRunsTruncatedMetricsStillRender) {
  std::string metrics;
  for (int s = 1; s <= 30; ++s)
    metrics += "{\"step\":" + std::to_string(s) + ",\"loss\":" + std::to_string(5.0 - s * 0.05) +
               ",\"lr\":0.001,\"tokens\":" + std::to_string(s * 64) + "}\n";
  metrics += "{\"step\":31,\"loss\":\"oops\",\"lr\":0.001}\n{\"step\":32,\"loss\":3.4,\"lr";
  fs::create_directories(dir_ / "killed");
  write("killed/metrics.jsonl", metrics);
  const Outcome o = run_forge("report " + path("killed"));
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("wrote " + path("killed/report.html") + " (1 run, 32 metrics lines"),
            std::string::npos)
      << o.output;
  EXPECT_NE(
      o.output.find("killed: skipped 2 lines or values (listed in the report), e.g. metrics.jsonl line 31: "
                    "\"loss\" is not a number: \"oops\""),
      std::string::npos)
      << o.output;
  const std::string html = read_file(dir_ / "killed" / "report.html");
  EXPECT_NE(html.find("a half-written last line"), std::string::npos);
  EXPECT_EQ(page_data(html)["runs"][0]["series"]["loss"].size(), 30u);
  const Browser b = load(dir_ / "killed" / "report.html", dir_);
  ASSERT_EQ(b.status, 0) << b.log;
  EXPECT_EQ(b.console, "");
  EXPECT_NE(b.dom.find("Skipped input"), std::string::npos);
}

TEST_F(ReportCli, BadInputIsOneLine) {
  expect_one_line_error("report", "runs is required");
  expect_one_line_error("report " + path("nowhere"), path("nowhere") + ": not a directory");
  fs::create_directories(dir_ / "empty");
  expect_one_line_error("report " + path("empty"), path("empty") + ": no readable metrics.jsonl");
  write("empty/metrics.jsonl", "{\"step\":1,\"loss\":1}\n");
  expect_one_line_error("report " + path("empty") + " --max-points 3", "--max-points 3: must be at least 8");
  expect_one_line_error("report " + path("empty") + " --output " + path("no/such/dir/r.html"), "no/such/dir");
  expect_one_line_error("report " + path("empty") + " --baseline bf16",
                        "--baseline bf16: not one of the runs (empty)");
  const Outcome help = run_forge("report --help");
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.output.find("half-written last line"), std::string::npos) << help.output;
}

}  // namespace
}  // namespace forge::testing::cli::report_cli_test
