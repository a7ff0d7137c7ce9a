// forge plan schedule, run as the real binary: the per-rank table meets the 1F1B oracle (idle (P-1)(F+B) =
// 21 on every rank at P = 8, 16 micro-batches), --svg and --trace write their files, and bad input (a
// schedule that cannot run, an unknown name, malformed costs) is one "forge: error:" line.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tools/cli_harness.h"

namespace forge {
namespace {
namespace fs = std::filesystem;
using testing::cli::expect_one_line_error;
using testing::cli::Outcome;
using testing::cli::read_file;
using testing::cli::run_forge;

struct Row {
  int rank = -1;
  double busy = 0, idle = 0, bubble_percent = 0;
  int peak = 0;
};

// The rows of the table after its "rank busy idle bubble ..." header.
std::vector<Row> table_of(const std::string& output) {
  std::vector<Row> rows;
  std::istringstream in(output);
  std::string line;
  bool in_table = false;
  while (std::getline(in, line)) {
    if (line.find("rank") != std::string::npos && line.find("bubble") != std::string::npos) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    std::istringstream fields(line);
    Row r;
    char percent = 0;
    if (!(fields >> r.rank >> r.busy >> r.idle >> r.bubble_percent >> percent >> r.peak) || percent != '%')
      break;
    rows.push_back(r);
  }
  return rows;
}

class PlanCli : public testing::cli::ScratchDirTest {};

TEST_F(PlanCli, OneFOneBIdles21OnEveryRankAtPp8With16MicroBatches) {
  const Outcome o = run_forge("plan schedule --schedule 1f1b --pp 8 --microbatches 16");
  ASSERT_EQ(o.status, 0) << o.output;
  const std::vector<Row> rows = table_of(o.output);
  ASSERT_EQ(rows.size(), 8u) << o.output;
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(rows[r].rank, r);
    EXPECT_EQ(rows[r].idle, 21) << o.output;
    EXPECT_EQ(rows[r].busy, 48) << o.output;  // 16 x (F + B)
    EXPECT_NEAR(rows[r].bubble_percent, 100.0 * 21 / 69, 0.05);
  }
  EXPECT_EQ(rows[0].peak, 8);  // 1F1B: rank r holds P - r micro-batches
  EXPECT_EQ(rows[7].peak, 1);
  EXPECT_NE(o.output.find("makespan 69"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("rank 0: F0 F1 F2 F3 F4 F5 F6 F7 B0 F8"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("send"), std::string::npos);
}

TEST_F(PlanCli, CommAndCostsChangeWhatIsListedAndTimed) {
  const Outcome comm = run_forge("plan schedule --schedule 1f1b --pp 2 --microbatches 2 --comm");
  ASSERT_EQ(comm.status, 0) << comm.output;
  EXPECT_NE(comm.output.find("rank 0: F0 sendA0>1"), std::string::npos) << comm.output;
  // ZB-H1 at P = 8: (P-1)(F+B-2W) = 7 under unit costs.
  const Outcome zb = run_forge("plan schedule --schedule zb-h1 --pp 8 --microbatches 16");
  ASSERT_EQ(zb.status, 0) << zb.output;
  for (const Row& r : table_of(zb.output)) EXPECT_EQ(r.idle, 7) << zb.output;
  const Outcome dual =
      run_forge("plan schedule --schedule dualpipe --pp 4 --microbatches 8 --costs 1,1,1,2.5");
  ASSERT_EQ(dual.status, 0) << dual.output;
  EXPECT_NE(dual.output.find("F&B 2.5"), std::string::npos) << dual.output;
  EXPECT_EQ(table_of(dual.output).size(), 4u) << dual.output;
}

TEST_F(PlanCli, SvgAndTraceWriteTheirFiles) {
  const std::string svg = path("zbv.svg"), trace = path("zbv.json");
  const Outcome o =
      run_forge("plan schedule --schedule zbv --pp 4 --microbatches 8 --svg " + svg + " --trace " + trace);
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("wrote " + svg), std::string::npos) << o.output;
  const std::string picture = read_file(svg);
  EXPECT_EQ(picture.rfind("<svg ", 0), 0u) << picture.substr(0, 200);
  EXPECT_NE(picture.find("zbv: pp 4, 8 micro-batches, makespan"), std::string::npos);
  EXPECT_NE(picture.find("bubble"), std::string::npos);
  const nlohmann::json events = nlohmann::json::parse(read_file(trace))["traceEvents"];
  int complete = 0;
  for (const auto& e : events) complete += e["ph"] == "X" && e["cat"] == "forward";
  EXPECT_EQ(complete, 4 * 8 * 2);  // every micro-batch's F on both chunks of every rank
}

TEST_F(PlanCli, BadInputIsOneLine) {
  expect_one_line_error("plan schedule --schedule dualpipe --pp 3 --microbatches 12", "even pp");
  expect_one_line_error("plan schedule --schedule zigzag --pp 4 --microbatches 8",
                        "known: 1f1b, interleaved, zb-h1, zbv, dualpipe, dualpipev");
  expect_one_line_error("plan schedule --schedule zbv --pp 4 --microbatches 4", "at least 2 * pp = 8");
  expect_one_line_error("plan schedule --schedule 1f1b --pp 4 --microbatches 8 --costs 1,x,1",
                        "--costs '1,x,1'");
  expect_one_line_error("plan schedule --schedule 1f1b --pp 4 --microbatches 8 --costs 1,1", "--costs '1,1'");
  expect_one_line_error("plan schedule --schedule 1f1b --pp 4 --microbatches 8 --costs 1,1,-1", "--costs");
  expect_one_line_error("plan schedule --schedule 1f1b --pp 4", "--microbatches");
  expect_one_line_error("plan", "schedule");
  // Nothing is printed before an unwritable file's error.
  testing::cli::RunOptions apart;
  apart.stderr_to = testing::cli::Stderr::apart;
  apart.scratch_dir = dir_;
  expect_one_line_error(
      "plan schedule --schedule 1f1b --pp 2 --microbatches 2 --svg " + path("no/such/dir.svg"),
      "no/such/dir.svg", apart);
}

TEST_F(PlanCli, HelpExplainsTheOptions) {
  const Outcome plan = run_forge("plan --help");
  EXPECT_EQ(plan.status, 0);
  EXPECT_NE(plan.output.find("schedule"), std::string::npos) << plan.output;
  const Outcome o = run_forge("plan schedule --help");
  EXPECT_EQ(o.status, 0);
  for (const char* option : {"--schedule", "--pp", "--microbatches", "--vpp", "--svg", "--trace", "--comm",
                             "--costs", "--latency", "dualpipev"})
    EXPECT_NE(o.output.find(option), std::string::npos) << option << "\n" << o.output;
}

}  // namespace
}  // namespace forge
