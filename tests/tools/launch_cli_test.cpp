// forge launch: a job that fails, dies by a signal or stops beating its heartbeat is restarted, up to
// --max-restarts times, one stderr line per restart; a job that succeeds is left alone; SIGINT and SIGTERM
// reach the job and end launch without a restart; bad input is one line. The jobs are small /bin/sh scripts
// that count their attempts in a file and read FORGE_LAUNCH_ATTEMPT.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tools/cli_harness.h"

namespace forge::testing::cli::launch_cli_test {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    lines.push_back(text.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return lines;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class LaunchCli : public ScratchDirTest {
 protected:
  // stdout and stderr apart: the job's own output is on stdout, launch's lines on stderr.
  Outcome launch(const std::string& args) const {
    RunOptions options;
    options.stderr_to = Stderr::apart;
    options.scratch_dir = dir_;
    return run_forge("launch " + args, options);
  }
  // How many times the job ran: each attempt appends a line to `count`.
  size_t attempts() const { return lines_of(read_file(dir_ / "count")).size(); }
  // A job script that counts itself first.
  std::string job(const std::string& script) const {
    return "/bin/sh -c 'echo $FORGE_LAUNCH_ATTEMPT >> " + path("count") + "; " + script + "'";
  }
};

TEST_F(LaunchCli, AJobThatSucceedsRunsOnce) {
  const Outcome o = launch("--restart-delay 0 -- " + job("echo attempt $FORGE_LAUNCH_ATTEMPT"));
  EXPECT_EQ(o.status, 0) << o.err;
  EXPECT_EQ(o.output, "attempt 0\n");  // the job's stdout passes through
  EXPECT_EQ(o.err, "");
  EXPECT_EQ(attempts(), 1u);
}

TEST_F(LaunchCli, AJobThatFailsTwiceIsRestartedTwice) {
  const Outcome o = launch("--restart-delay 0 -- " + job("[ $FORGE_LAUNCH_ATTEMPT -ge 2 ] || exit 3"));
  EXPECT_EQ(o.status, 0) << o.err;
  EXPECT_EQ(read_file(dir_ / "count"), "0\n1\n2\n");  // FORGE_LAUNCH_ATTEMPT counts from 0
  const std::vector<std::string> lines = lines_of(o.err);
  ASSERT_EQ(lines.size(), 2u) << o.err;
  EXPECT_EQ(lines[0].rfind("forge launch: restart 1 of 3: the job exited with status 3 after ", 0), 0u)
      << o.err;
  EXPECT_EQ(lines[1].rfind("forge launch: restart 2 of 3: the job exited with status 3 after ", 0), 0u)
      << o.err;
}

TEST_F(LaunchCli, AJobThatAlwaysFailsIsGivenUpWithItsStatus) {
  const Outcome o = launch("--max-restarts 2 --restart-delay 0 --heartbeat " + path("run/heartbeat") +
                           " -- " + job("exit 7"));
  EXPECT_EQ(o.status, 7) << o.err;
  EXPECT_EQ(attempts(), 3u);
  const std::vector<std::string> lines = lines_of(o.err);
  ASSERT_EQ(lines.size(), 3u) << o.err;
  EXPECT_TRUE(contains(lines[1], "restart 2 of 2: the job exited with status 7")) << o.err;
  EXPECT_EQ(lines[2].rfind(
                "forge: error: launch: the job failed 3 times (last: the job exited with status 7 after ", 0),
            0u)
      << o.err;
  EXPECT_TRUE(lines[2].ends_with("); giving up after 2 restarts")) << o.err;
  // With --heartbeat, every restart and the end are logged beside the heartbeat file.
  const std::vector<std::string> log = lines_of(read_file(dir_ / "run" / "launch.jsonl"));
  ASSERT_EQ(log.size(), 3u);
  EXPECT_TRUE(contains(log[0], R"("event":"restart")") && contains(log[0], R"("attempt":1)")) << log[0];
  EXPECT_TRUE(contains(log[1], R"("attempt":2)") && contains(log[1], R"("status":7)")) << log[1];
  EXPECT_TRUE(contains(log[2], R"("event":"give_up")")) << log[2];
}

TEST_F(LaunchCli, ARestartNamesTheSignalThatKilledTheJob) {
  const Outcome o = launch("--max-restarts 1 --restart-delay 0 -- " + job("kill -9 $$"));
  EXPECT_EQ(o.status, 128 + 9) << o.err;
  EXPECT_EQ(attempts(), 2u);
  const std::vector<std::string> lines = lines_of(o.err);
  ASSERT_EQ(lines.size(), 2u) << o.err;
  EXPECT_TRUE(contains(lines[0], "restart 1 of 1: the job was killed by signal 9 (SIGKILL) after ")) << o.err;
  EXPECT_TRUE(contains(lines[1], "giving up after 1 restart")) << o.err;
}

// A process still alive (a zombie is not).
bool alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

TEST_F(LaunchCli, AHungJobIsKilledWithItsProcessGroupAndRestarted) {
  // Attempt 0 never touches the heartbeat and waits on a background sleep; attempt 1 succeeds.
  const auto begin = std::chrono::steady_clock::now();
  const Outcome o = launch(
      "--restart-delay 0 --heartbeat " + path("run/heartbeat") + " --stall-timeout 1 -- " +
      job("[ $FORGE_LAUNCH_ATTEMPT -ge 1 ] && exit 0; sleep 1000 & echo $! > " + path("sleeper") + "; wait"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  EXPECT_EQ(o.status, 0) << o.err;
  EXPECT_EQ(attempts(), 2u);
  EXPECT_LT(seconds, 4.0);
  const std::vector<std::string> lines = lines_of(o.err);
  ASSERT_EQ(lines.size(), 1u) << o.err;
  EXPECT_TRUE(contains(lines[0], "restart 1 of 3: no heartbeat for 1 s (" + path("run/heartbeat") +
                                     "): killed the job after "))
      << o.err;
  // The whole group went, the background sleep too.
  const pid_t sleeper = std::stoi(read_file(dir_ / "sleeper"));
  for (int i = 0; i < 50 && alive(sleeper); ++i) ::usleep(20000);
  EXPECT_FALSE(alive(sleeper));
  const std::vector<std::string> log = lines_of(read_file(dir_ / "run" / "launch.jsonl"));
  ASSERT_EQ(log.size(), 1u);
  EXPECT_TRUE(contains(log[0], R"("hung":true)")) << log[0];
}

TEST_F(LaunchCli, AJobThatKeepsBeatingIsLeftAlone) {
  // A heartbeat file left stale by an earlier run counts from the job's start, not from its old time; the
  // job then touches it every 0.3 s, for longer than the stall timeout in all.
  const std::string heartbeat = write("heartbeat", "");
  std::filesystem::last_write_time(heartbeat,
                                   std::filesystem::file_time_type::clock::now() - std::chrono::hours(1));
  const Outcome o =
      launch("--restart-delay 0 --heartbeat " + heartbeat + " --stall-timeout 1.5 -- " +
             job("sleep 0.3; for i in 1 2 3 4 5 6 7; do touch " + heartbeat + "; sleep 0.3; done"));
  EXPECT_EQ(o.status, 0) << o.err;
  EXPECT_EQ(o.err, "");
  EXPECT_EQ(attempts(), 1u);
}

// The job sends the signal to launch (its parent): launch passes it on to the job's process group, waits for
// the job and stops. (The jobs loop on short sleeps: a signal that comes while the shell forks a command may
// be seen only once that command ends.)
TEST_F(LaunchCli, SigintEndsTheJobAndLaunchWithoutARestart) {
  const Outcome o =
      launch("--restart-delay 0 -- " + job("trap \"echo got INT >> " + path("count") +
                                           "; exit 0\" INT; kill -INT $PPID; while :; do sleep 0.1; done"));
  EXPECT_EQ(o.status, 130) << o.err;
  EXPECT_EQ(read_file(dir_ / "count"), "0\ngot INT\n");  // one attempt, and it got the signal
  EXPECT_EQ(
      o.err,
      "forge launch: SIGINT: passed on to the job; waiting for it to end, then exiting without a restart\n");
}

TEST_F(LaunchCli, SigtermReachesTheJobsWholeProcessGroup) {
  // The job starts a helper in the background, waits until it is ready, then sends SIGTERM to launch; both
  // must get it, and the job waits for its helper.
  const std::string count = path("count"), ready = path("ready");
  const std::string helper =
      write("helper.sh", "trap 'echo helper got TERM >> " + count + "; exit 0' TERM\ntouch " + ready +
                             "\nwhile :; do sleep 0.1; done\n");
  const std::string script =
      write("job.sh", "echo $FORGE_LAUNCH_ATTEMPT >> " + count + "\ntrap 'wait; echo job got TERM >> " +
                          count + "; exit 0' TERM\n/bin/sh " + helper + " &\nwhile [ ! -f " + ready +
                          " ]; do sleep 0.05; done\nkill -TERM $PPID\n"
                          "while :; do sleep 0.1; done\n");
  const Outcome o = launch("--restart-delay 0 -- /bin/sh " + script);
  EXPECT_EQ(o.status, 143) << o.err;
  EXPECT_EQ(read_file(dir_ / "count"), "0\nhelper got TERM\njob got TERM\n");
  // launch says it once; the shells may add "Terminated" for their killed sleeps, before or after it.
  size_t said = 0;
  for (const std::string& line : lines_of(o.err)) {
    if (line.rfind("forge launch: SIGTERM: passed on to the job; waiting for it to end", 0) == 0)
      ++said;
    else
      EXPECT_EQ(line, "Terminated") << o.err;
  }
  EXPECT_EQ(said, 1u) << o.err;
}

TEST_F(LaunchCli, ATrainCommandWithoutResumeIsWarnedAbout) {
  // Any argument `train` makes it a forge train job; the job itself is harmless.
  const std::string warning = "forge launch: warning: the command does not set checkpoint.resume=auto";
  Outcome o = launch("--restart-delay 0 -- /bin/sh -c true train");
  EXPECT_EQ(o.status, 0);
  EXPECT_EQ(lines_of(o.err).size(), 1u) << o.err;
  EXPECT_EQ(o.err.rfind(warning, 0), 0u) << o.err;
  o = launch("--restart-delay 0 -- /bin/sh -c true train --set checkpoint.resume=auto");
  EXPECT_EQ(o.status, 0);
  EXPECT_EQ(o.err, "");
}

TEST_F(LaunchCli, BadInputIsOneLine) {
  expect_one_line_error("launch", "no command");
  expect_one_line_error("launch --max-restarts 1 --", "no command");
  expect_one_line_error("launch sh -c true", "put the command after '--'");
  expect_one_line_error("launch --max-restarts -1 -- true", "--max-restarts -1");
  expect_one_line_error("launch --restart-delay -2 -- true", "--restart-delay -2");
  expect_one_line_error("launch --stall-timeout 1 -- true", "--stall-timeout needs --heartbeat");
  expect_one_line_error("launch --heartbeat hb --stall-timeout 0 -- true", "--stall-timeout 0");
  expect_one_line_error("launch --frob -- true", "unknown option '--frob'");
  // A command that cannot be run is bad input, not a fault: no restarts.
  expect_one_line_error("launch -- " + path("no-such-command") + " --flag",
                        "launch: cannot run '" + path("no-such-command") + "': No such file or directory");
  expect_one_line_error("launch -- forge-no-such-command-anywhere",
                        "cannot run 'forge-no-such-command-anywhere'");
}

}  // namespace
}  // namespace forge::testing::cli::launch_cli_test
