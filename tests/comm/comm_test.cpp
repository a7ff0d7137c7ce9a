// comm in one process: element types, the self backend (every collective against its definition, and the
// errors), requests and their timeout (the job ends with one line), the world without a launcher, and a
// two-rank job under mpirun in which one rank skips a collective.
#include "forge/comm/comm.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "comm/collective_checks.h"
#include "forge/comm/nccl/device_memory.h"
#include "forge/core/error.h"

namespace forge::comm::comm_test {
namespace {

// Sets (or, with nullptr, removes) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CommTypes, SizesAndNames) {
  EXPECT_EQ(type_size(Type::f32), 4u);
  EXPECT_EQ(type_size(Type::f64), 8u);
  EXPECT_EQ(type_size(Type::bf16), 2u);
  EXPECT_EQ(type_size(Type::i32), 4u);
  EXPECT_EQ(type_size(Type::i64), 8u);
  EXPECT_EQ(type_size(Type::u8), 1u);
  EXPECT_STREQ(type_name(Type::f32), "f32");
  EXPECT_STREQ(type_name(Type::f64), "f64");
  EXPECT_STREQ(type_name(Type::bf16), "bf16");
  EXPECT_STREQ(type_name(Type::i32), "i32");
  EXPECT_STREQ(type_name(Type::i64), "i64");
  EXPECT_STREQ(type_name(Type::u8), "u8");
  EXPECT_STREQ(reduce_op_name(ReduceOp::sum), "sum");
  EXPECT_STREQ(reduce_op_name(ReduceOp::max), "max");
  EXPECT_STREQ(reduce_op_name(ReduceOp::min), "min");
}

TEST(CommSelf, IsOneRankThatCopies) {
  std::unique_ptr<Communicator> self = make_self("solo");
  EXPECT_STREQ(self->backend(), "self");
  EXPECT_EQ(self->name(), "solo");
  EXPECT_EQ(self->rank(), 0);
  EXPECT_EQ(self->size(), 1);
  EXPECT_EQ(self->world_rank(), 0);
  EXPECT_EQ(self->timeout_seconds(), 300);
  checks::HostMemory memory;
  checks::check_every_collective(*self, memory);
  // Requests of a one-rank group are complete at once.
  float x = 3;
  Request r = self->all_reduce(&x, 1, Type::f32, ReduceOp::max);
  EXPECT_FALSE(r.pending());
  EXPECT_TRUE(r.test());
  EXPECT_EQ(x, 3);
  EXPECT_EQ(all_reduce_sum(*self, 2.5), 2.5);
  EXPECT_EQ(all_reduce_max(*self, -1.0), -1.0);
}

TEST(CommSelf, PointToPointAndBadArgumentsAreErrors) {
  std::unique_ptr<Communicator> self = make_self("solo");
  float x = 1;
  const std::string send_error = error_of([&] { self->send(&x, 1, Type::f32, 0); });
  EXPECT_NE(send_error.find("send with peer 0 on group 'solo' (rank 0 of 1, world rank 0)"),
            std::string::npos)
      << send_error;
  EXPECT_NE(send_error.find("no peer"), std::string::npos) << send_error;
  EXPECT_THROW(self->recv(&x, 1, Type::f32, 0), Error);
  const std::string root_error = error_of([&] { self->broadcast(&x, 1, Type::f32, 1); });
  EXPECT_NE(root_error.find("root 1 is not a rank of the group"), std::string::npos) << root_error;
  const std::vector<int64_t> two_counts{1, 1};
  const std::string counts_error = error_of([&] { self->all_gatherv(&x, &x, two_counts, Type::f32); });
  EXPECT_NE(counts_error.find("counts has 2 entries, expected one per rank (1)"), std::string::npos)
      << counts_error;
  EXPECT_THROW(self->all_reduce(&x, -2, Type::f32, ReduceOp::sum), Error);
  EXPECT_THROW(self->all_gather(nullptr, &x, 1, Type::f32), Error);
  const std::vector<int64_t> one{1}, zero{0}, two{2};
  EXPECT_THROW(self->all_to_allv(&x, one, zero, &x, two, zero, Type::f32), Error);  // sends 1, expects 2
}

TEST(CommSelf, SplitInheritsTheTimeout) {
  std::unique_ptr<Communicator> self = make_self("solo");
  self->set_timeout_seconds(12.5);
  std::unique_ptr<Communicator> child = self->split(3, 0, "child");
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->name(), "child");
  EXPECT_EQ(child->size(), 1);
  EXPECT_EQ(child->timeout_seconds(), 12.5);
  EXPECT_EQ(self->split(-1, 0, "none"), nullptr);
}

// A fake operation: completes after `polls` calls of test() (never, if negative).
class FakeWork final : public Work {
 public:
  explicit FakeWork(int polls) : polls_(polls) {}
  bool test() override {
    ++calls;
    return polls_ >= 0 && calls >= polls_;
  }
  const char* operation() const override { return "fake_op"; }
  int calls = 0;

 private:
  int polls_;
};

TEST(CommRequest, DefaultIsComplete) {
  Request r;
  EXPECT_FALSE(r.pending());
  EXPECT_TRUE(r.test());
  r.wait();
  std::vector<Request> none(3);
  wait_all(none);
  wait_all({});
}

TEST(CommRequest, WaitPollsUntilComplete) {
  std::unique_ptr<Communicator> self = make_self("slow");
  auto work = std::make_shared<FakeWork>(50);
  Request r(work, self.get());
  EXPECT_TRUE(r.pending());
  EXPECT_FALSE(r.test());
  r.wait();
  EXPECT_FALSE(r.pending());
  EXPECT_EQ(work->calls, 50);

  auto a = std::make_shared<FakeWork>(5), b = std::make_shared<FakeWork>(400);
  std::vector<Request> both{Request(a, self.get()), Request(b, self.get())};
  const auto start = std::chrono::steady_clock::now();
  wait_all(both);
  EXPECT_LT(seconds_since(start), 2.0);  // the backoff spins, then sleeps at most a millisecond per poll
  EXPECT_EQ(a->calls, 5);
  EXPECT_EQ(b->calls, 400);
  EXPECT_FALSE(both[0].pending());
  EXPECT_FALSE(both[1].pending());
}

TEST(CommRequestDeathTest, WaitPastTheTimeoutEndsTheJobWithOneLine) {
  std::unique_ptr<Communicator> self = make_self("slow");
  self->set_timeout_seconds(0.2);
  Request r(std::make_shared<FakeWork>(-1), self.get());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EXIT(
      r.wait(), testing::ExitedWithCode(1),
      "^forge: error: collective fake_op on group 'slow' \\(rank 0 of 1, world rank 0\\) did not complete "
      "within 0\\.2 s\n$");
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(CommRequestDeathTest, WaitAllNamesTheRequestThatTimedOut) {
  std::unique_ptr<Communicator> fast = make_self("fast"), slow = make_self("stuck");
  slow->set_timeout_seconds(0.1);
  std::vector<Request> requests{Request(std::make_shared<FakeWork>(3), fast.get()),
                                Request(std::make_shared<FakeWork>(-1), slow.get())};
  EXPECT_EXIT(wait_all(requests), testing::ExitedWithCode(1),
              "^forge: error: collective fake_op on group 'stuck' .* within 0\\.1 s\n$");
}

TEST(CommWorld, WithoutALauncherIsSelf) {
  if (launched_by_mpi()) GTEST_SKIP() << "started by an MPI launcher";
  Communicator& w = world();
  EXPECT_STREQ(w.backend(), "self");
  EXPECT_EQ(w.name(), "world");
  EXPECT_EQ(w.size(), 1);
  EXPECT_EQ(&world(), &w);
}

TEST(CommWorld, LauncherDetectedFromTheEnvironment) {
  ScopedEnv a("OMPI_COMM_WORLD_SIZE", nullptr), b("PMI_SIZE", nullptr), c("PMIX_RANK", nullptr),
      d("SLURM_NTASKS", nullptr);
  EXPECT_FALSE(launched_by_mpi());
  {
    ScopedEnv e("OMPI_COMM_WORLD_SIZE", "4");
    EXPECT_TRUE(launched_by_mpi());
  }
  {
    ScopedEnv e("SLURM_NTASKS", "1");  // a one-task Slurm step is not a parallel launch
    EXPECT_FALSE(launched_by_mpi());
  }
  {
    ScopedEnv e("PMI_SIZE", "2");
    EXPECT_TRUE(launched_by_mpi());
  }
  {
    ScopedEnv e("PMIX_RANK", "0");
    EXPECT_TRUE(launched_by_mpi());
  }
}

TEST(CommWorldDeathTest, TimeoutFromTheEnvironment) {
  // A fresh process per case (threadsafe style re-executes the binary), since the world is made once.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  if (launched_by_mpi()) GTEST_SKIP() << "started by an MPI launcher";
  EXPECT_EXIT(
      {
        setenv("FORGE_COMM_TIMEOUT", "2.5", 1);
        std::exit(world().timeout_seconds() == 2.5 ? 0 : 3);
      },
      testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        setenv("FORGE_COMM_TIMEOUT", "soon", 1);
        try {
          world();
        } catch (const Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::exit(2);
        }
        std::exit(0);
      },
      testing::ExitedWithCode(2), "FORGE_COMM_TIMEOUT='soon' is not a number of seconds");
}

TEST(CommNccl, UnavailableIsAClearError) {
  if (nccl_usable()) GTEST_SKIP() << "a CUDA device is present: tests/comm/nccl runs the nccl backend";
  EXPECT_EQ(nccl::device_count(), 0);
  std::unique_ptr<Communicator> self = make_self("boot");
  const std::string message = error_of([&] { make_nccl(*self, 0, "nccl"); });
  EXPECT_EQ(message.rfind("make_nccl: ", 0), 0u) << message;
}

// Two ranks under mpirun; world rank 0 never joins an all_reduce that world rank 1 waits on (in a group
// 'pair' whose order is reversed, so world rank 1 is its rank 0). With FORGE_COMM_TIMEOUT=1 the job must
// end within seconds, non-zero, with one line naming the group, the operation and both ranks.
class CommMpiJob : public ::testing::TestWithParam<const char*> {};

TEST_P(CommMpiJob, RankSkippingACollectiveAbortsTheJobWithOneLine) {
  const std::string command =
      std::string(
          "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 FORGE_COMM_TIMEOUT=1 "
          "timeout -s KILL 60 ") +
      FORGE_MPIEXEC + " -np 2 --oversubscribe --bind-to none -x FORGE_COMM_TIMEOUT -x OMP_NUM_THREADS=1 " +
      FORGE_COMM_ABORT_HELPER + " " + GetParam() + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char chunk[4096];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof(chunk), pipe)) > 0) output.append(chunk, n);
  const int status = pclose(pipe);
  const double elapsed = seconds_since(start);

  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  EXPECT_LT(elapsed, 30.0) << output;  // 1 s of timeout plus mpirun's start and teardown on a busy machine
  std::vector<std::string> errors;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("forge: error:", 0) == 0) errors.push_back(line);
  ASSERT_EQ(errors.size(), 1u) << output;
  EXPECT_EQ(
      errors[0],
      "forge: error: collective all_reduce on group 'pair' (rank 0 of 2, world rank 1) did not complete "
      "within 1 s");
}

// request: all_reduce(...).wait(); blocking: all_reduce_blocking, a blocking MPI call under the watchdog.
INSTANTIATE_TEST_SUITE_P(Waits, CommMpiJob, ::testing::Values("request", "blocking"));

// Runs comm_abort_helper's clean two-rank job with FORGE_COMM_TIMEOUT=3 and FORGE_FAULT_STALL=`stall`;
// returns the exit status, the output and the seconds it took.
struct JobResult {
  int status = 0;
  std::string output;
  double seconds = 0;
};

JobResult run_clean_job(const std::string& stall) {
  const std::string command =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 FORGE_COMM_TIMEOUT=3 FORGE_FAULT_STALL=" +
      stall + " timeout -s KILL 60 " + FORGE_MPIEXEC +
      " -np 2 --oversubscribe --bind-to none -x FORGE_COMM_TIMEOUT -x FORGE_FAULT_STALL -x "
      "OMP_NUM_THREADS=1 " +
      FORGE_COMM_ABORT_HELPER + " clean 2>&1";
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  JobResult result;
  if (!pipe) return {-1, "popen failed", 0};
  char chunk[4096];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof(chunk), pipe)) > 0) result.output.append(chunk, n);
  result.status = pclose(pipe);
  result.seconds = seconds_since(start);
  return result;
}

// A rank that stalls before MPI_Init (every other rank waits inside it) or after the last collective (the
// others wait in MPI_Finalize) used to hang the job forever; now the watchdog of start-up and shutdown ends
// it within the timeout, non-zero, each report one line. The stalled rank is rank 1; the rank waiting on it
// may report too, with its own rank.
class CommMpiStall : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(CommMpiStall, StalledRankEndsTheJobWithinTheTimeout) {
  const auto [stall, phase] = GetParam();
  const JobResult job = run_clean_job(stall);
  EXPECT_FALSE(WIFEXITED(job.status) && WEXITSTATUS(job.status) == 0) << job.output;
  EXPECT_FALSE(WIFSIGNALED(job.status)) << "killed by the test's own timeout: " << job.output;
  EXPECT_LT(job.seconds, 30.0) << job.output;  // 3 s of timeout plus mpirun's start and teardown
  std::vector<std::string> errors;
  std::istringstream lines(job.output);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("forge: error:", 0) == 0) errors.push_back(line);
  ASSERT_GE(errors.size(), 1u) << job.output;
  ASSERT_LE(errors.size(), 2u) << job.output;
  for (const std::string& line : errors) {
    const std::string head =
        line.substr(0, std::min(line.size(), std::string("forge: error: rank 0").size()));
    EXPECT_TRUE(head == "forge: error: rank 0" || head == "forge: error: rank 1") << line;
    EXPECT_NE(line.find(std::string(": MPI ") + phase +
                        " did not complete within 3 s (parallel.timeout_s / FORGE_COMM_TIMEOUT); "),
              std::string::npos)
        << line;
  }
}

INSTANTIATE_TEST_SUITE_P(Phases, CommMpiStall,
                         ::testing::Values(std::pair{"before_init:1", "start-up"},
                                           std::pair{"after_last_collective:1", "shutdown"}));

// Without a stall the same job succeeds, so the two above fail for the stall alone.
TEST(CommMpiClean, JobWithoutAStallSucceeds) {
  const JobResult job = run_clean_job("none:1");
  EXPECT_TRUE(WIFEXITED(job.status) && WEXITSTATUS(job.status) == 0) << job.output;
  EXPECT_EQ(job.output.find("forge: error:"), std::string::npos) << job.output;
}

}  // namespace
}  // namespace forge::comm::comm_test
