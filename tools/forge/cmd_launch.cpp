// forge launch: run a job and restart it when it fails or hangs. The job is any command (typically
// `mpirun ... forge train ... --set checkpoint.resume=auto`), run as a child in its own process group (fork +
// setpgid + execvp, no shell). A non-zero exit, a death by signal or, with --heartbeat and --stall-timeout, a
// heartbeat file left unchanged too long (then the whole group is killed: SIGTERM, SIGKILL 5 s later)
// restarts it, up to --max-restarts times. The job must resume by itself: launch knows nothing of
// checkpoints. SIGINT and SIGTERM sent to launch go to the job's process group; launch then waits for the job
// and exits (130 or 143) without a restart.
#include <errno.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"

namespace forge::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr double kPollSeconds = 0.2;     // waitpid(WNOHANG) and the heartbeat's stat, this often
constexpr double kKillGraceSeconds = 5;  // SIGTERM to a hung job, then SIGKILL after this long

struct LaunchOptions {
  int max_restarts = 3;
  std::string heartbeat;
  double stall_timeout = 0;  // seconds; 0: no hang detection
  double restart_delay = 1;  // seconds
  std::vector<std::string> command;
};

// SIGINT / SIGTERM received by launch itself: how many, and the last one. The handler only records them; the
// polling loop passes them on to the job.
volatile std::sig_atomic_t g_signals_received = 0;
volatile std::sig_atomic_t g_last_signal = 0;

extern "C" void on_launch_signal(int sig) {
  g_last_signal = sig;
  g_signals_received = g_signals_received + 1;
}

extern "C" void on_child_signal(int) {}

void install_signal_handlers() {
  struct sigaction action {};
  action.sa_handler = on_launch_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;  // no SA_RESTART: a signal ends the current sleep at once
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  // SIGCHLD only cuts the polling loop's sleep short, so that a job's end is seen at once.
  action.sa_handler = on_child_signal;
  sigaction(SIGCHLD, &action, nullptr);
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void sleep_seconds(double s) {
  s = std::max(s, 0.0);
  timespec t{static_cast<time_t>(s), static_cast<long>((s - std::floor(s)) * 1e9)};
  nanosleep(&t, nullptr);  // a signal may cut it short: callers look at the flags and loop
}

std::string signal_name(int sig) {
  static const std::pair<int, const char*> names[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"}};
  for (const auto& [number, name] : names)
    if (number == sig) return name;
  return fmt::format("signal {}", sig);
}

std::string plural(long n, const char* one, const char* many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

// How one attempt ended.
struct Ending {
  bool hung = false;   // killed by launch for want of a heartbeat
  int exit_code = -1;  // when it exited
  int signal = 0;      // when a signal ended it (also a hung job's)
  double seconds = 0;  // how long it ran
  std::string why;     // "the job exited with status 1 after 12.3 s"

  bool succeeded() const { return !hung && exit_code == 0; }
  // launch's own exit status when it gives up: the job's exit code, 128 + its signal, 1 for a hang.
  int status() const { return hung ? 1 : signal ? 128 + signal : exit_code > 0 ? exit_code : 1; }
};

Ending ending_of(int raw, double seconds) {
  Ending e;
  e.seconds = seconds;
  if (WIFEXITED(raw)) {
    e.exit_code = WEXITSTATUS(raw);
    e.why = fmt::format("the job exited with status {} after {:.1f} s", e.exit_code, seconds);
  } else {
    e.signal = WIFSIGNALED(raw) ? WTERMSIG(raw) : 0;
    e.why = fmt::format("the job was killed by signal {} ({}) after {:.1f} s", e.signal,
                        signal_name(e.signal), seconds);
  }
  return e;
}

// What the heartbeat file looks like now; any difference from the last look is a beat (a rewrite through
// rename changes the inode, an append the size, a touch the modification time).
struct FileState {
  bool exists = false;
  long long mtime_s = 0, mtime_ns = 0, inode = 0, size = 0;
  bool operator==(const FileState&) const = default;
};

FileState look_at(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {true, static_cast<long long>(st.st_mtim.tv_sec), static_cast<long long>(st.st_mtim.tv_nsec),
          static_cast<long long>(st.st_ino), static_cast<long long>(st.st_size)};
}

// Starts attempt `attempt` of the command in its own process group; returns its pid (also its process group
// id). A command that cannot be executed is bad input: one line, no restart.
pid_t start(const std::vector<std::string>& command, int attempt) {
  ::setenv("FORGE_LAUNCH_ATTEMPT", std::to_string(attempt).c_str(), 1);  // inherited through exec
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // exec's failure comes back through a pipe that a successful exec closes.
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) fail("launch: pipe: {}", std::strerror(errno));
  // The job's process group is not the terminal's foreground group: reading the terminal would stop it
  // (SIGTTIN), which would look like a hang. Such a job reads /dev/null; a pipe or a file stays its stdin.
  const bool stdin_is_terminal = ::isatty(STDIN_FILENO) == 1;
  const pid_t pid = ::fork();
  if (pid < 0) fail("launch: fork: {}", std::strerror(errno));
  if (pid == 0) {
    ::close(report[0]);
    ::setpgid(0, 0);
    if (stdin_is_terminal) {
      const int null = ::open("/dev/null", O_RDONLY);
      if (null >= 0) ::dup2(null, STDIN_FILENO), ::close(null);
    }
    ::execvp(argv[0], argv.data());
    const int error = errno;
    [[maybe_unused]] const ssize_t n = ::write(report[1], &error, sizeof error);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // here too: whichever runs first, the group exists before a signal is passed on
  ::close(report[1]);
  int error = 0;
  ssize_t n;
  do n = ::read(report[0], &error, sizeof error);
  while (n < 0 && errno == EINTR);
  ::close(report[0]);
  if (n == static_cast<ssize_t>(sizeof error)) {
    int raw;
    while (::waitpid(pid, &raw, 0) < 0 && errno == EINTR) {
    }
    fail("launch: cannot run '{}': {}", command[0], std::strerror(error));
  }
  return pid;
}

// Waits for the child; returns its raw status, or nothing after `deadline_s` seconds (< 0: no deadline).
std::optional<int> wait_for(pid_t pid, double deadline_s) {
  const Clock::time_point begin = Clock::now();
  while (true) {
    int raw = 0;
    const pid_t r = ::waitpid(pid, &raw, WNOHANG);
    if (r == pid) return raw;
    if (r < 0 && errno != EINTR) fail("launch: waitpid: {}", std::strerror(errno));
    if (deadline_s >= 0 && seconds_since(begin) >= deadline_s) return std::nullopt;
    sleep_seconds(kPollSeconds);
  }
}

// Runs attempt `pid` to its end: passes launch's signals on to its process group, and kills it when the
// heartbeat stalls.
Ending watch(pid_t pid, const LaunchOptions& o) {
  const Clock::time_point begin = Clock::now();
  const bool watch_heartbeat = !o.heartbeat.empty() && o.stall_timeout > 0;
  FileState beat = watch_heartbeat ? look_at(o.heartbeat) : FileState{};
  Clock::time_point last_beat = begin;  // the later of the job's start and the heartbeat's last change
  int signals_passed = 0;
  while (true) {
    int raw = 0;
    const pid_t r = ::waitpid(pid, &raw, WNOHANG);
    if (r == pid) return ending_of(raw, seconds_since(begin));
    if (r < 0 && errno != EINTR) fail("launch: waitpid: {}", std::strerror(errno));

    if (g_signals_received != signals_passed) {
      // Ctrl-C in a terminal reaches launch's process group only: pass it on as a terminal would, to the
      // job's whole group, every time it comes.
      signals_passed = g_signals_received;
      const int sig = g_last_signal;
      ::kill(-pid, sig);
      if (signals_passed == 1)
        std::fprintf(stderr,
                     "forge launch: %s: passed on to the job; waiting for it to end, then exiting without a "
                     "restart\n",
                     signal_name(sig).c_str());
    }

    if (watch_heartbeat && signals_passed == 0) {
      const FileState now = look_at(o.heartbeat);
      if (!(now == beat)) beat = now, last_beat = Clock::now();
      if (seconds_since(last_beat) >= o.stall_timeout) {
        ::kill(-pid, SIGTERM);
        ::kill(-pid, SIGCONT);  // a stopped process gets its SIGTERM only once it runs again
        std::optional<int> ended = wait_for(pid, kKillGraceSeconds);
        const bool escalated = !ended;
        if (escalated) {
          ::kill(-pid, SIGKILL);
          ended = wait_for(pid, -1);
        }
        Ending e = ending_of(*ended, seconds_since(begin));
        e.hung = true;
        e.why = fmt::format(
            "no heartbeat for {:g} s ({}): killed the job after {:.1f} s{}", o.stall_timeout, o.heartbeat,
            e.seconds,
            escalated ? fmt::format(" (SIGKILL: SIGTERM did not end it in {:g} s)", kKillGraceSeconds) : "");
        return e;
      }
    }
    sleep_seconds(kPollSeconds);
  }
}

// One JSON line per restart (and one when launch gives up) in <dir of the heartbeat>/launch.jsonl.
void log_event(const LaunchOptions& o, const char* event, int attempt, const Ending& e) {
  if (o.heartbeat.empty()) return;
  const fs::path dir = fs::path(o.heartbeat).parent_path();
  const fs::path path = dir.empty() ? fs::path("launch.jsonl") : dir / "launch.jsonl";
  std::error_code ignored;
  if (!dir.empty()) fs::create_directories(dir, ignored);
  nlohmann::ordered_json line;
  line["event"] = event;
  line["attempt"] = attempt;
  line["reason"] = e.why;
  line["status"] = e.exit_code >= 0 ? nlohmann::ordered_json(e.exit_code) : nlohmann::ordered_json();
  if (e.signal) line["signal"] = e.signal;
  if (e.hung) line["hung"] = true;
  line["seconds"] = std::round(e.seconds * 1000) / 1000;
  std::ofstream out(path, std::ios::app);
  out << line.dump() << '\n';
  if (!out) std::fprintf(stderr, "forge launch: warning: cannot append to %s\n", path.string().c_str());
}

bool mentions(const std::vector<std::string>& command, const std::string& text, bool whole) {
  for (const std::string& a : command)
    if (whole ? a == text : a.find(text) != std::string::npos) return true;
  return false;
}

// `extras`: what CLI11 did not take, which must be the "--" before the command and nothing else.
int run_launch(const LaunchOptions& o, const std::vector<std::string>& extras, bool stall_given) {
  const bool separated = std::find(extras.begin(), extras.end(), "--") != extras.end();
  if (!separated && !o.command.empty())
    fail("launch: put the command after '--': forge launch [options] -- {} ...", o.command[0]);
  for (const std::string& extra : extras)
    if (extra != "--") fail("launch: unknown option '{}' (see forge launch --help)", extra);
  if (o.command.empty())
    fail(
        "launch: no command: give it after '--', e.g. forge launch -- mpirun -np 4 forge train --set "
        "checkpoint.resume=auto");
  if (o.max_restarts < 0) fail("launch: --max-restarts {}: expected a number >= 0", o.max_restarts);
  if (!(o.restart_delay >= 0) || !std::isfinite(o.restart_delay))
    fail("launch: --restart-delay {}: expected a number of seconds >= 0", o.restart_delay);
  if (stall_given && (!(o.stall_timeout > 0) || !std::isfinite(o.stall_timeout)))
    fail("launch: --stall-timeout {}: expected a number of seconds > 0", o.stall_timeout);
  if (stall_given && o.heartbeat.empty())
    fail("launch: --stall-timeout needs --heartbeat FILE (the file whose changes show the job is alive)");

  const bool train = mentions(o.command, "train", true);
  const bool resumes = mentions(o.command, "checkpoint.resume=auto", false);
  if (train && !resumes)
    std::fprintf(stderr,
                 "forge launch: warning: the command does not set checkpoint.resume=auto; a restarted forge "
                 "train will refuse to start over its own checkpoints (or restart from scratch)\n");
  const char* next = train && resumes ? "restarting from the newest valid checkpoint" : "restarting it";

  install_signal_handlers();
  const auto interrupted_status = [] { return 128 + static_cast<int>(g_last_signal); };
  for (int attempt = 0;; ++attempt) {
    if (g_signals_received) {  // between two attempts
      std::fprintf(stderr, "forge launch: %s: exiting without a restart\n",
                   signal_name(g_last_signal).c_str());
      return interrupted_status();
    }
    const pid_t pid = start(o.command, attempt);
    const Ending e = watch(pid, o);
    if (g_signals_received) return interrupted_status();
    if (e.succeeded()) return 0;
    // What the job left behind in its group (a rank whose launcher died) must not outlive it.
    ::kill(-pid, SIGKILL);
    if (attempt == o.max_restarts) {
      log_event(o, "give_up", attempt, e);
      std::fprintf(stderr, "forge: error: launch: the job failed %s (last: %s); giving up after %s\n",
                   plural(attempt + 1, "time", "times").c_str(), e.why.c_str(),
                   plural(o.max_restarts, "restart", "restarts").c_str());
      return e.status();
    }
    std::fprintf(stderr, "forge launch: restart %d of %d: %s; %s\n", attempt + 1, o.max_restarts,
                 e.why.c_str(), next);
    log_event(o, "restart", attempt + 1, e);
    const Clock::time_point pause = Clock::now();
    while (!g_signals_received && seconds_since(pause) < o.restart_delay)
      sleep_seconds(std::min(kPollSeconds, o.restart_delay - seconds_since(pause)));
  }
}

}  // namespace

void add_launch_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<LaunchOptions>();
  auto* launch = app.add_subcommand(
      "launch", "Run a job (e.g. mpirun ... forge train) and restart it when it fails or hangs");
  launch->add_option("--max-restarts", o->max_restarts, "restarts before giving up")
      ->capture_default_str()
      ->type_name("N");
  launch
      ->add_option("--heartbeat", o->heartbeat,
                   "a file the job touches while it makes progress (forge train: <run_dir>/heartbeat, "
                   "written after every step); restarts are also logged to launch.jsonl beside it")
      ->type_name("FILE");
  auto* stall = launch
                    ->add_option("--stall-timeout", o->stall_timeout,
                                 "seconds without a change of the heartbeat file after which the job is "
                                 "deemed hung, killed and restarted (needs --heartbeat)")
                    ->type_name("S");
  launch->add_option("--restart-delay", o->restart_delay, "seconds to wait before each restart")
      ->capture_default_str()
      ->type_name("S");
  launch->add_option("command", o->command, "the job's command line, after '--'")->type_name("COMMAND ARGS");
  // "--" lands among the extras: it must be there, and nothing else may.
  launch->allow_extras();
  launch->footer(
      "forge launch [options] -- COMMAND [ARGS...] runs COMMAND (no shell) in its own process group, its\n"
      "output passed through, and restarts the same command when it exits non-zero or dies by a signal,\n"
      "up to --max-restarts times, --restart-delay seconds apart; each restart is one line on stderr.\n"
      "Exit status: 0 once an attempt succeeds; when the restarts are used up, one line\n"
      "'forge: error: launch: the job failed ...' and the last attempt's exit status (128 + its signal,\n"
      "1 for a hang). A command that cannot be run is an error at once, without restarts.\n"
      "The job must resume by itself: forge train needs --set checkpoint.resume=auto (launch warns when a\n"
      "train command lacks it) and then continues from the newest valid checkpoint, losing at most the\n"
      "steps since it; launch knows nothing of checkpoints.\n"
      "Hangs: with --heartbeat FILE --stall-timeout S, a job whose FILE has not changed for S seconds\n"
      "(counted from the later of the attempt's start and the file's last change; a missing file counts\n"
      "from the start) gets SIGTERM on its whole process group, SIGKILL 5 s later, and is restarted. Allow\n"
      "for start-up and checkpoint loading in S.\n"
      "Each attempt sees FORGE_LAUNCH_ATTEMPT=0, 1, ... in its environment (pass it on to remote ranks\n"
      "with mpirun -x FORGE_LAUNCH_ATTEMPT if they need it).\n"
      "SIGINT (Ctrl-C) or SIGTERM to launch goes to the job's process group; launch waits for the job\n"
      "(forge train saves a checkpoint) and exits with 130 or 143, without a restart. A job run from a\n"
      "terminal reads its stdin from /dev/null.\n"
      "Example: forge launch --heartbeat runs/x/heartbeat --stall-timeout 600 -- mpirun -np 4 forge train\n"
      "  --config run.toml --set log.run_dir=runs/x --set checkpoint.resume=auto\n"
      "Slurm: run launch once inside the allocation (in the sbatch script), around srun:\n"
      "  forge launch -- srun forge train ... --set checkpoint.resume=auto\n"
      "so that every restart runs srun again on the same nodes. See docs/launch.md.");

  commands.push_back({launch, [o, launch, stall] {
                        // Errors are printed here rather than by main(): inside a Slurm allocation or under
                        // mpirun, main() ends "the MPI job" (MPI_Abort) on an error, and launch is no part
                        // of one.
                        try {
                          return run_launch(*o, launch->remaining(), stall->count() > 0);
                        } catch (const std::exception& e) {
                          std::fprintf(stderr, "forge: error: %s\n", e.what());
                          return 1;
                        }
                      }});
}

}  // namespace forge::cli
