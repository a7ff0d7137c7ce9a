#include "forge/models/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "forge/core/philox.h"

namespace forge {

int32_t pick_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double draw) {
  if (temperature <= 0) return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  int64_t k = (top_k <= 0 || top_k > vocab) ? vocab : top_k;
  // Ties broken by the lower id so the choice is deterministic.
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<double> weights(k);
  const double top = logits[order[0]];
  double total = 0;
  for (int64_t i = 0; i < k; ++i) total += weights[i] = std::exp((logits[order[i]] - top) / temperature);
  double target = draw * total;
  for (int64_t i = 0; i < k; ++i) {
    target -= weights[i];
    if (target < 0) return order[i];
  }
  return order[k - 1];
}

std::vector<int32_t> generate(LlamaModel& model, const std::vector<int32_t>& prompt, const SamplingOptions& options) {
  if (prompt.empty()) fail("generation needs a non-empty prompt");
  const int64_t context = std::min(options.context, model.config().max_position_embeddings);
  std::vector<int32_t> tokens = prompt;
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    int64_t len = std::min<int64_t>(static_cast<int64_t>(tokens.size()), context);
    Tensor logits = model.logits(tokens.data() + tokens.size() - len, 1, len);
    const float* last = logits.f32() + (len - 1) * model.config().vocab_size;
    auto bits = philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), 0x5a4d, 0},
                              {static_cast<uint32_t>(options.seed), static_cast<uint32_t>(options.seed >> 32)});
    double draw = (static_cast<double>(bits[0]) + 0.5) / 4294967296.0;
    tokens.push_back(pick_token(last, model.config().vocab_size, options.temperature, options.top_k, draw));
  }
  return {tokens.begin() + static_cast<int64_t>(prompt.size()), tokens.end()};
}

}  // namespace forge
