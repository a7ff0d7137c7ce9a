// `mpirun -np 2 forge train ...`: the launch path users take. A layout that does not fit the job ends
// every rank with the forge error line and a non-zero status (no hang); a tensor-parallel run logs its
// layout on rank 0 only, trains, checkpoints in shards and samples from the checkpoint read back whole.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "tools/cli_harness.h"

namespace forge::testing::cli::train_mpirun_cli_test {
namespace {

RunOptions mpirun(int ranks) {
  RunOptions o;
  o.launcher =
      std::string(FORGE_MPIEXEC) + " -np " + std::to_string(ranks) + " --oversubscribe --bind-to none";
  o.environment = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1";
  return o;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class TrainMpirun : public ScratchDirTest {
 protected:
  std::string setup() {
    std::string corpus;
    for (int i = 0; i < 200; ++i)
      corpus += "And the evening and the morning were the day " + std::to_string(i % 9) + ".\n";
    write("corpus.txt", corpus);
    write("config.json", R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64})");
    return "train --set model.config=" + path("config.json") + " --set data.corpus=" + path("corpus.txt") +
           " --set data.tokenizer=bytes --set data.seq_len=32 --set train.micro_batch=2 --set train.steps=4"
           " --set eval.every=0 --set log.peak_gflops=100 --set log.run_dir=" +
           path("run");
  }
};

TEST_F(TrainMpirun, LayoutThatDoesNotFitTheJobEndsEveryRank) {
  Outcome out = run_forge(setup() + " --set parallel.tp=3", mpirun(2));
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("forge: error: parallel layout tp=3"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("2 ranks (mpirun -np)"), std::string::npos) << out.output;
}

TEST_F(TrainMpirun, HeadsThatDoNotSplitAreRefusedBeforeAnyWork) {
  const std::string args = setup();
  write("six_heads.json", R"({"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64})");
  Outcome out =
      run_forge(args + " --set model.config=" + path("six_heads.json") + " --set parallel.tp=4", mpirun(4));
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("forge: error: parallel.tp = 4 does not divide num_attention_heads = 6"),
            std::string::npos)
      << out.output;
  EXPECT_EQ(out.output.find("step 1"), std::string::npos) << out.output;
}

// A rank stalled at MPI start-up or after the last collective (FORGE_FAULT_STALL, the test hook) ends the
// job within parallel.timeout_s, which forge train applies to MPI_Init and MPI_Finalize too, with the
// one-line message; `timeout` turns a hang into status 137.
TEST_F(TrainMpirun, StalledRankEndsTheJobWithinParallelTimeout) {
  for (const auto& [stall, message] :
       {std::pair{"before_init:1", "MPI start-up did not complete within 3 s (parallel.timeout_s"},
        std::pair{"after_last_collective:1",
                  "MPI shutdown did not complete within 3 s (parallel.timeout_s"}}) {
    SCOPED_TRACE(stall);
    RunOptions o = mpirun(2);
    o.launcher = "timeout -s KILL 90 " + o.launcher + " -x FORGE_FAULT_STALL";
    o.environment += std::string(" FORGE_FAULT_STALL=") + stall;
    Outcome out = run_forge(setup() + " --set parallel.timeout_s=3 --set sample.tokens=0", o);
    EXPECT_NE(out.status, 0) << out.output;
    EXPECT_NE(out.status, 137) << "hung until killed: " << out.output;
    EXPECT_NE(out.output.find(message), std::string::npos) << out.output;
  }
}

TEST_F(TrainMpirun, KvHeadsAreReplicatedWhenTpExceedsThem) {
  Outcome out = run_forge(setup() + " --set parallel.tp=4 --set sample.tokens=0", mpirun(4));
  EXPECT_EQ(out.status, 0) << out.output;  // 2 kv heads over 4 ranks
  EXPECT_NE(out.output.find("final held-out loss"), std::string::npos) << out.output;
}

TEST_F(TrainMpirun, TensorParallelRunLogsOnceCheckpointsInShardsAndSamples) {
  Outcome out = run_forge(setup() +
                              " --set parallel.tp=2 --set parallel.sequence_parallel=true"
                              " --set sample.tokens=8 --set log.every=2",
                          mpirun(2));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_EQ(count(out.output, "layout: world 2 = tp 2 x cp 1 x dp 1 x pp 1"), 1u) << out.output;
  EXPECT_EQ(count(out.output, "step 4/4"), 1u) << out.output;  // rank 0 alone logs
  EXPECT_NE(out.output.find("--- sample"), std::string::npos) << out.output;
  EXPECT_TRUE(fs::exists(dir_ / "run" / "checkpoint" / "step-00000004" / "shard-00000-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "run" / "checkpoint" / "step-00000004" / "shard-00001-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "run" / "checkpoint" / "step-00000004" / "manifest.json"));
  // The sharded checkpoint is an ordinary forge checkpoint for the single-process tools.
  Outcome gen =
      run_forge("generate --model " + path("run/checkpoint") + " --prompt And --max-new-tokens 4 --greedy");
  EXPECT_EQ(gen.status, 0) << gen.output;
}

// Context parallelism: each rank holds two chunks of every sequence; the run logs the split, trains,
// evaluates, checkpoints and samples from the checkpoint read back whole.
TEST_F(TrainMpirun, ContextParallelRunLogsItsSplitAndSamples) {
  Outcome out =
      run_forge(setup() + " --set parallel.cp=2 --set sample.tokens=8 --set eval.every=2", mpirun(2));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_EQ(count(out.output, "layout: world 2 = tp 1 x cp 2 x dp 1 x pp 1"), 1u) << out.output;
  EXPECT_EQ(count(out.output,
                  "context parallel 2: 16 of each sequence's 32 tokens per rank (chunks r and 3 - r "
                  "of 4), attention ring"),
            1u)
      << out.output;
  EXPECT_NE(out.output.find("final held-out loss"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("--- sample"), std::string::npos) << out.output;
}

// What context parallelism cannot split is refused before any work, with one line on every rank.
TEST_F(TrainMpirun, ContextParallelBadRequestsAreOneLineEach) {
  const std::string args = setup();
  Outcome odd = run_forge(args + " --set parallel.cp=2 --set data.seq_len=30", mpirun(2));
  EXPECT_NE(odd.status, 0) << odd.output;
  EXPECT_NE(
      odd.output.find("data.seq_len = 30 must be a multiple of 2 x parallel.cp = 4 (each rank holds two "
                      "chunks of every sequence)"),
      std::string::npos)
      << odd.output;
  Outcome heads = run_forge(args + " --set parallel.cp=4 --set parallel.cp_comm=a2a", mpirun(4));
  EXPECT_NE(heads.status, 0) << heads.output;
  EXPECT_NE(heads.output.find("parallel.cp_comm = \"a2a\" scatters attention heads over parallel.cp = 4, but "
                              "each tensor-parallel rank holds 4 heads and 2 key/value heads"),
            std::string::npos)
      << heads.output;
  for (const Outcome& o : {odd, heads}) EXPECT_EQ(o.output.find("step 1"), std::string::npos) << o.output;
}

// SIGTERM to the ranks (as a cluster's scheduler sends it to every process of a job): each finishes its step,
// the checkpoint is saved, every rank exits 130 and so does mpirun, telling an interrupted run from a failed
// one. (A signal sent to mpirun itself makes Open MPI's mpirun exit 1 whatever its ranks return; the run's
// last metrics record says "interrupted" either way.)
TEST_F(TrainMpirun, SigtermToTheRanksSavesAndExits130) {
  const std::string args = setup() + " --set train.steps=100000 --set train.max_minutes=0";
  const std::string script =
      write("interrupt.sh",
            "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 " +
                std::string(FORGE_MPIEXEC) + " -np 2 --oversubscribe --bind-to none " + forge_binary() + " " +
                args + " > " + path("log") + " 2>&1 &\nm=$!\nwhile ! grep -q '^step' " + path("log") +
                " 2>/dev/null; do sleep 0.1; done\npkill -TERM -P $m\nwait $m\necho mpirun exited $?\n");
  ASSERT_EQ(std::system(("/bin/sh " + script + " > " + path("status")).c_str()), 0);
  const std::string status = read_file(path("status")), log = read_file(path("log"));
  EXPECT_EQ(status, "mpirun exited 130\n") << log;
  EXPECT_NE(log.find("(step "), std::string::npos) << log;
  EXPECT_NE(log.find(", interrupted, "), std::string::npos) << log;
  std::string metrics = read_file(path("run") + "/metrics.jsonl");
  while (!metrics.empty() && metrics.back() == '\n') metrics.pop_back();
  const std::string last = metrics.substr(metrics.find_last_of('\n') + 1);
  EXPECT_NE(last.find("\"event\":\"end\""), std::string::npos) << last;
  EXPECT_NE(last.find("\"status\":\"interrupted\""), std::string::npos) << last;
}

}  // namespace
}  // namespace forge::testing::cli::train_mpirun_cli_test
