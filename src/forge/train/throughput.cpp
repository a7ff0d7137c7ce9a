#include "forge/train/throughput.h"

#include <chrono>
#include <vector>

#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/data/text/byte_sampler.h"
#include "forge/models/model.h"
#include "forge/optim/adamw.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;

ThroughputResult measure_training_throughput(const ModelConfig& config, nn::ComputeOptions options,
                                             int64_t batch, int64_t seq, int warmup_steps, int steps,
                                             const std::optional<nn::Fp8Options>& fp8, int64_t grad_accum,
                                             int profile_steps) {
  if (batch <= 0 || seq <= 0 || steps <= 0 || grad_accum <= 0)
    fail("bench: batch, seq, steps and grad_accum must be positive");
  if (profile_steps < 0)
    fail("bench: profile steps must be 0 (no profile) or positive, got {}", profile_steps);
  if (!device_usable(options.device)) fail("bench: no usable {} device", device_name(options.device));
  std::optional<nn::Fp8Context> fp8_context;
  if (fp8) options.fp8 = &fp8_context.emplace(*fp8);
  if (options.device != Device::cpu) device_memory(options.device).reset_peak();
  ThroughputResult r;
  {
    const std::unique_ptr<Model> built = build_model(config, options);
    Model& model = *built;
    model.initialize(1);
    AdamW optimizer(&model.params(), AdamWConfig{});
    const int64_t vocab = config.shape().vocab;
    // Micro-batch a holds sequences [a * batch, (a + 1) * batch) of seq + 1 tokens: inputs and shifted
    // targets.
    const int64_t sequences = batch * grad_accum;
    std::vector<int32_t> inputs(sequences * seq), targets(sequences * seq);
    for (int64_t s = 0; s < sequences; ++s)
      for (int64_t t = 0; t < seq; ++t) {
        const auto at = static_cast<uint64_t>(s * (seq + 1) + t);
        inputs[s * seq + t] = static_cast<int32_t>(splitmix64(at) % vocab);
        targets[s * seq + t] = static_cast<int32_t>(splitmix64(at + 1) % vocab);
      }
    const float scale = 1.0f / static_cast<float>(sequences * seq);
    auto step = [&] {
      model.params().zero_grads();
      model.params().begin_grad_step(static_cast<int>(grad_accum));
      LossSum loss;
      for (int64_t a = 0; a < grad_accum; ++a) {
        const LossSum part = model.forward_backward(inputs.data() + a * batch * seq,
                                                    targets.data() + a * batch * seq, batch, seq, scale);
        loss.sum += part.sum, loss.tokens += part.tokens;
      }
      // The gradient norm and the loss come back to the host: each step ends with the device idle.
      optimizer.step(1e-4f, clip_coefficient(global_grad_norm(model.params()), 1.0f));
      if (fp8_context) fp8_context->end_step();  // one process: the step's amaxes are already global
      r.loss = loss.mean();
      r.losses.push_back(r.loss);
    };
    for (int i = 0; i < warmup_steps; ++i) step();
    if (options.device != Device::cpu) device_memory(options.device).synchronize();
    const int64_t between_steps = memory_stats().live_bytes;
    reset_peak_memory();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    if (options.device == Device::cpu)
      r.step_peak_mib = static_cast<double>(memory_stats().peak_bytes - between_steps) / (1 << 20);
    if (options.device != Device::cpu) device_memory(options.device).synchronize();
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.seconds_per_step = seconds / steps;
    if (profile_steps > 0) {
      // After the timed steps, so that timing every op cannot slow them. The losses of these steps are kept
      // too.
      try {
        ops::profile_begin(options.device);
        try {
          for (int i = 0; i < profile_steps; ++i) step();
        } catch (...) {
          ops::profile_end();
          throw;
        }
        r.profile = ops::profile_end();
        r.profile_steps = profile_steps;
      } catch (const Error& e) {
        r.profile_error = e.what();
      }
    }
  }
  r.tokens_per_s = static_cast<double>(batch * grad_accum * seq) / r.seconds_per_step;
  r.model_gflops = r.tokens_per_s * config.flops_per_token(seq) / 1e9;
  if (options.device != Device::cpu)
    r.peak_device_gib = static_cast<double>(device_memory(options.device).peak_allocated()) / (1 << 30);
  return r;
}

}  // namespace forge::train
