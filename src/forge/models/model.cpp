#include "forge/models/model.h"

#include <algorithm>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/models/deepseek_v3/deepseek_v3_model.h"
#include "forge/models/gemma/gemma.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/llava/llava_model.h"
#include "forge/models/mistral/mistral.h"
#include "forge/models/mixtral/mixtral.h"
#include "forge/models/qwen2/qwen2.h"
#include "forge/models/qwen3/qwen3.h"
#include "forge/models/qwen3_moe/qwen3_moe.h"
#include "forge/models/starcoder2/starcoder2.h"

namespace forge::models {

StageSpec StageSpec::split(int64_t layers, int stages, int index) {
  FORGE_CHECK(stages >= 1 && index >= 0 && index < stages && layers >= stages,
              "stage {} of {} over {} layers", index, stages, layers);
  const int64_t base = layers / stages, extra = layers % stages;
  StageSpec s;
  s.first_layer = index * base + std::min<int64_t>(index, extra);
  s.end_layer = s.first_layer + base + (index < extra ? 1 : 0);
  s.pre_process = index == 0;
  s.post_process = index == stages - 1;
  return s;
}

StageSpec StageSpec::of_counts(const std::vector<int64_t>& layer_counts, int index) {
  const int stages = static_cast<int>(layer_counts.size());
  FORGE_CHECK(index >= 0 && index < stages, "stage {} of {}", index, stages);
  StageSpec s;
  for (int k = 0; k < index; ++k) s.first_layer += layer_counts[static_cast<size_t>(k)];
  s.end_layer = s.first_layer + layer_counts[static_cast<size_t>(index)];
  s.pre_process = index == 0;
  s.post_process = index == stages - 1;
  return s;
}

LossSum Model::forward_backward(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq,
                                float grad_scale) {
  if (!params().has_grads()) fail("forward_backward: this model was built for inference, without gradients");
  FORGE_CHECK(stage().pre_process && stage().post_process,
              "forward_backward needs the first and the last stage");
  const bool own_step = !params().grad_step_active();
  if (own_step) params().begin_grad_step(1);
  std::unique_ptr<StageActivations> saved;
  const StageOutput out = forward({ids, targets, batch, seq, grad_scale}, Tensor(), &saved);
  backward(Tensor(), *saved);
  FORGE_CHECK(!own_step || !params().grad_step_active(), "a parameter of the model received no gradient");
  return out.loss;
}

LossSum Model::forward_loss(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq) {
  FORGE_CHECK(stage().pre_process && stage().post_process, "forward_loss needs the first and the last stage");
  return forward({ids, targets, batch, seq, 0.0f}, Tensor(), nullptr).loss;
}

Tensor Model::forward_cached_images(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                                    const float* pixels, int64_t images) {
  if (images > 0 || pixels)
    fail("{} takes no images; a multimodal model is a LlavaForConditionalGeneration",
         config().architecture());
  return forward_cached(ids, batch, new_tokens, cache);
}

// Every family forge implements: one line here per models/<family>/.
const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {
      llama_family(),      deepseek_v3_family(), llava_family(),    qwen2_family(),
      qwen3_family(),      mistral_family(),     gemma2_family(),   gemma3_family(),
      starcoder2_family(), mixtral_family(),     qwen3_moe_family()};
  return families;
}

std::string family_names() {
  std::string names;
  for (const ModelFamily& f : model_families()) names += (names.empty() ? "" : ", ") + f.architecture;
  return names;
}

const ModelFamily& family_named(std::string_view architecture) {
  for (const ModelFamily& f : model_families())
    if (f.architecture == architecture) return f;
  fail("architecture '{}' is not one forge implements ({})", architecture, family_names());
}

// By `architectures`, checked against `model_type` when both are given (a Mistral config naming
// LlamaForCausalLM would otherwise fail later on a key, which hides the real reason).
const ModelFamily& family_of(const nlohmann::json& config, std::string_view source) {
  if (!config.is_object()) fail("{}: a model config must be a JSON object", source);
  const ModelFamily* family = nullptr;
  if (auto it = config.find("architectures"); it != config.end() && !it->is_null()) {
    if (!it->is_array() || it->empty()) fail("{}: 'architectures' must be a non-empty list of names", source);
    for (const auto& name : *it)
      for (const ModelFamily& f : model_families())
        if (!family && name.is_string() && name.get<std::string>() == f.architecture) family = &f;
    if (!family)
      fail("{}: architectures {} names none that forge implements ({})", source, it->dump(), family_names());
  }
  if (auto it = config.find("model_type"); it != config.end() && !it->is_null()) {
    const auto matches = [&](const ModelFamily& f) {
      return it->is_string() && it->get<std::string>() == f.model_type;
    };
    if (family && !matches(*family))
      fail("{}: model_type {} is not {}'s (\"{}\")", source, it->dump(), family->architecture,
           family->model_type);
    for (const ModelFamily& f : model_families())
      if (!family && matches(f)) family = &f;
    if (!family)
      fail("{}: model_type {} is not one that forge implements ({})", source, it->dump(), family_names());
  }
  // Neither key: forge's own configs have always meant LLaMA.
  return family ? *family : model_families().front();
}

std::unique_ptr<ModelConfig> parse_model_config(const nlohmann::json& config, std::string_view source) {
  return family_of(config, source).parse_config(config, source);
}

std::unique_ptr<ModelConfig> read_model_config(const std::string& path) {
  return parse_model_config(parse_json_strict(read_file(path, "model config"), path), path);
}

std::unique_ptr<Model> build_model(const ModelConfig& config, const nn::ComputeOptions& options,
                                   const StageSpec& stage, float init_std, bool with_grads,
                                   ParameterStore* into) {
  return family_named(config.architecture()).build(config, options, stage, init_std, with_grads, into);
}

}  // namespace forge::models
