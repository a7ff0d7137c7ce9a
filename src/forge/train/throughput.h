// Training throughput of a model on synthetic tokens (the `forge bench` measurement): full steps of
// forward, backward, gradient norm and AdamW, timed after warm-up, on the device options.device names, in
// the GEMM dtype or, with fp8, in FP8 under that recipe (the delayed recipe's scales updated every step).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "forge/kernels/profiler.h"
#include "forge/models/model.h"
#include "forge/nn/compute.h"
#include "forge/nn/fp8_context.h"

namespace forge::train {

struct ThroughputResult {
  double tokens_per_s = 0;
  double model_gflops = 0;  // model FLOP/s (ModelConfig::flops_per_token) / 1e9
  double seconds_per_step = 0;
  double loss = 0;             // last step's loss (sanity: ~ln(vocab) on random tokens)
  std::vector<double> losses;  // every step's, warm-up included (the same tokens every step: they fall)
  double peak_device_gib = 0;  // peak device memory of the run (GPU runs; 0 on the CPU)
  // CPU runs: the most host memory a timed step held beyond what lives between steps (the model, its
  // gradients and optimizer state): the activations kept for backward and the workspaces.
  double step_peak_mib = 0;
  // With profile_steps > 0: an op profile of that many more steps, run after the timed ones (which it does
  // not touch). A profile that fails leaves the timed result standing and says why in profile_error.
  std::optional<ops::OpProfile> profile;
  int profile_steps = 0;
  std::string profile_error;
};

// The same fixed batch of random tokens every step, so that the loss falls and runs of different
// precisions from the same seed can be compared step by step. A step is grad_accum micro-batches of `batch`
// sequences (each its own tokens) accumulated into one gradient, then one optimizer update, as training
// with train.grad_accum does: the update's cost is shared by grad_accum x batch x seq tokens.
ThroughputResult measure_training_throughput(const models::ModelConfig& config, nn::ComputeOptions options,
                                             int64_t batch, int64_t seq, int warmup_steps, int steps,
                                             const std::optional<nn::Fp8Options>& fp8 = std::nullopt,
                                             int64_t grad_accum = 1, int profile_steps = 0);

}  // namespace forge::train
