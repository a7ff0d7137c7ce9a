// forge plan schedule, run as the real binary: the per-rank table meets the 1F1B oracle (idle (P-1)(F+B) =
// 21 on every rank at P = 8, 16 micro-batches), --svg and --trace write their files, and bad input (a
// schedule that cannot run, an unknown name, malformed costs) is one "forge: error:" line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "forge/sim/hardware.h"
#include "tools/cli_harness.h"

namespace forge::plan_cli_test {
namespace {
namespace fs = std::filesystem;
using testing::cli::expect_one_line_error;
using testing::cli::Outcome;
using testing::cli::read_file;
using testing::cli::run_forge;
using testing::cli::under_mpirun;

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

class PlanCli : public testing::cli::ScratchDirTest {
 protected:
  // `args` with a device far too small for any model: exit status 2 and a line saying it does not fit.
  void expect_does_not_fit(const std::string& args) const {
    const std::string tiny = write("tiny.toml",
                                   "[hardware]\nname = \"tiny\"\nmemory_gib = 0.001\nbf16_tflops = 1\n"
                                   "memory_bandwidth_gbs = 10\n[link.node]\nbandwidth_gbs = 1\n");
    const Outcome over = run_forge(args + " --hardware " + tiny);
    EXPECT_EQ(over.status, 2) << over.output;
    EXPECT_NE(over.output.find("does not fit"), std::string::npos) << over.output;
  }
};

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
  // --pairs: the interleaved schedule with expert parallelism's overlapped pairs, shorter when they overlap.
  const std::string interleaved =
      "plan schedule --schedule interleaved --pp 4 --vpp 2 --microbatches 16 --costs 1,1,1,2.5";
  const Outcome plain = run_forge(interleaved), paired = run_forge(interleaved + " --pairs");
  ASSERT_EQ(plain.status, 0) << plain.output;
  ASSERT_EQ(paired.status, 0) << paired.output;
  EXPECT_EQ(plain.output.find("+B"), std::string::npos) << plain.output;
  EXPECT_NE(paired.output.find("+B"), std::string::npos) << paired.output;
  EXPECT_NE(plain.output.find("makespan 105,"), std::string::npos) << plain.output;
  EXPECT_NE(paired.output.find("makespan 99,"), std::string::npos) << paired.output;
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

// --costs-from: a run's measured timeline (as log.profile_step writes it) gives per-stage costs. Here 1F1B
// on 2 ranks, 2 micro-batches, stage 1's forward 3 ms, everything else 1 ms (F) or 2 ms (B): the replay
// under those costs is 1 + 3 + 2 + 3 + 2 + 2 = 13 ms, where the traced step took 14.
TEST_F(PlanCli, CostsFromAMeasuredTrace) {
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < 2; ++r)
    events.push_back(
        {{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"name", "pp rank"}}}});
  auto x = [&](int rank, const char* op, int mb, double ts_ms, double dur_ms) {
    events.push_back({{"name", op},
                      {"cat", op},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", rank},
                      {"ts", ts_ms * 1000},
                      {"dur", dur_ms * 1000},
                      {"args", {{"chunk", 0}, {"micro_batch", mb}}}});
  };
  x(0, "forward", 0, 0, 1), x(0, "forward", 1, 1, 1), x(0, "backward", 0, 6, 2), x(0, "backward", 1, 12, 2);
  x(1, "forward", 0, 1, 3), x(1, "backward", 0, 4, 2), x(1, "forward", 1, 6, 3), x(1, "backward", 1, 10, 2);
  const std::string trace = path("pipeline_trace.json");
  {
    std::ofstream out(trace);
    out << nlohmann::json{{"traceEvents", events}}.dump();
  }
  const Outcome o = run_forge("plan schedule --schedule 1f1b --pp 2 --microbatches 2 --costs-from " + trace);
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("stage 0: 1.000 / 1.000 / 1.000 / 2.000 / F + B"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("stage 1: 3.000 / 1.000 / 1.000 / 2.000 / F + B"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("the traced step took 14.000 ms; replayed under its costs: 13.000 ms"),
            std::string::npos)
      << o.output;
  // A schedule with I and W cannot take its costs from a trace without them; the wrong pp is named.
  expect_one_line_error("plan schedule --schedule zb-h1 --pp 2 --microbatches 2 --costs-from " + trace,
                        "no backward_input and backward_weight times of stage 0");
  expect_one_line_error("plan schedule --schedule 1f1b --pp 4 --microbatches 4 --costs-from " + trace,
                        "the trace has 2 pipeline ranks, --pp is 4");
  expect_one_line_error(
      "plan schedule --schedule 1f1b --pp 2 --microbatches 2 --costs 1,1,1 --costs-from " + trace,
      "give one of them");
}

TEST_F(PlanCli, BadInputIsOneLine) {
  expect_one_line_error("plan schedule --schedule dualpipe --pp 3 --microbatches 12", "even pp");
  expect_one_line_error("plan schedule --schedule 1f1b --pp 2 --microbatches 4 --pairs", "--pairs");
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

// The simulator's commands: estimate prints memory and time part by part (exit 2 when it does not fit, saying
// by how much), search ranks strategies and prints the --set line, and bad input is one line each.
TEST_F(PlanCli, EstimateAndSearchAModelOnShippedHardware) {
  const std::string model = std::string(FORGE_FIXTURE_DIR) + "/../../configs/llama-default.json";
  const Outcome e = run_forge(
      "plan estimate --hardware h100 --set model.config=" + model +
      " --set data.seq_len=128 --set parallel.tp=2 --set parallel.pp=2 --set train.grad_accum=4 --ranks 4");
  EXPECT_EQ(e.status, 0) << e.output;
  for (const char* part :
       {"memory per device", "activations (", "time per step", "pipeline bubble", "tensor-parallel comm"})
    EXPECT_NE(e.output.find(part), std::string::npos) << part << "\n" << e.output;
  // train.dtype = auto plans bf16 on a GPU whatever this machine's CPU would pick for itself.
  EXPECT_NE(e.output.find("precision: bf16 GEMMs, bf16 activations, bf16 residual stream, fp32 gradient"),
            std::string::npos)
      << e.output;
  const Outcome s = run_forge("plan search --hardware h100 --model " + model +
                              " --global-batch 16 --seq-len 128 --ranks 4 --top 3");
  EXPECT_EQ(s.status, 0) << s.output;
  EXPECT_NE(s.output.find("train with the best: forge train"), std::string::npos) << s.output;
  EXPECT_NE(s.output.find("--set parallel.tp="), std::string::npos) << s.output;
  // A dense model: no expert parallelism tried, nothing refused.
  EXPECT_NE(s.output.find(", 0 refused"), std::string::npos) << s.output;
  // More than eight GPUs of a shipped profile: nodes of eight, unless told otherwise.
  const std::string sixteen = "plan estimate --hardware h100 --set model.config=" + model +
                              " --set data.seq_len=128 --set parallel.dp=16";
  const Outcome n = run_forge(sixteen);
  EXPECT_EQ(n.status, 0) << n.output;
  EXPECT_NE(n.output.find("8 device(s) per node x 2 node(s)"), std::string::npos) << n.output;
  const Outcome one = run_forge(sixteen + " --devices-per-node 16");
  EXPECT_NE(one.output.find("16 device(s) per node x 1 node(s)"), std::string::npos) << one.output;
  // A profile too small for the model: exit status 2 and what dominates.
  expect_does_not_fit("plan estimate --set model.config=" + model);
}

// The search lays out a mixture-of-experts model with expert parallelism too (each divisor of dp x cp that
// divides the routed experts), and its --set lines say so.
TEST_F(PlanCli, SearchTriesExpertParallelism) {
  const std::string model = std::string(FORGE_FIXTURE_DIR) + "/../../configs/deepseek-v3-tiny.json";
  const Outcome s = run_forge("plan search --hardware h100 --model " + model +
                              " --global-batch 4 --seq-len 64 --ranks 4 --top 1000");
  ASSERT_EQ(s.status, 0) << s.output;
  EXPECT_NE(s.output.find(" ep2 "), std::string::npos) << s.output;
  EXPECT_NE(s.output.find(" ep4 "), std::string::npos) << s.output;
  EXPECT_NE(s.output.find(" dualpipe "), std::string::npos) << s.output;
  // Four stages of its six layers: placed unevenly, and the --set line would place them so.
  EXPECT_NE(s.output.find("pp4 dp1 1f1b uneven"), std::string::npos) << s.output;
}

// LLaMA-3-8B (32 layers, sequence 8192) on one H100: without optimizer offload nothing fits (18 bytes per
// parameter before activations), so the search picks offload with recompute where it must, and its estimate
// says where the state went and what the copies and the host's update cost.
TEST_F(PlanCli, SearchOffloadsTheOptimizerWhereNothingElseFits) {
  const std::string model = std::string(FORGE_FIXTURE_DIR) + "/../../bench/sim/published/llama3-8b.json";
  const Outcome s = run_forge("plan search --hardware h100 --model " + model +
                              " --global-batch 8 --seq-len 8192 --ranks 1 --top 3");
  ASSERT_EQ(s.status, 0) << s.output;
  EXPECT_NE(s.output.find("   1  tp1 pp1 dp1 mb1x8 rc:"), std::string::npos) << s.output;
  EXPECT_NE(s.output.find("--set train.optimizer_offload=true"), std::string::npos) << s.output;
  const std::string estimate = "plan estimate --set model.config=" + model +
                               " --set data.seq_len=8192 --set train.grad_accum=8 --set train.recompute=full";
  const Outcome whole = run_forge(estimate + " --hardware h100");
  EXPECT_EQ(whole.status, 2) << whole.output;
  const Outcome e = run_forge(estimate + " --hardware h100 --set train.optimizer_offload=true");
  EXPECT_EQ(e.status, 0) << e.output;
  for (const char* part : {"(offloaded: host memory per device", "optimizer offload ", "rc:full offload"})
    EXPECT_NE(e.output.find(part), std::string::npos) << part << "\n" << e.output;
  // A profile that does not describe the host behind its devices cannot offload: one line.
  const std::string hostless = write("hostless.toml",
                                     "[hardware]\nname = \"hostless\"\nmemory_gib = 80\nbf16_tflops = 1\n"
                                     "memory_bandwidth_gbs = 10\n[link.node]\nbandwidth_gbs = 1\n");
  expect_one_line_error(estimate + " --hardware " + hostless + " --set train.optimizer_offload=true",
                        "optimizer offload needs the host behind each device");
}

// Generation on one device: weights, KV cache and the prefill's transient, prefill and decode times; a
// device too small says so with exit status 2; a request the model cannot run is one line.
TEST_F(PlanCli, GenerationOnOneDevice) {
  const std::string model = std::string(FORGE_FIXTURE_DIR) + "/../../configs/llama-default.json";
  const Outcome g =
      run_forge("plan generate --hardware h100 --model " + model + " --prompt 100 --new-tokens 28 --batch 4");
  EXPECT_EQ(g.status, 0) << g.output;
  for (const char* part : {"generation: batch 4, prompt 100 tokens, 28 new tokens, bf16 weights",
                           "KV cache (127 positions)", "largest transient", "prefill", "per step"})
    EXPECT_NE(g.output.find(part), std::string::npos) << part << "\n" << g.output;
  expect_does_not_fit("plan generate --model " + model);
  expect_one_line_error("plan generate --hardware h100 --model " + model + " --prompt 0", "prompt 0");
  expect_one_line_error("plan generate --hardware h100 --model " + model + " --prompt 100000", "positions");
  expect_one_line_error("plan generate --hardware h100 --model " + model + " --dtype fp8", "fp8");
}

// The trainer's own prediction from a profile calibrated here: its peak memory is the run's to within a
// fraction of a percent (memory is deterministic on the CPU; time is not, and is not asserted). The
// vocabulary spans several of the CPU loss head's 2048-column chunks, whose workspace a GPU-shaped trace
// would overstate.
TEST_F(PlanCli, CalibratedPredictionMatchesTheRunsPeakMemory) {
  std::string corpus;
  for (int i = 0; i < 300; ++i) corpus += "In the beginning was the word " + std::to_string(i % 7) + ".\n";
  std::ofstream(path("corpus.txt")) << corpus;
  std::ofstream(path("model.json"))
      << R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "vocab_size": 5000, "max_position_embeddings": 64})";
  const Outcome c = run_forge("plan calibrate --model " + path("model.json") +
                              " --seq-len 32 --micro-batch 2 --tp 1 --recompute none --repeats 1 --out " +
                              path("cpu.toml"));
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("us of host work per op call"), std::string::npos) << c.output;
  const Outcome t = run_forge(
      "train --set model.config=" + path("model.json") + " --set data.corpus=" + path("corpus.txt") +
      " --set data.tokenizer=bytes --set data.seq_len=32 --set train.micro_batch=2 --set train.steps=4" +
      " --set train.warmup=1 --set eval.every=0 --set sample.tokens=0 --set checkpoint.every=0" +
      " --set data.heldout_fraction=0.05 --set log.run_dir=" + path("run") +
      " --set log.hardware_profile=" + path("cpu.toml"));
  ASSERT_EQ(t.status, 0) << t.output;
  EXPECT_NE(t.output.find("plan vs run"), std::string::npos) << t.output;
  std::ifstream metrics(path("run") + "/metrics.jsonl");
  std::string line;
  bool checked = false;
  while (std::getline(metrics, line)) {
    const nlohmann::json r = nlohmann::json::parse(line);
    if (r.value("event", "") != "prediction_check") continue;
    const double predicted = r.at("memory_bytes_predicted").get<double>(),
                 measured = r.at("memory_bytes_measured").get<double>();
    EXPECT_NEAR(predicted / measured, 1.0, 0.005) << line;
    checked = true;
  }
  EXPECT_TRUE(checked) << "no prediction_check event in metrics.jsonl";
}

// Two ranks at once: calibrate also times the link between them and how much of an overlapped all-reduce
// the computing thread pays for (MPI progresses it on that thread); the profile it writes says both and reads
// back.
TEST_F(PlanCli, CalibratesTheLinkUnderMpirun) {
  std::ofstream(path("model.json"))
      << R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 64})";
  const Outcome c = run_forge("plan calibrate --model " + path("model.json") +
                                  " --seq-len 32 --micro-batch 2 --tp 1 --recompute none --repeats 1 --out " +
                                  path("cpu2.toml"),
                              under_mpirun(2));
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("of an overlapped all-reduce taken from the compute"), std::string::npos)
      << c.output;
  const sim::HardwareProfile h = sim::HardwareProfile::read(path("cpu2.toml"));
  EXPECT_GT(h.node.bandwidth_gbs, 0);
  EXPECT_GT(h.node.async_bandwidth_gbs, 0);
  EXPECT_GE(h.node.host_share, 0);
  EXPECT_LE(h.node.host_share, 1);
  EXPECT_EQ(h.network, h.node);
  EXPECT_NE(read_file(path("cpu2.toml")).find("under mpirun -np 2"), std::string::npos);
}

TEST_F(PlanCli, SimulatorRefusesBadInput) {
  const std::string model = std::string(FORGE_FIXTURE_DIR) + "/../../configs/llama-default.json";
  expect_one_line_error("plan estimate --hardware no-such-gpu --set model.config=" + model, "no-such-gpu");
  expect_one_line_error("plan estimate --set model.config=" + model, "--hardware");
  expect_one_line_error(
      "plan estimate --hardware h100 --set parallel.tp=3 --set model.config=" + model + " --ranks 3",
      "parallel.tp = 3");
  expect_one_line_error("plan search --hardware h100 --model " + model + " --global-batch 0 --seq-len 128",
                        "--global-batch");
  const std::string bad = path("bad.toml");
  std::ofstream(bad) << "[hardware]\nname = \"x\"\nmemory_gib = 1\nbf16_tflop = 1\n";
  expect_one_line_error("plan estimate --hardware " + bad + " --set model.config=" + model, "bf16_tflop");
  expect_one_line_error(
      "plan calibrate --model " + model + " --seq-len 64 --recompute sometimes --out " + path("p.toml"),
      "sometimes");
  expect_one_line_error(
      "plan calibrate --model " + model + " --seq-len 64 --capacity-factor 1,-2 --out " + path("p.toml"),
      "--capacity-factor");
}

}  // namespace
}  // namespace forge::plan_cli_test
