// forge bench: this machine's GEMM peaks, or a model's training throughput and MFU.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "forge/models/llama_config.h"
#include "forge/nn/compute.h"
#include "forge/train/peak.h"
#include "forge/train/throughput.h"

namespace forge::cli {
namespace {

struct BenchOptions {
  std::string model;
  int64_t batch = 4, seq = 512;
  int steps = 5, warmup = 2;
  std::string dtype = "bf16", recompute = "none";
  double peak_gflops = 0;
};

int run_bench(const BenchOptions& o) {
  const DType dtype = dtype_from_name(o.dtype);
  if (o.model.empty()) {
    // 4096^3 GEMMs (137 GFLOP each), best of 3: long enough to be stable on a shared machine.
    std::printf("peak fp32 GEMM: %.0f GFLOP/s\n", measure_gemm_peak_gflops(DType::f32, 4096, 3));
    std::printf("peak bf16 GEMM: %.0f GFLOP/s\n", measure_gemm_peak_gflops(DType::bf16, 4096, 3));
    return 0;
  }
  LlamaConfig config = LlamaConfig::from_json_file(o.model);
  const double peak = o.peak_gflops > 0 ? o.peak_gflops : measure_gemm_peak_gflops(dtype, 4096, 3);
  ThroughputResult r = measure_training_throughput(config, {dtype, nn::recompute_from_name(o.recompute)}, o.batch,
                                                   o.seq, o.warmup, o.steps);
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

void add_bench_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<BenchOptions>();
  auto* bench = app.add_subcommand(
      "bench", "Measure this machine's GEMM peaks, or with --model the training throughput and MFU of a model");
  bench->add_option("--model", o->model, "Hugging Face config.json of the model to train")->check(CLI::ExistingFile);
  bench->add_option("--batch", o->batch, "micro-batch size")->capture_default_str();
  bench->add_option("--seq", o->seq, "sequence length")->capture_default_str();
  bench->add_option("--steps", o->steps, "timed steps")->capture_default_str();
  bench->add_option("--warmup", o->warmup, "untimed warm-up steps")->capture_default_str();
  bench->add_option("--dtype", o->dtype, "compute dtype: bf16 or fp32")->capture_default_str();
  bench->add_option("--recompute", o->recompute, "none, selective or full")->capture_default_str();
  bench->add_option("--peak-gflops", o->peak_gflops, "GEMM peak for MFU (default: measured)");
  commands.push_back({bench, [o] { return run_bench(*o); }});
}

}  // namespace forge::cli
