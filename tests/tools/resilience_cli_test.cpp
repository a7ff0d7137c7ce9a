// The faults that end a process, end to end through the real binaries (docs/resilience.md, the fault
// matrix): a rank killed with SIGKILL, an exception on one rank of an mpirun job, a rank that stops
// responding. Each ends the job promptly (never a hang past parallel.timeout_s), and `forge launch`
// restarts it from the newest valid checkpoint: the restarted run ends on the uninterrupted run's final
// checkpoint, byte for byte (the same layout resumes exactly), and launch says why it restarted.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "tools/cli_harness.h"

namespace forge::testing::cli::resilience_cli_test {
using namespace forge::ckpt;
namespace {

constexpr int kSteps = 6;

class ResilienceCli : public ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    std::string corpus;
    for (int i = 0; i < 200; ++i)
      corpus += "And the evening and the morning were the day " + std::to_string(i % 9) + ".\n";
    write("corpus.txt", corpus);
    write("config.json", R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64})");
  }

  // forge train's arguments: kSteps steps, a checkpoint after each (all kept), into run directory `run`.
  std::string train_args(const std::string& run, const std::string& extra = "") const {
    return "train --set model.config=" + path("config.json") + " --set data.corpus=" + path("corpus.txt") +
           " --set data.tokenizer=bytes --set data.seq_len=32 --set train.micro_batch=2 --set train.steps=" +
           std::to_string(kSteps) + " --set train.warmup=1 --set eval.every=0 --set eval.batches=1" +
           " --set data.heldout_fraction=0.02 --set log.peak_gflops=100 --set sample.tokens=0" +
           " --set train.dtype=fp32 --set checkpoint.every=1 --set checkpoint.keep_last=0" +
           " --set checkpoint.resume=auto --set parallel.timeout_s=10 --set log.every=1 --set log.run_dir=" +
           path(run) + extra;
  }

  static std::string environment(const std::string& fault) {
    return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 FORGE_FAULT='" +
           fault + "'";
  }

  // `forge train` under `launcher` (empty, or mpirun ...), with `fault` injected; the seconds it took.
  std::pair<Outcome, double> train(const std::string& run, const std::string& launcher,
                                   const std::string& fault, const std::string& extra = "") const {
    RunOptions options;
    options.environment = environment(fault);
    options.launcher = launcher;
    const auto start = std::chrono::steady_clock::now();
    Outcome out = run_forge(train_args(run, extra), options);
    return {out, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
  }

  // `forge launch [launch_args] -- launcher forge train ...`, with `fault` injected.
  Outcome launch(const std::string& run, const std::string& launch_args, const std::string& launcher,
                 const std::string& fault, const std::string& extra = "") const {
    RunOptions options;
    options.environment = environment(fault);
    return run_forge("launch --restart-delay 0 " + launch_args + " -- " + launcher +
                         (launcher.empty() ? "" : " ") + forge_binary() + " " + train_args(run, extra),
                     options);
  }

  // Each step's loss in `run`'s metrics.jsonl (a resumed run drops the records past its checkpoint first,
  // so each step appears once).
  std::map<int64_t, double> losses(const std::string& run) const {
    std::map<int64_t, double> out;
    std::ifstream in(path(run) + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss") && !j.contains("event")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
    }
    return out;
  }

  // The final checkpoint of `run` is the reference run's, shard for shard, byte for byte, and so is every
  // step's loss.
  void expect_final_equals(const std::string& run, const std::string& reference, int world) const {
    EXPECT_EQ(losses(run), losses(reference)) << run;
    EXPECT_EQ(losses(run).size(), static_cast<size_t>(kSteps)) << run;
    const std::string got = resolve_checkpoint(path(run) + "/checkpoint").dir;
    const std::string want = resolve_checkpoint(path(reference) + "/checkpoint").dir;
    EXPECT_EQ(read_checkpoint_manifest(got).step, kSteps);
    for (int r = 0; r < world; ++r) {
      const std::string shard = fmt::format("/{}", shard_file_name(r, world));
      EXPECT_EQ(read_file(got + shard), read_file(want + shard)) << run << shard;
    }
  }
};

// A fault spec that does not parse is one line naming where it came from, before anything runs.
TEST_F(ResilienceCli, BadFaultSpecsAreOneLine) {
  RunOptions env;
  env.environment = "FORGE_FAULT='nan_los step=3'";
  expect_one_line_error(
      train_args("bad"),
      "FORGE_FAULT: fault 1 'nan_los step=3': unknown kind 'nan_los'; did you mean 'nan_loss'?", env);
  expect_one_line_error(train_args("bad", " --set 'resilience.inject=kill rank=1'"),
                        "resilience.inject: fault 1 'kill rank=1': step=<k> is missing");
  EXPECT_FALSE(fs::exists(path("bad") + "/checkpoint"));
}

// One process killed at step 4: launch restarts it, it resumes from step 3, and ends bit for bit on the
// uninterrupted run; a hang (with launch's heartbeat watch) likewise.
TEST_F(ResilienceCli, OneProcessKilledOrHungIsRestartedAndResumesExactly) {
  const auto [reference, unused] = train("ref", "", "");
  ASSERT_EQ(reference.status, 0) << reference.output;

  const Outcome killed = launch("killed", "--max-restarts 2", "", "kill step=4");
  ASSERT_EQ(killed.status, 0) << killed.output;
  EXPECT_NE(killed.output.find("fault injection: kill at step 4: SIGKILL"), std::string::npos)
      << killed.output;
  EXPECT_NE(killed.output.find("forge launch: restart 1 of 2"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("signal 9"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("resumed from"), std::string::npos) << killed.output;
  expect_final_equals("killed", "ref", 1);

  const Outcome hung =
      launch("hung", "--max-restarts 2 --heartbeat " + path("hung/heartbeat") + " --stall-timeout 3", "",
             "hang step=4");
  ASSERT_EQ(hung.status, 0) << hung.output;
  EXPECT_NE(hung.output.find("fault injection: hang at step 4: this rank stops responding"),
            std::string::npos)
      << hung.output;
  EXPECT_NE(hung.output.find("no heartbeat"), std::string::npos) << hung.output;
  expect_final_equals("hung", "ref", 1);
}

// Under mpirun (tensor parallel over 2 ranks): rank 1 killed, rank 1 throwing, rank 1 hanging. Each job ends
// on its own well within a minute (mpirun notices a dead rank at once; a hung one leaves the other to abort
// past parallel.timeout_s = 10 s), and each relaunched job ends on the uninterrupted run's checkpoint.
TEST_F(ResilienceCli, RankFaultsUnderMpirunEndTheJobAndLaunchRestartsItExactly) {
  const std::string tp2 = " --set parallel.tp=2";
  const auto [reference, unused] = train("ref", mpirun_launcher(2), "", tp2);
  ASSERT_EQ(reference.status, 0) << reference.output;

  // Without launch: the job ends by itself, with one line saying why.
  const auto [killed, killed_s] = train("killed", mpirun_launcher(2), "kill step=3 rank=1", tp2);
  EXPECT_NE(killed.status, 0) << killed.output;
  EXPECT_LT(killed_s, 60) << killed.output;
  const auto [thrown, thrown_s] = train("thrown", mpirun_launcher(2), "throw step=3 rank=1", tp2);
  EXPECT_NE(thrown.status, 0) << thrown.output;
  EXPECT_NE(thrown.output.find("throw at step 3 on rank 1: injected exception"), std::string::npos)
      << thrown.output;
  EXPECT_LT(thrown_s, 60) << thrown.output;
  const auto [hung, hung_s] = train("hung", mpirun_launcher(2), "hang step=3 rank=1", tp2);
  EXPECT_NE(hung.status, 0) << hung.output;
  EXPECT_NE(hung.output.find("did not complete within 10"), std::string::npos) << hung.output;
  EXPECT_LT(hung_s, 60) << hung.output;

  // With launch: each is restarted from the newest checkpoint and finishes exactly.
  for (const char* fault : {"kill step=4 rank=1", "throw step=4 rank=1", "hang step=4 rank=1"}) {
    const std::string run = std::string("launched-") + std::string(fault).substr(0, 4);
    const Outcome out = launch(run, "--max-restarts 1", mpirun_launcher(2), fault, tp2);
    ASSERT_EQ(out.status, 0) << fault << "\n" << out.output;
    EXPECT_NE(out.output.find("forge launch: restart 1 of 1"), std::string::npos) << fault << "\n"
                                                                                  << out.output;
    EXPECT_NE(out.output.find("resumed from"), std::string::npos) << fault << "\n" << out.output;
    expect_final_equals(run, "ref", 2);
  }
}

// Four ranks, tensor x data parallel with ZeRO-1: the last rank killed mid-run, the job restarted by launch,
// and the run ends on the uninterrupted run's losses and checkpoint, byte for byte.
TEST_F(ResilienceCli, KilledRankUnderTensorAndDataParallelResumesExactly) {
  const std::string layout = " --set parallel.tp=2 --set parallel.distributed_optimizer=true";
  const auto [reference, unused] = train("ref", mpirun_launcher(4), "", layout);
  ASSERT_EQ(reference.status, 0) << reference.output;
  const Outcome out = launch("killed", "--max-restarts 1", mpirun_launcher(4), "kill step=4 rank=3", layout);
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("forge launch: restart 1 of 1"), std::string::npos) << out.output;
  expect_final_equals("killed", "ref", 4);
}

}  // namespace
}  // namespace forge::testing::cli::resilience_cli_test
