// Text generation with a KV cache: the prompt runs through the model at once (prefill), then each new token
// runs alone against the cached keys and values of all earlier ones (decode).
//
// Sampling follows Hugging Face's warpers, in their order: logits / temperature, then top-k (keep the k most
// likely tokens), then top-p (keep the smallest set of the most likely remaining tokens whose probability
// mass, renormalised over what top-k kept, reaches p), then one draw from the renormalised distribution.
// Temperature 0 is greedy (argmax). Ties between equal logits go to the lower token id everywhere, so top-k 1
// and top-p -> 0 pick exactly the greedy token. The uniform draw for the n-th generated token is a pure
// function of (seed, n) (Philox), so a seed reproduces a generation on any machine and thread count.
//
// Generation stops after max_new_tokens, after producing a stop token (included in the output, as Hugging
// Face does), or when the sequence fills the context (prompt + generated = min(context,
// max_position_embeddings)): it stops there rather than sliding a window, and says so in the result.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "forge/models/model.h"

namespace forge::models {

struct SamplingOptions {
  int64_t max_new_tokens = 100;
  int64_t context = 0;       // most positions, prompt included (0 = max_position_embeddings, also the bound)
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 40;        // 0 = whole vocabulary
  double top_p = 1.0;        // nucleus mass in (0, 1]; 1 = off
  uint64_t seed = 7;
  std::vector<int32_t> stop_tokens;  // e.g. the tokenizer's end-of-sequence id(s)
  // > 0: only ids below it are drawn (the tokenizer's vocabulary, where the model's is padded past it: an
  // untrained model's draws would otherwise reach ids no tokenizer can decode).
  int64_t vocab_limit = 0;
  std::function<void(int32_t)> on_token;  // called with every new token as soon as it is chosen
  // A multimodal prompt's images ([images, channels, height, width], normalised, on the host): their features
  // replace the prompt's image tokens (Model::forward_cached_images).
  const float* pixels = nullptr;
  int64_t images = 0;
};

// Throws forge::Error naming the bad setting (negative or non-finite temperature, negative top_k, top_p
// outside (0, 1], negative max_new_tokens or context).
void validate_sampling_options(const SamplingOptions& options);

// Picks a token from one row of logits by the settings of `options` (temperature, top_k, top_p); `draw` is
// a uniform number in [0, 1). Without truncation (top_k 0 or >= vocab, top_p 1) the draw walks the
// cumulative distribution in token-id order; with it, in order of decreasing probability.
int32_t pick_token(const float* logits, int64_t vocab, const SamplingOptions& options, double draw);

// The uniform draw in (0, 1) for the n-th generated token (n from 0) under `seed`.
double sampling_draw(uint64_t seed, int64_t n);

enum class StopReason { max_new_tokens, stop_token, context_full };

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated tokens, prompt excluded (a final stop token included)
  StopReason stop = StopReason::max_new_tokens;
  int64_t prompt_tokens = 0;
  int64_t context = 0;         // positions available (min(context, max_position_embeddings))
  double prefill_seconds = 0;  // the prompt's forward pass
  double decode_seconds = 0;   // sampling every token and the one-token forward passes, callbacks excluded
  // "" unless generation stopped early at the context limit; then one line saying so.
  std::string note() const;
};

GenerationResult generate_sequence(Model& model, const std::vector<int32_t>& prompt,
                                   const SamplingOptions& options);

// The generated tokens only (the trainer's end-of-run sample). A stop at the context limit is noted on
// stderr.
std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt,
                              const SamplingOptions& options);

}  // namespace forge::models
