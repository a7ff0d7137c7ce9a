// The forge command line on bad input: one clear line on stderr naming the culprit, a non-zero exit,
// never a crash. Runs the real binary.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>

#include "forge/core/device.h"
#include "tools/cli_harness.h"

namespace forge::cli_test {
namespace {
namespace fs = std::filesystem;
using forge::testing::cli::expect_one_line_error;
using forge::testing::cli::forge_binary;
using forge::testing::cli::Outcome;
using forge::testing::cli::run_forge;

class Cli : public forge::testing::cli::ScratchDirTest {};

TEST_F(Cli, HelpAndVersion) {
  Outcome help = run_forge("--help");
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.output.find("train"), std::string::npos);
  // What forge is, in one line, with the families it implements (from the registry, so never stale).
  EXPECT_NE(help.output.find("dense, mixture-of-experts and multimodal"), std::string::npos) << help.output;
  for (const char* family : {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                             "DeepseekV3ForCausalLM", "LlavaForConditionalGeneration"})
    EXPECT_NE(help.output.find(family), std::string::npos) << family;
  Outcome train_help = run_forge("train --help");
  EXPECT_EQ(train_help.status, 0);
  EXPECT_NE(train_help.output.find("--set"), std::string::npos);
  EXPECT_NE(train_help.output.find("Qwen2ForCausalLM"), std::string::npos);
  EXPECT_NE(run_forge("generate --help").output.find("Qwen2ForCausalLM"), std::string::npos);
  EXPECT_NE(run_forge("convert --help").output.find("Qwen2ForCausalLM"), std::string::npos);
  EXPECT_EQ(run_forge("--version").status, 0);
  expect_one_line_error("frobnicate", "unknown command 'frobnicate'");
  expect_one_line_error("trian", "unknown command 'trian'; did you mean 'train'?");
  expect_one_line_error("--frob", "unknown option '--frob'");
  expect_one_line_error("", "A subcommand is required");
}

// Usage errors (CLI11's) exit with status 1 like every other error, not CLI11's 104-109.
TEST_F(Cli, UsageErrorsExitWithStatusOne) {
  expect_one_line_error("train --config " + (dir_ / "missing.toml").string(), "missing.toml");
  expect_one_line_error("train --frobnicate", "--frobnicate");
  expect_one_line_error("eval --seq-len x", "--seq-len");
}

TEST_F(Cli, MisspelledConfigKey) {
  std::string path = write("typo.toml", "[train]\nstesp = 10\n");
  expect_one_line_error("train --config " + path, "stesp");
}

TEST_F(Cli, UnknownOverride) { expect_one_line_error("train --set train.learning_rate=1", "learning_rate"); }

TEST_F(Cli, MissingModelConfig) {
  std::string path = write("m.toml", "[model]\nconfig = \"" + (dir_ / "missing.json").string() + "\"\n");
  expect_one_line_error("train --config " + path, "missing.json");
}

TEST_F(Cli, HeadsNotDivisibleByKvHeads) {
  std::string model =
      write("bad.json", R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 256})");
  expect_one_line_error("train --set model.config=" + model, "num_key_value_heads");
}

TEST_F(Cli, NonPositiveSizes) {
  std::string model =
      write("zero.json", R"({"hidden_size": 0, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "vocab_size": 256})");
  expect_one_line_error("train --set model.config=" + model, "hidden_size");
  expect_one_line_error("train --set train.micro_batch=-2", "micro_batch");
}

// A bad --set value is blamed on the --set, not on the config file it overrides.
TEST_F(Cli, BadOverrideIsBlamedOnTheOverride) {
  const std::string config =
      (std::filesystem::path(FORGE_FIXTURE_DIR).parent_path().parent_path() / "configs/default.toml")
          .string();
  expect_one_line_error("train --config " + config + " --set train.lr=-1",
                        "forge: error: --set 'train.lr=-1': train.lr must be > 0, got -1");
  expect_one_line_error("train --set train.threads=100000", "train.threads must be in [0, 4096]");
}

TEST_F(Cli, MisspelledModelKey) {
  std::string model =
      write("typo.json", R"({"hiden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "vocab_size": 256})");
  expect_one_line_error("train --set model.config=" + model, "hiden_size");
}

// Ctrl-C during training: the run finishes its step, saves a checkpoint, exits with 130, and a resumed
// run continues from that step.
TEST_F(Cli, CtrlCSavesACheckpointAndExits130) {
  std::string corpus = write("corpus.txt", [] {
    std::string text;
    for (int i = 0; i < 400; ++i) text += "Blessed are the meek: for they shall inherit the earth.\n";
    return text;
  }());
  std::string model =
      write("model.json", R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 64})");
  std::string run_dir = (dir_ / "run").string();
  std::string args =
      "train --set model.config=" + model + " --set data.corpus=" + corpus +
      " --set data.seq_len=32 --set data.heldout_fraction=0.1 --set train.micro_batch=2" +
      " --set train.steps=1000000 --set log.every=1 --set log.peak_gflops=1 --set log.run_dir=" + run_dir +
      " --set sample.tokens=0 --set data.tokenizer=bytes";
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    dup2(out[1], 2);
    close(out[0]);
    std::string command = forge_binary() + " " + args;
    execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  FILE* child_out = fdopen(out[0], "r");
  std::string output;
  char line[4096];
  int steps_seen = 0;
  while (fgets(line, sizeof line, child_out)) {
    output += line;
    if (std::string(line).rfind("step", 0) == 0 && ++steps_seen == 3) kill(pid, SIGINT);
  }
  fclose(child_out);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 130) << output;
  EXPECT_NE(output.find("checkpoint saved"), std::string::npos) << output;
  // `latest` names the committed step folder, which holds the manifest.
  std::string latest = forge::testing::cli::read_file(fs::path(run_dir) / "checkpoint" / "latest");
  ASSERT_EQ(latest.rfind("step-", 0), 0u) << latest;
  latest.pop_back();
  EXPECT_TRUE(fs::exists(fs::path(run_dir) / "checkpoint" / latest / "manifest.json"));

  Outcome resumed = run_forge(args.replace(args.find("train.steps=1000000"), 19, "train.steps=5") +
                              " --set checkpoint.resume=auto");
  EXPECT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
}

// forge bench on a GPU: bad values and a machine without one get one line each.
TEST_F(Cli, BenchDeviceAndFp8Refusals) {
  const std::string kDefaultModel =
      (std::filesystem::path(FORGE_FIXTURE_DIR).parent_path().parent_path() / "configs/llama-default.json")
          .string();
  for (const char* bad : {" --fp8 e4m3", " --device tpu", " --grad-accum 0",
                          " --profile-steps -1"}) {  // usage errors: status 1, one line
    const Outcome o = run_forge("bench --model " + kDefaultModel + bad);
    EXPECT_EQ(o.status, 1) << o.output;
    EXPECT_EQ(o.output.rfind("forge: error: --", 0), 0u) << o.output;
    EXPECT_EQ(o.output.find('\n'), o.output.size() - 1) << o.output;
  }
  // The error lists exactly the dtypes the option accepts (it used to list fp16, fp8_e4m3, int32, ...).
  expect_one_line_error("bench --model " + kDefaultModel + " --dtype fp8", "--dtype: fp8 not in {bf16,fp32}");
  expect_one_line_error("bench --model " + kDefaultModel + " --dtype fp16",
                        "--dtype: fp16 not in {bf16,fp32}");
  expect_one_line_error("bench --model " + kDefaultModel + " --activation-dtype fp16",
                        "--activation-dtype: fp16 not in {auto,bf16,fp32}");
  expect_one_line_error("bench --model " + kDefaultModel + " --dtype fp32 --activation-dtype bf16 --steps 1",
                        "--activation-dtype bf16 needs --dtype bf16");
  if (!forge::device_usable(forge::Device::cuda))
    expect_one_line_error("bench --model " + kDefaultModel + " --device cuda --steps 1", "no usable GPU");
}

forge::testing::cli::RunOptions environment(std::string variables) {
  forge::testing::cli::RunOptions options;
  options.environment = std::move(variables);
  return options;
}

// The GPU benchmark's command (bench/gpu/run_all.sh) on its whole GPU path, on the host:
// FORGE_EMULATE_DEVICE=1 runs --device cuda under the device emulation (kernels/emulated_device.h), where any
// host access to device memory kills the process and host pointers handed to device ops are refused. FP8
// current scaling, gradient accumulation and the op profile, as the benchmark runs them.
TEST_F(Cli, BenchGpuPathRunsUnderDeviceEmulation) {
  const std::string model =
      write("tiny.json", R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97})");
  for (const char* fp8 : {"off", "current"}) {
    const Outcome o = run_forge("bench --model " + model +
                                    " --device cuda --batch 2 --seq 32 --grad-accum 2 --steps 1 "
                                    "--warmup 1 --profile-steps 1 --fp8 " +
                                    fp8,
                                environment("FORGE_EMULATE_DEVICE=1 OMP_NUM_THREADS=1"));
    EXPECT_EQ(o.status, 0) << o.output;
    EXPECT_NE(o.output.find("cuda is emulated on the host"), std::string::npos) << o.output;
    EXPECT_NE(o.output.find(std::string("on cuda: ")), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("\"profile\": {\"device\":\"cuda\""), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("op profile (cuda, 1 step)"), std::string::npos) << o.output;
  }
}

// FORGE_EMULATE_DEVICE=dry: the same command as a dry run (ops checked, not computed), which ends with the
// ops checked and the peak device memory; a value other than 1 or dry is one line.
TEST_F(Cli, BenchGpuPathDryRun) {
  const std::string model =
      write("tiny.json", R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97})");
  const std::string args =
      "bench --model " + model + " --device cuda --batch 2 --seq 32 --steps 1 --warmup 0 --fp8 block";
  const Outcome o = run_forge(args, environment("FORGE_EMULATE_DEVICE=dry OMP_NUM_THREADS=1"));
  EXPECT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("a dry run: ops are checked, not computed"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("forge: dry run: "), std::string::npos) << o.output;
  EXPECT_NE(o.output.find(" device ops checked, peak device memory "), std::string::npos) << o.output;
  expect_one_line_error(args, "FORGE_EMULATE_DEVICE=2: expected 1 (run on the host) or dry (check only)",
                        environment("FORGE_EMULATE_DEVICE=2"));
}

// A training dry run (FORGE_EMULATE_DEVICE=dry) with the optimizer offloaded: it checks every op, writes no
// checkpoint (its state is zeros), and its device peak is the offloaded state's 12 bytes per parameter
// below the same run's with the device update (a tiny model: the state's share of the peak is visible).
TEST_F(Cli, TrainDryRunWithOptimizerOffload) {
  const std::string model =
      write("tiny.json", R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256})");
  std::string corpus;
  for (int i = 0; i < 400; ++i) corpus += "In the beginning was the word " + std::to_string(i % 7) + ".\n";
  const std::string text = write("corpus.txt", corpus);
  auto peak_of = [&](bool offload) {
    const std::string args = "train --set model.config=" + model + " --set data.corpus=" + text +
                             " --set data.tokenizer=bytes --set data.seq_len=32 --set train.steps=2 "
                             "--set train.warmup=1 --set eval.every=0 --set sample.tokens=0 "
                             "--set train.device=cuda --set train.optimizer_offload=" +
                             (offload ? "true" : "false") + " --set log.run_dir=" +
                             (dir_ / (offload ? "dry-offload" : "dry-device")).string();
    const Outcome o = run_forge(args, environment("FORGE_EMULATE_DEVICE=dry OMP_NUM_THREADS=1"));
    EXPECT_EQ(o.status, 0) << o.output;
    EXPECT_NE(o.output.find("dry run: no checkpoint of step 2 is written (final)"), std::string::npos)
        << o.output;
    const size_t at = o.output.find(" GiB (", o.output.find("peak device memory "));
    EXPECT_NE(at, std::string::npos) << o.output;
    return at == std::string::npos ? 0.0 : std::stod(o.output.substr(at + 6));
  };
  const double device = peak_of(false), offloaded = peak_of(true);
  EXPECT_LT(offloaded, device);
  EXPECT_FALSE(fs::exists(dir_ / "dry-offload" / "checkpoint"));
}

}  // namespace
}  // namespace forge::cli_test
