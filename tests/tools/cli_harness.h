// The CLI harness: what every tests/tools/*_cli_test.cpp needs to run the real `forge` binary
// (FORGE_BINARY_DIR/bin/forge) through /bin/sh and judge what it printed.
//
// - run_forge(args): Outcome{status, output} with stdout and stderr merged (2>&1) and stdin inherited.
// - run_forge(args, options): stderr discarded or kept apart (in Outcome::err), stdin fed from a string,
//   an environment prefix such as "OMP_NUM_THREADS=1".
// - expect_one_line_error(args, culprit[, options]): the contract for bad input. Exit status 1 and exactly
//   one line, which starts with "forge: error: " and names the culprit; with stderr apart, that line is on
//   stderr and stdout is empty.
// - ScratchDirTest: a fixture with a fresh folder per test, named after the suite, the test and the process
//   id so that no two tests share one; removed afterwards.
//
// `args` is pasted into a shell command line: quote paths and texts that hold spaces or shell characters.
// A status is the exit code, or 128 + the signal number when the binary was killed, so that a crash never
// passes for an error exit.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>

namespace forge::testing::cli {

namespace fs = std::filesystem;

inline std::string forge_binary() { return std::string(FORGE_BINARY_DIR) + "/bin/forge"; }

// A whole file, byte for byte ("" when it cannot be opened).
inline std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

enum class Stderr {
  merged,     // into Outcome::output, after 2>&1
  discarded,  // 2>/dev/null: Outcome::output is stdout alone
  apart,      // into Outcome::err; Outcome::output is stdout alone
};

struct RunOptions {
  Stderr stderr_to = Stderr::merged;
  std::optional<std::string> input = {};  // piped to stdin when set; otherwise stdin is the test's own
  std::string environment = {};           // prepended to the command, e.g. "OMP_NUM_THREADS=1"
  fs::path scratch_dir = {};  // holds stdin.txt / stderr.txt; needed with `input` or Stderr::apart
  std::string launcher = {};  // placed before the binary, e.g. "mpirun -np 2 --oversubscribe"
};

struct Outcome {
  int status = -1;
  std::string output;  // stdout, and stderr too with Stderr::merged
  std::string err;     // stderr with Stderr::apart
};

inline Outcome run_forge(const std::string& args, const RunOptions& options = {}) {
  const bool needs_scratch = options.input || options.stderr_to == Stderr::apart;
  if (needs_scratch && options.scratch_dir.empty())
    throw std::invalid_argument("run_forge: stdin input or a separate stderr needs RunOptions::scratch_dir");
  const fs::path in = options.scratch_dir / "stdin.txt", err = options.scratch_dir / "stderr.txt";
  std::string command = forge_binary() + " " + args;
  if (!options.launcher.empty()) command = options.launcher + " " + command;
  if (!options.environment.empty()) command = options.environment + " " + command;
  if (options.input) {
    std::ofstream(in, std::ios::binary) << *options.input;
    command += " < " + in.string();
  }
  switch (options.stderr_to) {
    case Stderr::merged:
      command += " 2>&1";
      break;
    case Stderr::discarded:
      command += " 2>/dev/null";
      break;
    case Stderr::apart:
      command += " 2> " + err.string();
      break;
  }
  Outcome o;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) throw std::runtime_error("run_forge: cannot start: " + command);
  std::array<char, 4096> buffer;
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) o.output.append(buffer.data(), n);
  const int raw = pclose(pipe);
  o.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  if (options.stderr_to == Stderr::apart) o.err = read_file(err);
  return o;
}

inline void expect_one_line_error(const std::string& args, const std::string& culprit,
                                  const RunOptions& options = {}) {
  if (options.stderr_to == Stderr::discarded) {
    ADD_FAILURE() << "expect_one_line_error needs stderr, which these options discard";
    return;
  }
  const Outcome o = run_forge(args, options);
  const bool apart = options.stderr_to == Stderr::apart;
  const std::string& message = apart ? o.err : o.output;
  EXPECT_EQ(o.status, 1) << message;
  if (apart) {
    EXPECT_EQ(o.output, "") << "stdout of a failing command; stderr: " << o.err;
  }
  EXPECT_EQ(message.rfind("forge: error: ", 0), 0u) << message;
  EXPECT_NE(message.find(culprit), std::string::npos) << message;
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 1) << message;
}

#ifdef FORGE_MPIEXEC
// The launcher of a job of `ranks` processes on this machine (more ranks than cores allowed).
inline std::string mpirun_launcher(int ranks) {
  return std::string(FORGE_MPIEXEC) + " -np " + std::to_string(ranks) + " --oversubscribe --bind-to none";
}
// run_forge's options for such a job: mpirun may run as root (CI does), one OpenMP thread per rank.
inline RunOptions under_mpirun(int ranks) {
  RunOptions o;
  o.launcher = mpirun_launcher(ranks);
  o.environment = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1";
  return o;
}
#endif

// A fresh, empty folder for each test: <tmp>/forge_<Suite>.<Test>_<pid>. A fixture that needs more set-up
// overrides SetUp() and calls ScratchDirTest::SetUp() first.
class ScratchDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(test->test_suite_name()) + "." + test->name();
    // Parameterized names hold '/': keep the folder one level deep.
    for (char& c : name)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
    dir_ = fs::temp_directory_path() / ("forge_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // Writes `text` byte for byte to dir_/name and returns that path.
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir_ / name, std::ios::binary) << text;
    return path(name);
  }

  fs::path dir_;
};

}  // namespace forge::testing::cli
