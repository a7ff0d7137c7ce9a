// A whole LLaMA model trained on the CUDA backend against the same model on the CPU backend: parameters and
// activations on the GPU, the same initial weights (initialisation is a function of names and indices), the
// same tokens. Losses, gradients and a few AdamW steps must agree within what the backends' different
// arithmetic allows:
//   - the GEMMs run bf16 operands with fp32 accumulation on both, in different summation orders: relative
//     differences of order k * 2^-24 per GEMM, far below the next items;
//   - attention runs bf16 tensor-core products on the GPU and fp32 on the CPU: q, k, v, p rounded to bf16
//     (relative 2^-9) perturb each attention output by ~2^-9 relative, which the loss sees at ~1e-3 relative
//     at worst, and the gradients as a scale-free dissimilarity of ~(2^-9)^2 = 4e-6 (bound 1e-4);
//   - FP8 recipes round activations to 3 (E4M3) or 2 (E5M2) mantissa bits; a GEMM-order difference flips a
//     few codes by one FP8 step, so FP8 losses agree to 1e-2 relative.
// Each case runs on the GPU (skipped without one) and under the device emulation (device_backends.h: the CPU
// kernels, device memory closed to the host), except the error-path case at the end, which runs everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "device_backends.h"
#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/data/text/byte_sampler.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/models/llama/llama_model.h"
#include "forge/nn/fp8_context.h"
#include "forge/optim/adamw.h"

namespace forge::llama_cuda_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;
using namespace forge::train;
namespace {

// Dimensions are multiples of 128 where FP8 tensor cores and 128-wide scale blocks want them; the vocabulary
// and sequence are ragged.
LlamaConfig tiny_config() {
  LlamaConfig c;
  c.hidden_size = 256, c.intermediate_size = 512, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 64;
  c.vocab_size = 1000;
  c.max_position_embeddings = 256;
  return c;
}

struct Tokens {
  std::vector<int32_t> ids, targets;
};

Tokens tokens(int64_t batch, int64_t seq, int64_t vocab) {
  Tokens t;
  for (int64_t i = 0; i < batch * seq; ++i) {
    t.ids.push_back(static_cast<int32_t>(splitmix64(2 * i) % vocab));
    t.targets.push_back(i % 17 == 5 ? -1
                                    : static_cast<int32_t>(splitmix64(2 * i + 1) % vocab));  // a few ignored
  }
  return t;
}

double dissimilarity(const std::vector<float>& x, const std::vector<float>& y) {
  double xy = 0, xx = 0, yy = 0;
  for (size_t i = 0; i < x.size(); ++i)
    xy += double(x[i]) * y[i], xx += double(x[i]) * x[i], yy += double(y[i]) * y[i];
  return xx + yy == 0 ? 0 : 1 - 2 * xy / (xx + yy);
}

std::vector<float> host_vector(const Tensor& t) {
  const Tensor host = t.to(Device::cpu);
  return std::vector<float>(host.f32(), host.f32() + host.numel());
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<float> first_grads, final_params;
};

// `steps` optimizer steps of two micro-batches each on `device`.
TrainRun train(Device device, DType gemm_dtype, const std::optional<nn::Fp8Options>& fp8, int steps) {
  const LlamaConfig config = tiny_config();
  nn::ComputeOptions options{gemm_dtype, nn::Recompute::none};
  options.device = device;
  std::optional<nn::Fp8Context> context;
  if (fp8) options.fp8 = &context.emplace(*fp8);
  LlamaModel model(config, options);
  model.initialize(7);
  EXPECT_EQ(model.params().params().device(), device);
  AdamW optimizer(&model.params(), AdamWConfig{});
  // FP8 GEMMs on CUDA need token counts that are multiples of 16 (as TransformerEngine's); otherwise the
  // second micro-batch is ragged.
  const int64_t batch = 2, seq = 72, seq2 = fp8 ? 80 : 73;
  const Tokens a = tokens(batch, seq, config.vocab_size), b = tokens(batch, seq2, config.vocab_size);
  TrainRun run;
  for (int s = 0; s < steps; ++s) {
    model.params().zero_grads();
    model.params().begin_grad_step(2);
    LossSum l1 = model.forward_backward(a.ids.data(), a.targets.data(), batch, seq, 1.0f / 256);
    LossSum l2 = model.forward_backward(b.ids.data(), b.targets.data(), batch, seq2, 1.0f / 256);
    run.losses.push_back((l1.sum + l2.sum) / static_cast<double>(l1.tokens + l2.tokens));
    if (s == 0) run.first_grads = host_vector(model.params().grads());
    optimizer.step(1e-3f, clip_coefficient(global_grad_norm(model.params()), 1.0f));
    if (context) context->end_step();
  }
  run.final_params = host_vector(model.params().params());
  return run;
}

void expect_close_runs(const TrainRun& gpu, const TrainRun& cpu, double loss_rel, double grad_dissimilarity,
                       const std::string& what) {
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t s = 0; s < gpu.losses.size(); ++s)
    EXPECT_NEAR(gpu.losses[s], cpu.losses[s], loss_rel * std::abs(cpu.losses[s])) << what << ": step " << s;
  EXPECT_LT(dissimilarity(gpu.first_grads, cpu.first_grads), grad_dissimilarity) << what << ": gradients";
  EXPECT_LT(dissimilarity(gpu.final_params, cpu.final_params), grad_dissimilarity) << what << ": parameters";
}

class LlamaCuda : public DeviceBackendTest {};

TEST_P(LlamaCuda, Bf16TrainingMatchesCpu) {
  const TrainRun gpu = train(Device::cuda, DType::bf16, std::nullopt, 3),
                 cpu = train(Device::cpu, DType::bf16, std::nullopt, 3);
  EXPECT_NEAR(cpu.losses[0], std::log(1000.0), 0.5);  // a fresh model: about uniform
  expect_close_runs(gpu, cpu, 2e-3, 1e-4, "bf16");
}

TEST_P(LlamaCuda, Fp32TrainingMatchesCpu) {
  const TrainRun gpu = train(Device::cuda, DType::f32, std::nullopt, 2),
                 cpu = train(Device::cpu, DType::f32, std::nullopt, 2);
  expect_close_runs(gpu, cpu, 2e-3, 1e-4, "fp32");
}

TEST_P(LlamaCuda, TrainingIsBitwiseRepeatable) {
  const TrainRun a = train(Device::cuda, DType::bf16, std::nullopt, 2),
                 b = train(Device::cuda, DType::bf16, std::nullopt, 2);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.first_grads, b.first_grads);
  EXPECT_EQ(a.final_params, b.final_params);
}

TEST_P(LlamaCuda, Fp8RecipesMatchCpu) {
  for (const char* recipe : {"delayed", "current", "block"}) {
    nn::Fp8Options o;
    o.recipe.recipe = fp8::recipe_from_name(recipe);
    o.recipe.format = fp8::format_from_name(o.recipe.recipe == fp8::Recipe::block ? "e4m3" : "hybrid");
    const TrainRun gpu = train(Device::cuda, DType::bf16, o, 3), cpu = train(Device::cpu, DType::bf16, o, 3);
    expect_close_runs(gpu, cpu, 1e-2, 1e-2, recipe);
  }
}

TEST_P(LlamaCuda, LogitsComeBackToTheHost) {
  const LlamaConfig config = tiny_config();
  nn::ComputeOptions options{DType::bf16, nn::Recompute::none};
  options.device = Device::cuda;
  LlamaModel gpu(config, options);
  gpu.initialize(3);
  options.device = Device::cpu;
  LlamaModel cpu(config, options);
  cpu.initialize(3);
  const Tokens t = tokens(1, 40, config.vocab_size);
  const Tensor a = gpu.logits(t.ids.data(), 1, 40), b = cpu.logits(t.ids.data(), 1, 40);
  ASSERT_EQ(a.device(), Device::cpu);
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_LT(dissimilarity(host_vector(a), host_vector(b)), 1e-4);
}

// Inference through the KV cache on the GPU (cache appends, the tiled attention for the prompt, the decoding
// kernels for single tokens) against the CPU: a prompt of 20 tokens, then 5 tokens one at a time.
TEST_P(LlamaCuda, CachedInferenceMatchesCpu) {
  const LlamaConfig config = tiny_config();
  nn::ComputeOptions options{DType::bf16, nn::Recompute::none};
  options.device = Device::cuda;
  LlamaModel gpu(config, options, 0.02f, /*with_grads=*/false);
  gpu.initialize(5);
  options.device = Device::cpu;
  LlamaModel cpu(config, options, 0.02f, /*with_grads=*/false);
  cpu.initialize(5);
  KvCache gpu_cache = gpu.make_cache(2, 64), cpu_cache = cpu.make_cache(2, 64);
  const Tokens prompt = tokens(2, 20, config.vocab_size), next = tokens(2, 5, config.vocab_size);
  Tensor a = gpu.forward_cached(prompt.ids.data(), 2, 20, gpu_cache, /*all_logits=*/true);
  Tensor b = cpu.forward_cached(prompt.ids.data(), 2, 20, cpu_cache, /*all_logits=*/true);
  ASSERT_EQ(a.device(), Device::cpu);
  EXPECT_LT(dissimilarity(host_vector(a), host_vector(b)), 1e-4) << "prefill";
  for (int t = 0; t < 5; ++t) {
    const int32_t step[2] = {next.ids[t], next.ids[5 + t]};
    a = gpu.forward_cached(step, 2, 1, gpu_cache), b = cpu.forward_cached(step, 2, 1, cpu_cache);
    EXPECT_LT(dissimilarity(host_vector(a), host_vector(b)), 1e-4) << "decode step " << t;
  }
  EXPECT_EQ(gpu_cache.length(), 25);
}

FORGE_INSTANTIATE_DEVICE_BACKENDS(LlamaCuda);

// Runs everywhere: without a GPU, a CUDA model is refused with one line, not a crash.
TEST(LlamaCudaErrors, NoGpuIsOneClearError) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is usable here";
  nn::ComputeOptions options{DType::bf16, nn::Recompute::none};
  options.device = Device::cuda;
  try {
    LlamaModel model(tiny_config(), options);
    FAIL() << "a CUDA model was built without a GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no usable GPU"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge::llama_cuda_test
