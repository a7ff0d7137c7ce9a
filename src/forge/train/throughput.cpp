#include "forge/train/throughput.h"

#include <chrono>
#include <vector>

#include "forge/data/byte_sampler.h"
#include "forge/models/llama.h"
#include "forge/optim/adamw.h"

namespace forge {

ThroughputResult measure_training_throughput(const LlamaConfig& config, nn::ComputeOptions options, int64_t batch,
                                             int64_t seq, int warmup_steps, int steps) {
  if (batch <= 0 || seq <= 0 || steps <= 0) fail("bench: batch, seq and steps must be positive");
  LlamaModel model(config, options);
  model.initialize(1);
  AdamW optimizer(&model.params(), AdamWConfig{});
  std::vector<int32_t> ids(batch * (seq + 1));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(splitmix64(i) % config.vocab_size);
  std::vector<int32_t> inputs(ids.begin(), ids.begin() + batch * seq), targets(ids.begin() + 1, ids.end());
  const float scale = 1.0f / static_cast<float>(batch * seq);
  ThroughputResult r;
  auto step = [&] {
    model.params().zero_grads();
    LossSum loss = model.forward_backward(inputs.data(), targets.data(), batch, seq, scale);
    optimizer.step(1e-4f, clip_coefficient(global_grad_norm(model.params()), 1.0f));
    r.loss = loss.mean();
  };
  for (int i = 0; i < warmup_steps; ++i) step();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.seconds_per_step = seconds / steps;
  r.tokens_per_s = static_cast<double>(batch * seq) / r.seconds_per_step;
  r.model_gflops = r.tokens_per_s * config.flops_per_token(seq) / 1e9;
  return r;
}

}  // namespace forge
