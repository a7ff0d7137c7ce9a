// Training throughput of a model on synthetic tokens (the `forge bench` measurement): full steps of
// forward, backward, gradient norm and AdamW, timed after warm-up.
#pragma once

#include <cstdint>
#include <string>

#include "forge/models/llama_config.h"
#include "forge/nn/compute.h"

namespace forge {

struct ThroughputResult {
  double tokens_per_s = 0;
  double model_gflops = 0;     // model FLOP/s (LlamaConfig::flops_per_token) / 1e9
  double seconds_per_step = 0;
  double loss = 0;             // last step's loss (sanity: ~ln(vocab) on random tokens)
};

ThroughputResult measure_training_throughput(const LlamaConfig& config, nn::ComputeOptions options, int64_t batch,
                                             int64_t seq, int warmup_steps, int steps);

}  // namespace forge
