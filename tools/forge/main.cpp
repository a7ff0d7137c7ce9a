// The forge command line. Subcommands: train, bench (more arrive with their issues: eval, generate,
// convert, data, tokenizer, plan). Every error is one line on stderr and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "forge/train/config.h"
#include "forge/train/peak.h"
#include "forge/train/trainer.h"

namespace {

int run_train(const std::string& config_path, const std::vector<std::string>& overrides) {
  forge::TrainConfig config = config_path.empty() ? forge::TrainConfig{} : forge::TrainConfig::from_toml_file(config_path);
  for (const auto& o : overrides) config.apply_override(o);
  config.validate();
  forge::install_stop_signal_handlers();
  forge::Trainer trainer(config);
  forge::TrainResult result = trainer.run();
  return result.interrupted ? 130 : 0;
}

int run_bench() {
  std::printf("peak fp32 GEMM: %.0f GFLOP/s\n", forge::measure_gemm_peak_gflops(forge::DType::f32));
  std::printf("peak bf16 GEMM: %.0f GFLOP/s\n", forge::measure_gemm_peak_gflops(forge::DType::bf16));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"forge: train large language models natively in C++ (LLaMA-family on CPU and GPU)", "forge"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "forge 0.1.0");

  std::string config_path;
  std::vector<std::string> overrides;
  auto* train = app.add_subcommand("train", "Train a model (see configs/default.toml for every setting)");
  train->add_option("-c,--config", config_path, "TOML run configuration (default: built-in defaults)")
      ->check(CLI::ExistingFile);
  train->add_option("--set", overrides,
                    "Override one setting, section.key=value (repeatable), e.g. --set train.steps=100");
  train->footer(
      "Ctrl-C saves a checkpoint to <run_dir>/checkpoint and exits with status 130; resume with\n"
      "--set checkpoint.resume=auto. Writes <run_dir>/metrics.jsonl and <run_dir>/config.toml.");

  auto* bench = app.add_subcommand("bench", "Measure this machine's GEMM peak (the denominator of MFU)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*train) return run_train(config_path, overrides);
    if (*bench) return run_bench();
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "forge: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forge: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
