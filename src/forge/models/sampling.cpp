#include "forge/models/sampling.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "forge/core/philox.h"

namespace forge::models {
namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

void validate_sampling_options(const SamplingOptions& o) {
  if (!std::isfinite(o.temperature) || o.temperature < 0)
    fail("sampling temperature must be a finite number >= 0 (0 = greedy), got {}", o.temperature);
  if (o.top_k < 0) fail("sampling top-k must be >= 0 (0 = whole vocabulary), got {}", o.top_k);
  if (!(o.top_p > 0 && o.top_p <= 1)) fail("sampling top-p must be in (0, 1] (1 = off), got {}", o.top_p);
  if (o.max_new_tokens < 0) fail("max_new_tokens must be >= 0, got {}", o.max_new_tokens);
  if (o.context < 0) fail("sampling context must be >= 0 (0 = max_position_embeddings), got {}", o.context);
  if (o.vocab_limit < 0)
    fail("sampling vocab_limit must be >= 0 (0 = the model's vocabulary), got {}", o.vocab_limit);
}

int32_t pick_token(const float* logits, int64_t vocab, const SamplingOptions& o, double draw) {
  FORGE_CHECK(vocab > 0, "pick_token: empty vocabulary");
  for (int64_t i = 0; i < vocab; ++i)
    if (std::isnan(logits[i])) fail("logit of token {} is NaN", i);
  // std::max_element returns the first maximum: the lowest id among ties.
  const int32_t argmax = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  if (o.temperature <= 0) return argmax;

  // Unnormalised probabilities relative to the largest logit, in double: for every id when top-k keeps the
  // whole vocabulary, else only for the k kept.
  const double top = logits[argmax], inverse_t = 1.0 / o.temperature;
  auto exp_weight = [&](int32_t id) { return std::exp((static_cast<double>(logits[id]) - top) * inverse_t); };
  const int64_t k = (o.top_k <= 0 || o.top_k >= vocab) ? vocab : o.top_k;
  std::vector<double> by_id;
  double vocab_total = 0;
  if (k == vocab) {
    by_id.resize(vocab);
    for (int32_t i = 0; i < vocab; ++i) vocab_total += by_id[i] = exp_weight(i);
  }
  auto weight = [&](int32_t id) { return by_id.empty() ? exp_weight(id) : by_id[id]; };

  if (k == vocab && o.top_p >= 1) {  // no truncation: the cumulative distribution in id order, O(vocab)
    double target = draw * vocab_total;
    int32_t last = argmax;
    for (int32_t i = 0; i < vocab; ++i) {
      if (by_id[i] == 0) continue;
      last = i;
      target -= by_id[i];
      if (target < 0) return i;
    }
    return last;  // rounding left a sliver of mass: the last token with any
  }

  // Most likely first, ties by lower id. Sorted lazily: the first k for top-k, then in growing prefixes
  // until the nucleus is covered, so a peaked distribution never sorts the whole vocabulary.
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto more_likely = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::vector<double> weights;  // weights of order[0 .. sorted)
  int64_t sorted = 0;
  auto sort_prefix = [&](int64_t n) {
    n = std::min(n, k);
    if (n <= sorted) return;
    std::partial_sort(order.begin() + sorted, order.begin() + n, order.begin() + k, more_likely);
    for (int64_t i = sorted; i < n; ++i) weights.push_back(weight(order[i]));
    sorted = n;
  };
  if (k < vocab) {
    // Bring the k most likely to the front (unsorted), then sort them.
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), more_likely);
    sort_prefix(k);
  }

  int64_t keep = k;
  if (o.top_p < 1) {
    // Mass of everything top-k kept; the nucleus is the shortest prefix whose mass reaches top_p of it.
    double total = vocab_total;
    if (k < vocab) {
      total = 0;
      for (double w : weights) total += w;
    }
    const double target = o.top_p * total;
    double mass = 0;
    keep = 0;
    for (int64_t chunk = 64; keep < k;) {
      if (keep == sorted) {
        sort_prefix(sorted + chunk);
        chunk *= 4;
      }
      mass += weights[keep++];
      if (mass >= target) break;
    }
  } else {
    sort_prefix(k);
  }

  double total = 0;
  for (int64_t i = 0; i < keep; ++i) total += weights[i];
  double target = draw * total;
  for (int64_t i = 0; i < keep; ++i) {
    target -= weights[i];
    if (target < 0) return order[i];
  }
  // Rounding left a sliver: the least likely kept token that has any mass.
  for (int64_t i = keep; i-- > 0;)
    if (weights[i] > 0) return order[i];
  return order[0];
}

double sampling_draw(uint64_t seed, int64_t n) {
  const auto index = static_cast<uint64_t>(n);
  auto bits = philox4x32_10({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), 0x5a4d, 0},
                            {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  return (static_cast<double>(bits[0]) + 0.5) / 4294967296.0;
}

std::string GenerationResult::note() const {
  if (stop != StopReason::context_full) return "";
  return fmt::format(
      "generation stopped after {} tokens: the context of {} positions is full ({} prompt tokens)",
      tokens.size(), context, prompt_tokens);
}

GenerationResult generate_sequence(Model& model, const std::vector<int32_t>& prompt,
                                   const SamplingOptions& options) {
  validate_sampling_options(options);
  if (prompt.empty()) fail("generation needs a non-empty prompt");
  const ModelShape config = model.config().shape();
  GenerationResult result;
  result.prompt_tokens = static_cast<int64_t>(prompt.size());
  result.context =
      options.context > 0 ? std::min(options.context, config.max_positions) : config.max_positions;
  if (result.prompt_tokens > result.context)
    fail("the prompt of {} tokens does not fit the context of {} positions", result.prompt_tokens,
         result.context);
  if (options.max_new_tokens == 0) return result;
  if (result.prompt_tokens == result.context) {
    result.stop = StopReason::context_full;
    return result;
  }

  // Positions the model runs: the prompt and every generated token but the last, which ends the sequence
  // at the latest when it fills the context.
  const int64_t capacity = std::min(result.context - 1, result.prompt_tokens + options.max_new_tokens - 1);
  nn::KvCache cache = model.make_cache(1, capacity);
  const int64_t vocab = options.vocab_limit > 0 ? std::min(config.vocab, options.vocab_limit) : config.vocab;
  auto start = std::chrono::steady_clock::now();
  Tensor logits = model.forward_cached_images(prompt.data(), 1, result.prompt_tokens, cache, options.pixels,
                                              options.images);
  auto now = std::chrono::steady_clock::now();
  result.prefill_seconds = seconds_between(start, now);
  start = now;

  for (int64_t n = 0;; ++n) {
    const int32_t token = pick_token(logits.f32(), vocab, options, sampling_draw(options.seed, n));
    result.tokens.push_back(token);
    if (options.on_token) {
      now = std::chrono::steady_clock::now();
      result.decode_seconds += seconds_between(start, now);
      options.on_token(token);
      start = std::chrono::steady_clock::now();
    }
    if (std::find(options.stop_tokens.begin(), options.stop_tokens.end(), token) !=
        options.stop_tokens.end()) {
      result.stop = StopReason::stop_token;
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) == options.max_new_tokens) {
      result.stop = StopReason::max_new_tokens;
      break;
    }
    if (result.prompt_tokens + static_cast<int64_t>(result.tokens.size()) == result.context) {
      result.stop = StopReason::context_full;
      break;
    }
    logits = model.forward_cached(&token, 1, 1, cache);
  }
  result.decode_seconds += seconds_between(start, std::chrono::steady_clock::now());
  return result;
}

std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt,
                              const SamplingOptions& options) {
  GenerationResult result = generate_sequence(model, prompt, options);
  if (result.stop == StopReason::context_full) std::fprintf(stderr, "note: %s\n", result.note().c_str());
  return std::move(result.tokens);
}

}  // namespace forge::models
