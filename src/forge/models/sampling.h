// Text generation for the trainer's sample: autoregressive decoding with temperature and top-k.
// (Without a KV cache each new token re-runs the window; `forge generate` with a KV cache is separate.)
#pragma once

#include <cstdint>
#include <vector>

#include "forge/models/llama.h"

namespace forge {

struct SamplingOptions {
  int64_t max_new_tokens = 100;
  int64_t context = 256;      // the window the model sees (at most max_position_embeddings)
  double temperature = 0.8;   // 0 = greedy
  int64_t top_k = 40;         // 0 = whole vocabulary
  uint64_t seed = 7;
};

// Picks a token from one row of logits; `draw` is a uniform number in [0, 1).
int32_t pick_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double draw);

std::vector<int32_t> generate(LlamaModel& model, const std::vector<int32_t>& prompt, const SamplingOptions& options);

}  // namespace forge
