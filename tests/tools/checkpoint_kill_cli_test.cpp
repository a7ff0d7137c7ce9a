// Killing `forge train` at any moment never loses the last good checkpoint: SIGKILL at every step of a save
// (FORGE_TEST_KILL_AT, core/fault_injection.h) and at random moments, in one process and under mpirun.
// After each kill, the newest checkpoint that loads is complete and byte-identical to the uninterrupted
// run's checkpoint of the same step, and `checkpoint.resume=auto` continues from it to the uninterrupted
// run's final weights, bit for bit.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "tools/cli_harness.h"

namespace forge::testing::cli::checkpoint_kill_cli_test {
using namespace forge::ckpt;
namespace {

constexpr int kSteps = 5;

class CheckpointKill : public ScratchDirTest {
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

  // Trains kSteps steps, a checkpoint after each, into run directory `run`.
  std::string train_args(const std::string& run, const std::string& extra = "") const {
    return "train --set model.config=" + path("config.json") + " --set data.corpus=" + path("corpus.txt") +
           " --set data.tokenizer=bytes --set data.seq_len=32 --set train.micro_batch=2 --set train.steps=" +
           std::to_string(kSteps) + " --set train.warmup=1 --set eval.every=0 --set eval.batches=1" +
           " --set data.heldout_fraction=0.02 --set log.peak_gflops=100 --set sample.tokens=0" +
           " --set checkpoint.every=1 --set checkpoint.keep_last=2 --set log.run_dir=" + path(run) + extra;
  }

  // The command line of `forge train` under `launcher` (empty, or mpirun ...). FORGE_TEST_JOB marks every
  // process of the job (the variable is inherited), so that job_processes() finds even ranks whose launcher
  // died.
  std::string command(const std::string& args, const std::string& env, const std::string& launcher) const {
    return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 FORGE_TEST_JOB=" +
           job_tag() + " " + env + " " + launcher + (launcher.empty() ? "" : " ") + forge_binary() + " " +
           args + " > " + path("log.txt") + " 2>&1";
  }

  std::string job_tag() const { return dir_.filename().string(); }

  // The live processes of this test's jobs (the shell, mpirun, the ranks): those whose environment holds
  // FORGE_TEST_JOB=job_tag(). A zombie has no environment left, so it is not counted.
  std::vector<pid_t> job_processes() const {
    const std::string mark = std::string(1, '\0') + "FORGE_TEST_JOB=" + job_tag() + '\0';
    std::vector<pid_t> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
      const std::string name = entry.path().filename().string();
      if (name.empty() || !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; }))
        continue;
      const pid_t pid = static_cast<pid_t>(std::stol(name));
      if (pid == getpid()) continue;
      if (('\0' + read_file(entry.path() / "environ")).find(mark) != std::string::npos) out.push_back(pid);
    }
    return out;
  }

  // Waits up to `limit` for every process of this test's jobs to end by itself.
  bool job_ends_within(std::chrono::seconds limit) const {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!job_processes().empty()) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  // SIGKILLs every process of this test's jobs until none is left: the checks read the run directory only
  // once nothing of the job can still write to it.
  void kill_job() const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (std::vector<pid_t> left = job_processes(); !left.empty(); left = job_processes()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        ADD_FAILURE() << left.size() << " processes of the job survive SIGKILL";
        return;
      }
      for (const pid_t pid : left) kill(pid, SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Runs `forge train` in its own process group; once `kill_when()` holds (if given), SIGKILLs that group,
  // which holds the shell and mpirun but no rank (OpenMPI gives each rank a process group of its own).
  // Then, unless `leave_ranks`, kills whatever of the job is left (kill_job), so that a kill is one of the
  // whole job. Returns the exit status (128 + signal when killed) and the seconds it ran.
  std::pair<int, double> run_train(const std::string& cmd, const std::function<bool()>& kill_when,
                                   bool leave_ranks = false) {
    const auto start = std::chrono::steady_clock::now();
    const pid_t pid = fork();
    if (pid == 0) {
      setpgid(0, 0);
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    setpgid(pid, pid);
    int status = 0;
    if (kill_when) {
      while (waitpid(pid, &status, WNOHANG) == 0) {
        if (kill_when()) {
          killpg(pid, SIGKILL);
          waitpid(pid, &status, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } else {
      waitpid(pid, &status, 0);
    }
    killpg(pid, SIGKILL);
    if (!leave_ranks) kill_job();  // no rank outlives its job
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), seconds};
  }

  std::pair<int, double> run_train(const std::string& cmd,
                                   std::optional<std::chrono::microseconds> kill_after) {
    if (!kill_after) return run_train(cmd, std::function<bool()>());
    const auto deadline = std::chrono::steady_clock::now() + *kill_after;
    return run_train(cmd, [deadline] { return std::chrono::steady_clock::now() >= deadline; });
  }

  // The reference: an uninterrupted run keeping every step's checkpoint.
  double train_reference(const std::string& launcher) {
    const auto [status, seconds] =
        run_train(command(train_args("ref", " --set checkpoint.keep_last=0"), "", launcher), std::nullopt);
    EXPECT_EQ(status, 0) << read_file(path("log.txt"));
    return seconds;
  }

  // What a kill left in `run` must be a complete checkpoint equal to the reference's of its step (or
  // nothing), and resuming from it must end on the reference's final files.
  void check_after_kill(const std::string& run, int world, const std::string& launcher,
                        const std::string& what, std::optional<int64_t> expected_step = std::nullopt) {
    const std::string root = path(run) + "/checkpoint";
    const std::optional<int64_t> step = latest_checkpoint_step(root);
    if (expected_step) {
      EXPECT_EQ(step.value_or(0), *expected_step) << what;
    }
    if (step) {
      const std::string dir = resolve_checkpoint(root).dir;
      EXPECT_NO_THROW(read_checkpoint_manifest(dir, /*verify_files=*/true)) << what;
      for (int r = 0; r < world; ++r) {
        const std::string shard = "/" + shard_file_name(r, world);
        EXPECT_EQ(read_file(dir + shard),
                  read_file(path("ref/checkpoint/") + checkpoint_step_name(*step) + shard))
            << what << ": step " << *step << shard;
      }
    }
    const auto [status, seconds] =
        run_train(command(train_args(run, " --set checkpoint.resume=auto"), "", launcher), std::nullopt);
    const std::string log = read_file(path("log.txt"));
    ASSERT_EQ(status, 0) << what << "\n" << log;
    if (step) {
      EXPECT_NE(log.find("resumed from"), std::string::npos) << what << "\n" << log;
    }
    const std::string final_dir = resolve_checkpoint(root).dir;
    EXPECT_EQ(read_checkpoint_manifest(final_dir).step, kSteps) << what;
    for (int r = 0; r < world; ++r) {
      const std::string shard = "/" + shard_file_name(r, world);
      EXPECT_EQ(read_file(final_dir + shard),
                read_file(path("ref/checkpoint/") + checkpoint_step_name(kSteps) + shard))
          << what << ": final " << shard;
    }
  }

  // SIGKILL at each step of a save (the n-th save of the run), then the checks above.
  // Under mpirun a rank is killed alone: rank 1 after writing its shard, rank 0 (which writes the manifest
  // and commits) at the other points.
  void kill_at_every_point(int world, const std::string& launcher) {
    struct Point {
      const char* name;
      bool committed;  // the n-th save's checkpoint is the newest complete one afterwards
    };
    const Point points[] = {{"save.shard_written", false},
                            {"save.manifest_written", false},
                            {"save.committed", false},  // renamed into place, but `latest` not yet moved
                            {"save.latest_written", true},
                            {"save.pruned", true}};
    int trial = 0;
    for (const Point& p : points)
      for (int nth : {1, 3}) {
        const std::string run = "kill" + std::to_string(trial++);
        const std::string rank = world == 1 ? "" : std::string(p.name) == "save.shard_written" ? "@1" : "@0";
        const std::string spec = std::string(p.name) + ":" + std::to_string(nth) + rank;
        const auto [status, seconds] =
            run_train(command(train_args(run), "FORGE_TEST_KILL_AT=" + spec, launcher), std::nullopt);
        EXPECT_NE(status, 0) << spec << "\n" << read_file(path("log.txt"));
        EXPECT_NE(read_file(path("log.txt")).find("killed at " + std::string(p.name)), std::string::npos)
            << spec << "\n"
            << read_file(path("log.txt"));
        // Killed after the rename but before `latest` moved: `latest` still names the previous step, and
        // with no `latest` yet (the first save) the complete step folder is the newest checkpoint.
        const bool renamed = std::string(p.name) == "save.committed";
        check_after_kill(run, world, launcher, spec, p.committed || (renamed && nth == 1) ? nth : nth - 1);
      }
  }

  // `trials` SIGKILLs of the whole job at random moments of its run.
  void kill_at_random(int trials, int world, const std::string& launcher, double reference_seconds) {
    std::mt19937 random(1234);
    std::uniform_real_distribution<double> when(0.05, 1.0);
    for (int t = 0; t < trials; ++t) {
      const std::string run = "random" + std::to_string(t);
      const auto delay =
          std::chrono::microseconds(static_cast<int64_t>(when(random) * reference_seconds * 1e6));
      run_train(command(train_args(run), "", launcher), delay);
      check_after_kill(
          run, world, launcher,
          "random kill " + std::to_string(t) + " after " + std::to_string(delay.count()) + " us");
    }
  }
};

TEST_F(CheckpointKill, OneProcessAtEveryStepOfASave) {
  train_reference("");
  kill_at_every_point(1, "");
}

TEST_F(CheckpointKill, OneProcessAtRandomMoments) {
  const double seconds = train_reference("");
  kill_at_random(24, 1, "", seconds);
}

// A save that fails (a full disk, an I/O error: FORGE_TEST_FAIL_AT injects the error where the shard or the
// manifest is written) removes its staging folder and leaves the previous checkpoint committed. A periodic
// one (written in the background) is reported in one line and training goes on to the uninterrupted run's
// final checkpoint; the final one ends the run with one error line, and resuming ends on the uninterrupted
// run's weights.
TEST_F(CheckpointKill, FailedSaveLeavesThePreviousCheckpoint) {
  train_reference("");
  int trial = 0;
  for (const char* point : {"save.write_shard:3", "save.write_manifest:3"}) {
    const std::string run = "fail" + std::to_string(trial++);
    const auto [status, seconds] =
        run_train(command(train_args(run), std::string("FORGE_TEST_FAIL_AT=") + point, ""), std::nullopt);
    const std::string log = read_file(path("log.txt"));
    EXPECT_EQ(status, 0) << point << "\n" << log;
    EXPECT_NE(log.find("checkpoint of step 3 failed: save."), std::string::npos) << log;
    EXPECT_NE(
        log.find("injected failure (FORGE_TEST_FAIL_AT); training goes on (the newest checkpoint is still "
                 "step 2)"),
        std::string::npos)
        << log;
    EXPECT_FALSE(fs::exists(path(run) + "/checkpoint/.step-00000003.partial")) << point;
    EXPECT_FALSE(fs::exists(path(run) + "/checkpoint/step-00000003")) << point;
    check_after_kill(run, 1, "", point, kSteps);
  }
  for (const char* point : {"save.write_shard:5", "save.write_manifest:5"}) {  // the final save
    const std::string run = "fail" + std::to_string(trial++);
    const auto [status, seconds] =
        run_train(command(train_args(run), std::string("FORGE_TEST_FAIL_AT=") + point, ""), std::nullopt);
    const std::string log = read_file(path("log.txt"));
    EXPECT_EQ(status, 1) << point << "\n" << log;
    EXPECT_NE(log.find("forge: error: save."), std::string::npos) << log;
    EXPECT_NE(log.find("injected failure"), std::string::npos) << log;
    EXPECT_FALSE(fs::exists(path(run) + "/checkpoint/.step-00000005.partial")) << point;
    check_after_kill(run, 1, "", point, kSteps - 1);
  }
}

// Two ranks (data parallel): each rank killed alone at each step of a save, and the whole job at random.
TEST_F(CheckpointKill, TwoRanksUnderMpirun) {
  const double seconds = train_reference(mpirun_launcher(2));
  kill_at_every_point(2, mpirun_launcher(2));
  kill_at_random(8, 2, mpirun_launcher(2), seconds);
  // One rank's periodic save fails: every rank goes on (no rank waits forever), the checkpoint of that step
  // never appears, and the run ends on the uninterrupted run's checkpoint.
  const auto [status, unused] =
      run_train(command(train_args("fail"), "FORGE_TEST_FAIL_AT=save.write_shard:2@1", mpirun_launcher(2)),
                std::nullopt);
  const std::string log = read_file(path("log.txt"));
  EXPECT_EQ(status, 0) << log;
  EXPECT_NE(log.find("checkpoint of step 2 failed: rank 1: save.write_shard: injected failure"),
            std::string::npos)
      << log;
  EXPECT_FALSE(fs::exists(path("fail") + "/checkpoint/step-00000002"));
  check_after_kill("fail", 2, mpirun_launcher(2), "failed periodic save on rank 1", kSteps);
  // Its final save fails: the job ends with the error and the previous checkpoint stays.
  const auto [final_status, unused2] = run_train(
      command(train_args("fail_final"), "FORGE_TEST_FAIL_AT=save.write_shard:5@1", mpirun_launcher(2)),
      std::nullopt);
  const std::string final_log = read_file(path("log.txt"));
  EXPECT_NE(final_status, 0) << final_log;
  EXPECT_NE(final_log.find("rank 1: save.write_shard: injected failure"), std::string::npos) << final_log;
  check_after_kill("fail_final", 2, mpirun_launcher(2), "failed final save on rank 1", kSteps - 1);
}

// Killing mpirun alone (a SIGKILL of its process group, which holds no rank) ends its ranks too. Orphaned
// ranks trained on for seconds, until OpenMPI noticed the lost launcher, committing checkpoints into the
// run directory that the job's killer was reading as the killed job's (the random kills above saw
// `latest` move after the kill). A rank held before MPI_Init (FORGE_FAULT_STALL) has no link to its
// launcher that could end it; with this parallel.timeout_s nothing else ends the job either.
TEST_F(CheckpointKill, RanksDieWithTheirKilledMpirun) {
  const std::string stalled = "rank 1 stalls at before_init";
  run_train(
      command(train_args("orphans", " --set parallel.timeout_s=600"), "FORGE_FAULT_STALL=before_init:1",
              mpirun_launcher(2)),
      [&] { return read_file(path("log.txt")).find(stalled) != std::string::npos; }, /*leave_ranks=*/true);
  EXPECT_NE(read_file(path("log.txt")).find(stalled), std::string::npos) << read_file(path("log.txt"));
  EXPECT_TRUE(job_ends_within(std::chrono::seconds(20)))
      << job_processes().size() << " processes of the job outlived mpirun by 20 s";
  kill_job();
}

}  // namespace
}  // namespace forge::testing::cli::checkpoint_kill_cli_test
