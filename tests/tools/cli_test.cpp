// The forge command line on bad input: one clear line on stderr naming the culprit, a non-zero exit,
// never a crash. Runs the real binary.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace {
namespace fs = std::filesystem;

struct Outcome {
  int status = -1;
  std::string output;  // stdout + stderr
};

Outcome run_forge(const std::string& args) {
  std::string command = std::string(FORGE_BINARY_DIR) + "/bin/forge " + args + " 2>&1";
  Outcome o;
  FILE* pipe = popen(command.c_str(), "r");
  std::array<char, 4096> buffer;
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) o.output.append(buffer.data(), n);
  int raw = pclose(pipe);
  o.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return o;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("forge_cli_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  // Exit status 1, and exactly one line that starts with "forge: error:" and names the culprit.
  void expect_one_line_error(const std::string& args, const std::string& culprit) {
    Outcome o = run_forge(args);
    EXPECT_EQ(o.status, 1) << o.output;
    EXPECT_EQ(o.output.rfind("forge: error: ", 0), 0u) << o.output;
    EXPECT_NE(o.output.find(culprit), std::string::npos) << o.output;
    EXPECT_EQ(std::count(o.output.begin(), o.output.end(), '\n'), 1) << o.output;
  }
  fs::path dir_;
};

TEST_F(Cli, HelpAndVersion) {
  Outcome help = run_forge("--help");
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.output.find("train"), std::string::npos);
  Outcome train_help = run_forge("train --help");
  EXPECT_EQ(train_help.status, 0);
  EXPECT_NE(train_help.output.find("--set"), std::string::npos);
  EXPECT_EQ(run_forge("--version").status, 0);
  EXPECT_NE(run_forge("frobnicate").status, 0);
}

TEST_F(Cli, MisspelledConfigKey) {
  std::string path = write("typo.toml", "[train]\nstesp = 10\n");
  expect_one_line_error("train --config " + path, "stesp");
}

TEST_F(Cli, UnknownOverride) {
  expect_one_line_error("train --set train.learning_rate=1", "learning_rate");
}

TEST_F(Cli, MissingModelConfig) {
  std::string path = write("m.toml", "[model]\nconfig = \"" + (dir_ / "missing.json").string() + "\"\n");
  expect_one_line_error("train --config " + path, "missing.json");
}

TEST_F(Cli, HeadsNotDivisibleByKvHeads) {
  std::string model = write("bad.json", R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 256})");
  expect_one_line_error("train --set model.config=" + model, "num_key_value_heads");
}

TEST_F(Cli, NonPositiveSizes) {
  std::string model = write("zero.json", R"({"hidden_size": 0, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "vocab_size": 256})");
  expect_one_line_error("train --set model.config=" + model, "hidden_size");
  expect_one_line_error("train --set train.micro_batch=-2", "micro_batch");
}

TEST_F(Cli, MisspelledModelKey) {
  std::string model = write("typo.json", R"({"hiden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "vocab_size": 256})");
  expect_one_line_error("train --set model.config=" + model, "hiden_size");
}

}  // namespace
