// Checks every LLaMA-family model on the decoder stack must pass whatever its per-layer options (Qwen2's
// biases, Qwen3's QK-norm, Mistral's sliding window): the option changes the logits (it is wired in), the
// split backward (B then W) gives the fused order's gradients bit for bit under every recompute policy (and
// the same gradients under each), and
// a Hugging Face folder of the family goes out and comes back bit for bit.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/ckpt/safetensors.h"
#include "forge/models/model.h"
#include "forge/models/pretrained.h"
#include "op_harness.h"

namespace forge::testing {

// Logits of a batch of 2 x `seq` fixed tokens.
inline Tensor family_logits(models::Model& model, int64_t seq) {
  std::vector<int32_t> ids(2 * seq);
  for (int64_t i = 0; i < 2 * seq; ++i) ids[i] = static_cast<int32_t>((i * 7 + 3) % 64);
  return model.logits(ids.data(), 2, seq);
}

inline double max_difference(const Tensor& a, const Tensor& b) {
  double moved = 0;
  for (int64_t i = 0; i < a.numel(); ++i) moved = std::max<double>(moved, std::abs(a.f32()[i] - b.f32()[i]));
  return moved;
}

// B then W equals the fused backward bitwise; `check_grads` then looks at the fused gradients.
inline void expect_split_backward_bitwise(const models::ModelConfig& config, int64_t seq,
                                          const std::function<void(const ParameterStore&)>& check_grads) {
  std::vector<int32_t> ids(2 * seq), targets(2 * seq);
  for (int64_t i = 0; i < 2 * seq; ++i)
    ids[i] = static_cast<int32_t>((i * 7 + 3) % 64), targets[i] = static_cast<int32_t>((i * 5 + 1) % 64);
  // The fourth run: selective recompute of the norms' outputs too. Every policy gives none's gradients.
  Tensor none;
  int run = 0;
  for (nn::Recompute recompute :
       {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full, nn::Recompute::selective}) {
    nn::ComputeOptions options{DType::f32, recompute};
    if (run++ == 3) options.recompute_modules = nn::recompute_modules_from_names("core_attn,mlp_act,norm");
    auto fused = models::build_model(config, options), split = models::build_model(config, options);
    fused->initialize(3), split->initialize(3);
    fused->params().zero_grads(), split->params().zero_grads();
    fused->forward_backward(ids.data(), targets.data(), 2, seq, 0.1f);
    split->params().begin_grad_step(1);
    std::unique_ptr<models::StageActivations> saved;
    split->forward({ids.data(), targets.data(), 2, seq, 0.1f}, Tensor(), &saved);
    split->backward_input(Tensor(), *saved);
    split->backward_weight(*saved);
    const Tensor a = fused->params().grads(), b = split->params().grads();
    EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), a.bytes())) << nn::recompute_name(recompute);
    if (recompute == nn::Recompute::none && run == 1) none = a.clone();
    EXPECT_EQ(0, std::memcmp(a.raw(), none.raw(), a.bytes()))
        << nn::recompute_name(recompute) << " run " << run;
    check_grads(fused->params());
  }
}

// The fixture's weights (from transformers) load, give the fixture's logits, and export to a folder that
// transformers would read as `architecture` (`model_type`, holding `kept`) and forge reloads bit for bit; the
// folder without the tensor `required` is refused, naming it.
inline void expect_hugging_face_round_trip(const std::string& fixture, const std::string& architecture,
                                           const std::string& model_type, const std::string& kept,
                                           const std::string& required) {
  using nlohmann::json;
  const std::string fixtures = FORGE_FIXTURE_DIR;
  const auto config = models::read_model_config(fixtures + "/" + fixture + ".config.json");
  auto model = models::build_model(*config, {DType::f32, nn::Recompute::none});
  ckpt::SafetensorsFile file = ckpt::SafetensorsFile::open(fixtures + "/" + fixture + ".safetensors");
  ParameterStore& params = model->params();
  for (int i = 0; i < params.count(); ++i) file.read_into(params.info(i).name, params.param(i));
  params.refresh_bf16();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("forge_" + model_type + "_hf_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  models::HfExportOptions options;
  models::export_hugging_face(params, config->to_json(), dir, options);
  const json written = json::parse(std::ifstream(dir / "config.json"));
  EXPECT_EQ(written["model_type"], model_type);
  EXPECT_EQ(written["architectures"], json::array({architecture}));
  EXPECT_NO_THROW(ckpt::SafetensorsFile::open((dir / "model.safetensors").string()).read(kept));

  auto loaded = models::load_pretrained_model(dir, {DType::f32, nn::Recompute::none});
  EXPECT_EQ(loaded->config().architecture(), architecture);
  const Tensor ids = file.read("input_ids");
  const Tensor want = model->logits(ids.i32(), ids.dim(0), ids.dim(1));
  const Tensor got = loaded->logits(ids.i32(), ids.dim(0), ids.dim(1));
  ASSERT_EQ(got.numel(), want.numel());
  EXPECT_EQ(0, std::memcmp(got.raw(), want.raw(), got.bytes()));
  const Tensor golden = file.read("logits");
  double worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i)
    worst = std::max<double>(worst, std::abs(got.f32()[i] - golden.f32()[i]));
  EXPECT_LT(worst, 1e-4);
  std::vector<std::pair<std::string, Tensor>> without;
  for (int i = 0; i < params.count(); ++i)
    if (params.info(i).name != required) without.emplace_back(params.info(i).name, params.param(i));
  ckpt::write_safetensors((dir / "model.safetensors").string(), without);
  testing::expect_error_containing(
      [&] {
        models::load_pretrained_model(dir, {DType::f32, nn::Recompute::none});
      },
      {required});
  std::filesystem::remove_all(dir);
}

}  // namespace forge::testing
