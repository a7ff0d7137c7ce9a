// The forge command line. Subcommands: train, bench (more arrive with their issues: eval, generate,
// convert, data, tokenizer, plan). Every error is one line on stderr and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "forge/train/config.h"
#include "forge/nn/compute.h"
#include "forge/train/peak.h"
#include "forge/train/throughput.h"
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

struct BenchOptions {
  std::string model;
  int64_t batch = 4, seq = 512;
  int steps = 5, warmup = 2;
  std::string dtype = "bf16", recompute = "none";
  double peak_gflops = 0;
};

int run_bench(const BenchOptions& o) {
  const forge::DType dtype = forge::dtype_from_name(o.dtype);
  if (o.model.empty()) {
    // 4096^3 GEMMs (137 GFLOP each), best of 3: long enough to be stable on a shared machine.
    std::printf("peak fp32 GEMM: %.0f GFLOP/s\n", forge::measure_gemm_peak_gflops(forge::DType::f32, 4096, 3));
    std::printf("peak bf16 GEMM: %.0f GFLOP/s\n", forge::measure_gemm_peak_gflops(forge::DType::bf16, 4096, 3));
    return 0;
  }
  forge::LlamaConfig config = forge::LlamaConfig::from_json_file(o.model);
  const double peak = o.peak_gflops > 0 ? o.peak_gflops : forge::measure_gemm_peak_gflops(dtype, 4096, 3);
  forge::ThroughputResult r = forge::measure_training_throughput(
      config, {dtype, forge::nn::recompute_from_name(o.recompute)}, o.batch, o.seq, o.warmup, o.steps);
  std::printf("forge %s: %.0f tokens/s | %.1f model GFLOP/s | MFU %.1f%% of %.0f GFLOP/s %s GEMM peak | "
              "%.3f s/step | loss %.3f\n",
              o.dtype.c_str(), r.tokens_per_s, r.model_gflops, 100.0 * r.model_gflops / peak, peak, o.dtype.c_str(),
              r.seconds_per_step, r.loss);
  std::printf("{\"engine\": \"forge\", \"dtype\": \"%s\", \"tokens_per_s\": %.2f, \"model_gflops\": %.2f, "
              "\"peak_gflops\": %.2f, \"mfu\": %.4f}\n",
              o.dtype.c_str(), r.tokens_per_s, r.model_gflops, peak, r.model_gflops / peak);
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

  BenchOptions bench_options;
  auto* bench = app.add_subcommand(
      "bench", "Measure this machine's GEMM peaks, or with --model the training throughput and MFU of a model");
  bench->add_option("--model", bench_options.model, "Hugging Face config.json of the model to train")
      ->check(CLI::ExistingFile);
  bench->add_option("--batch", bench_options.batch, "micro-batch size")->capture_default_str();
  bench->add_option("--seq", bench_options.seq, "sequence length")->capture_default_str();
  bench->add_option("--steps", bench_options.steps, "timed steps")->capture_default_str();
  bench->add_option("--warmup", bench_options.warmup, "untimed warm-up steps")->capture_default_str();
  bench->add_option("--dtype", bench_options.dtype, "compute dtype: bf16 or fp32")->capture_default_str();
  bench->add_option("--recompute", bench_options.recompute, "none, selective or full")->capture_default_str();
  bench->add_option("--peak-gflops", bench_options.peak_gflops, "GEMM peak for MFU (default: measured)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*train) return run_train(config_path, overrides);
    if (*bench) return run_bench(bench_options);
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "forge: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forge: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
