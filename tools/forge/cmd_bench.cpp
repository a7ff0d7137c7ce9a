// forge bench: this machine's GEMM peaks, or a model's training throughput and MFU.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "commands.h"
#include "forge/core/device.h"
#include "forge/fp8/recipe.h"
#include "forge/models/model.h"
#include "forge/nn/compute.h"
#include "forge/train/peak.h"
#include "forge/train/throughput.h"

namespace forge::cli {
using namespace forge::models;
using namespace forge::train;
namespace {

struct BenchOptions {
  std::string model;
  int64_t batch = 4, seq = 512, grad_accum = 1;
  int steps = 5, warmup = 2, profile_steps = 0;
  std::string dtype = "bf16", activation_dtype = "auto", recompute = "none", device = "cpu", fp8 = "off";
  double peak_gflops = 0;
};

std::optional<nn::Fp8Options> fp8_options(const std::string& recipe) {
  if (recipe == "off") return std::nullopt;
  nn::Fp8Options o;
  o.recipe.recipe = fp8::recipe_from_name(recipe);
  // TransformerEngine's defaults: HYBRID for the per-tensor recipes, E4M3 everywhere for blocks.
  o.recipe.format = fp8::format_from_name(o.recipe.recipe == fp8::Recipe::block ? "e4m3" : "hybrid");
  nn::validate(o);
  return o;
}

int run_bench(const BenchOptions& o) {
  const DType dtype = dtype_from_name(o.dtype);
  if (o.model.empty()) {
    // 4096^3 GEMMs (137 GFLOP each), best of 3: long enough to be stable on a shared machine.
    std::printf("peak fp32 GEMM: %.0f GFLOP/s\n", measure_gemm_peak_gflops(DType::f32, 4096, 3));
    std::printf("peak bf16 GEMM: %.0f GFLOP/s\n", measure_gemm_peak_gflops(DType::bf16, 4096, 3));
    return 0;
  }
  const std::unique_ptr<ModelConfig> config = read_model_config(o.model);
  nn::ComputeOptions options{dtype, nn::recompute_from_name(o.recompute)};
  options.device = device_from_name(o.device);
  options.activation_dtype = o.activation_dtype == "auto" ? dtype : dtype_from_name(o.activation_dtype);
  options.residual_dtype = options.activation_dtype;
  if (options.activation_dtype == DType::bf16 && dtype != DType::bf16)
    fail("bench: --activation-dtype bf16 needs --dtype bf16");
  const std::optional<nn::Fp8Options> fp8 = fp8_options(o.fp8);
  const bool cuda = options.device == Device::cuda;
  if (cuda && !device_usable(options.device))
    fail("bench: --device cuda, but no usable GPU (or no CUDA backend)");
  // The precision's peak: the tensor-core table on CUDA (FP8 runs against the FP8 peak), measured on the CPU
  // (where FP8 is emulated through bf16 GEMMs).
  const std::string precision = fp8 ? "fp8 " + o.fp8 : o.dtype;
  double peak = o.peak_gflops;
  if (peak <= 0)
    peak = cuda ? (fp8 ? kHopperFp8PeakGflops : kHopperBf16PeakGflops)
                : measure_gemm_peak_gflops(dtype, 4096, 3);
  const std::string peak_name =
      cuda ? (fp8 ? "H100/H200 fp8 dense" : "H100/H200 bf16 dense") : o.dtype + " GEMM";
  ThroughputResult r = measure_training_throughput(*config, options, o.batch, o.seq, o.warmup, o.steps, fp8,
                                                   o.grad_accum, o.profile_steps);
  // A machine whose speed moves with its neighbours' load can run the model faster than the GEMMs ran just
  // before: the peak is measured again after the run and the higher one counts (MFU never reads a slow
  // moment of the machine as the model's efficiency).
  if (o.peak_gflops <= 0 && !cuda) {
    const double after = measure_gemm_peak_gflops(dtype, 4096, 3);
    if (after > 1.2 * peak || peak > 1.2 * after)
      std::fprintf(stderr, "bench: the measured GEMM peak moved from %.0f to %.0f GFLOP/s during the run\n",
                   peak, after);
    peak = std::max(peak, after);
  }
  std::printf(
      "forge %s on %s: %.0f tokens/s | %.1f model GFLOP/s | MFU %.1f%% of %.0f GFLOP/s %s peak | "
      "%.3f s/step | loss %.4f",
      precision.c_str(), o.device.c_str(), r.tokens_per_s, r.model_gflops, 100.0 * r.model_gflops / peak,
      peak, peak_name.c_str(), r.seconds_per_step, r.loss);
  if (cuda) std::printf(" | peak device memory %.1f GiB", r.peak_device_gib);
  if (!cuda) std::printf(" | step memory %.1f MiB", r.step_peak_mib);
  std::printf("\n");
  std::string losses;
  for (double l : r.losses) losses += (losses.empty() ? "" : ", ") + std::to_string(l);
  std::printf(
      "{\"engine\": \"forge\", \"device\": \"%s\", \"dtype\": \"%s\", \"activation_dtype\": \"%s\", "
      "\"fp8\": \"%s\", \"batch\": %lld, "
      "\"grad_accum\": %lld, \"seq\": %lld, \"tokens_per_s\": %.2f, \"model_gflops\": %.2f, "
      "\"peak_gflops\": %.2f, \"mfu\": %.4f, \"seconds_per_step\": %.5f, \"peak_device_gib\": %.2f, "
      "\"step_peak_mib\": %.2f, "
      "\"losses\": [%s]%s}\n",
      o.device.c_str(), o.dtype.c_str(), std::string(dtype_name(options.activation_dtype)).c_str(),
      o.fp8.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.grad_accum),
      static_cast<long long>(o.seq), r.tokens_per_s, r.model_gflops, peak, r.model_gflops / peak,
      r.seconds_per_step, r.peak_device_gib, r.step_peak_mib, losses.c_str(),
      r.profile ? (", \"profile\": " + ops::profile_json(*r.profile, r.profile_steps)).c_str() : "");
  if (r.profile) std::printf("%s", ops::format_profile(*r.profile, r.profile_steps).c_str());
  if (!r.profile_error.empty()) {
    // The timed result above stands; the profile did not.
    std::fprintf(stderr, "forge: error: bench: the op profile failed: %s\n", r.profile_error.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<BenchOptions>();
  auto* bench = app.add_subcommand(
      "bench",
      "Measure this machine's GEMM peaks, or with --model the training throughput and MFU of a model");
  bench->add_option("--model", o->model, "Hugging Face config.json of the model to train")
      ->check(CLI::ExistingFile);
  bench->add_option("--batch", o->batch, "micro-batch size")->capture_default_str();
  bench->add_option("--seq", o->seq, "sequence length")->capture_default_str();
  bench
      ->add_option(
          "--grad-accum", o->grad_accum,
          "micro-batches accumulated per optimizer step (a step trains grad-accum x batch sequences)")
      ->check(CLI::Range(int64_t{1}, int64_t{1000000}))
      ->capture_default_str();
  bench->add_option("--steps", o->steps, "timed steps")->capture_default_str();
  bench->add_option("--warmup", o->warmup, "untimed warm-up steps")->capture_default_str();
  bench
      ->add_option(
          "--profile-steps", o->profile_steps,
          "after the timed steps, run this many more with every op timed and print where a step's time goes "
          "(op, shape, calls, ms, TFLOP/s or GFLOP/s, GB/s; also in the JSON line as \"profile\")")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  // The choices listed are exactly those accepted (dtype_from_name alone would take fp16 or int32).
  bench->add_option("--dtype", o->dtype, "compute dtype: bf16 or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  bench
      ->add_option("--activation-dtype", o->activation_dtype,
                   "activations where their kernels take it (train.activation_dtype): auto (= --dtype), fp32 "
                   "or bf16")
      ->check(CLI::IsMember({"auto", "bf16", "fp32"}))
      ->capture_default_str();
  bench->add_option("--recompute", o->recompute, "none, selective or full")->capture_default_str();
  bench->add_option("--device", o->device, "where the model trains: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  bench
      ->add_option("--fp8", o->fp8,
                   "FP8 recipe of the transformer layers' GEMMs: off, delayed, current or block")
      ->check(CLI::IsMember({"off", "delayed", "current", "block"}))
      ->capture_default_str();
  bench->add_option(
      "--peak-gflops", o->peak_gflops,
      "peak for MFU (default: measured GEMM peak on the CPU; on CUDA the H100/H200 dense peak of the "
      "precision, 989 TFLOP/s bf16, 1979 fp8)");
  commands.push_back({bench, [o] { return run_bench(*o); }});
}

}  // namespace forge::cli
