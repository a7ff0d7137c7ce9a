// DeepseekV3Model on the CUDA backend against the same model on the CPU backend, with the twin fixtures'
// weights (tests/reference/deepseek_v3_twin.py; every routing decision at least 2e-3 from a tie): two AdamW
// steps with the balance loss and the bias update (MTP included), and cached inference over MLA's
// compressed cache. Bounds as for LLaMA (llama_cuda_test.cpp): the GPU's attention rounds q, k, v, p to
// bf16, so losses agree to 2e-3 relative and gradients and weights to a dissimilarity of 1e-4.
// Each case runs on the GPU (skipped without one) and under the device emulation (device_backends.h).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "device_backends.h"
#include "forge/ckpt/safetensors.h"
#include "forge/core/device.h"
#include "forge/models/deepseek_v3/deepseek_v3_model.h"
#include "forge/optim/adamw.h"
#include "test_files.h"

namespace forge::deepseek_v3_cuda_test {
using namespace forge::optim;
using namespace forge::models;
namespace {

using testing::fixture;

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

std::unique_ptr<DeepseekV3Model> load(const std::string& name, Device device, bool with_grads) {
  const ckpt::SafetensorsFile file = ckpt::SafetensorsFile::open(fixture(name + ".safetensors"));
  const DeepseekV3Config config = DeepseekV3Config::from_json_file(fixture(name + ".config.json"));
  nn::ComputeOptions options{DType::f32, nn::Recompute::none};
  options.device = device;
  auto model = std::make_unique<DeepseekV3Model>(config, options, 0.02f, with_grads);
  for (int i = 0; i < model->params().count(); ++i)
    model->params().param(i).copy_from(file.read(model->params().info(i).name));
  model->params().refresh_bf16();
  return model;
}

struct TrainRun {
  std::vector<double> losses;  // per step: main, then each MTP depth
  std::vector<float> first_grads, final_params;
};

TrainRun train(const std::string& name, Device device) {
  const ckpt::SafetensorsFile file = ckpt::SafetensorsFile::open(fixture(name + ".safetensors"));
  auto model = load(name, device, true);
  AdamW optimizer(&model->params(), AdamWConfig{});
  TrainRun run;
  for (int s = 0; s < 2; ++s) {
    const Tensor ids = file.read("step" + std::to_string(s) + ".input_ids");
    const Tensor labels = file.read("step" + std::to_string(s) + ".labels");
    model->params().zero_grads();
    model->set_balance_scale(0.01f / static_cast<float>(ids.dim(0)));
    const LossSum loss = model->forward_backward(ids.i32(), labels.i32(), ids.dim(0), ids.dim(1), 0.05f);
    run.losses.push_back(loss.mean());
    for (const MtpDepthStats& d : model->mtp_stats()) run.losses.push_back(d.loss.mean());
    if (s == 0) run.first_grads = host_vector(model->params().grads());
    optimizer.step(1e-2f, clip_coefficient(global_grad_norm(model->params()), 1.0f));
    model->apply_bias_updates(0.01f, false);
  }
  run.final_params = host_vector(model->params().params());
  return run;
}

class DeepseekV3Cuda : public DeviceBackendTest {};

TEST_P(DeepseekV3Cuda, TrainingMatchesCpu) {
  for (const std::string name : {"deepseek_v3_tiny", "deepseek_v3_mtp2"}) {
    const TrainRun gpu = train(name, Device::cuda), cpu = train(name, Device::cpu);
    ASSERT_EQ(gpu.losses.size(), cpu.losses.size()) << name;
    for (size_t i = 0; i < gpu.losses.size(); ++i)
      EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 2e-3 * std::abs(cpu.losses[i])) << name << " loss " << i;
    EXPECT_LT(dissimilarity(gpu.first_grads, cpu.first_grads), 1e-4) << name << ": gradients";
    EXPECT_LT(dissimilarity(gpu.final_params, cpu.final_params), 1e-4) << name << ": parameters";
  }
}

TEST_P(DeepseekV3Cuda, CachedInferenceMatchesCpu) {
  const std::string name = "deepseek_v3_yarn_mtp";
  auto gpu = load(name, Device::cuda, false), cpu = load(name, Device::cpu, false);
  nn::KvCache gpu_cache = gpu->make_cache(2, 32), cpu_cache = cpu->make_cache(2, 32);
  const std::vector<int32_t> prompt = {1, 5, 9, 13, 17, 2, 6, 10, 14, 18};  // 2 sequences of 5
  Tensor a = gpu->forward_cached(prompt.data(), 2, 5, gpu_cache, /*all_logits=*/true);
  Tensor b = cpu->forward_cached(prompt.data(), 2, 5, cpu_cache, /*all_logits=*/true);
  ASSERT_EQ(a.device(), Device::cpu);
  EXPECT_LT(dissimilarity(host_vector(a), host_vector(b)), 1e-4) << "prefill";
  for (int t = 0; t < 4; ++t) {
    const int32_t step[2] = {static_cast<int32_t>(20 + t), static_cast<int32_t>(40 + t)};
    a = gpu->forward_cached(step, 2, 1, gpu_cache), b = cpu->forward_cached(step, 2, 1, cpu_cache);
    EXPECT_LT(dissimilarity(host_vector(a), host_vector(b)), 1e-4) << "decode step " << t;
  }
  EXPECT_EQ(gpu_cache.length(), 9);
}

FORGE_INSTANTIATE_DEVICE_BACKENDS(DeepseekV3Cuda);

}  // namespace
}  // namespace forge::deepseek_v3_cuda_test
