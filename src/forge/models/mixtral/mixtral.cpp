#include "forge/models/mixtral/mixtral.h"

#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/models/config_json.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/moe_layers.h"

namespace forge::models {
namespace {
using nlohmann::json;
using namespace config_json;

// Hugging Face's MixtralConfig defaults (Mixtral-8x7B's shape) for the keys a file may leave out.
const DecoderSpec::MoeNames kNames{"block_sparse_moe.", "w1", "w3", "w2", /*correction_bias=*/false};

const json kDefaults = {{"vocab_size", 32000},
                        {"hidden_size", 4096},
                        {"intermediate_size", 14336},
                        {"num_hidden_layers", 32},
                        {"num_attention_heads", 32},
                        {"num_key_value_heads", 8},
                        {"max_position_embeddings", 131072},
                        {"rms_norm_eps", 1e-5},
                        {"rope_theta", 1e6}};
}  // namespace

MixtralConfig MixtralConfig::from_json(const json& j, std::string_view source) {
  MixtralConfig c;
  static_cast<LlamaConfig&>(c) =
      LlamaConfig::from_family_json(j, source, "mixtral",
                                    {"sliding_window", "num_local_experts", "num_experts_per_tok",
                                     "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"},
                                    kDefaults);
  // Absent or null: full causal attention (MixtralConfig's default is None).
  if (auto window = read_integer(j, "sliding_window", source)) {
    if (*window <= 0) fail("{}: key 'sliding_window' must be positive or null, got {}", source, *window);
    c.attention_window = *window;
  }
  c.num_local_experts = read_integer(j, "num_local_experts", source).value_or(c.num_local_experts);
  c.num_experts_per_tok = read_integer(j, "num_experts_per_tok", source).value_or(c.num_experts_per_tok);
  require_positive(c.num_local_experts, "num_local_experts", source);
  require_positive(c.num_experts_per_tok, "num_experts_per_tok", source);
  if (c.num_experts_per_tok > c.num_local_experts)
    fail("{}: key 'num_experts_per_tok' ({}) exceeds 'num_local_experts' ({})", source, c.num_experts_per_tok,
         c.num_local_experts);
  c.output_router_logits = read_bool(j, "output_router_logits", source).value_or(false);
  c.router_aux_loss_coef = read_router_aux_loss_coef(j, source, c.router_aux_loss_coef);
  if (read_number(j, "router_jitter_noise", source).value_or(0.0) != 0.0)
    fail("{}: key 'router_jitter_noise' must be 0 (forge's router does not perturb its inputs)", source);
  c.validate(source);
  return c;
}

json MixtralConfig::to_json() const {
  json j = family_json("MixtralForCausalLM", "mixtral");
  j["sliding_window"] = attention_window > 0 ? json(attention_window) : json(nullptr);
  j["num_local_experts"] = num_local_experts, j["num_experts_per_tok"] = num_experts_per_tok;
  j["output_router_logits"] = output_router_logits, j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["router_jitter_noise"] = 0.0;
  return j;
}

std::vector<std::pair<std::string, Shape>> MixtralConfig::tensor_shapes() const {
  // LLaMA's, each layer's mlp.* replaced by the router and the experts.
  std::vector<std::pair<std::string, Shape>> shapes;
  const int64_t h = hidden_size, f = intermediate_size;
  for (auto& [name, shape] : LlamaConfig::tensor_shapes()) {
    const size_t at = name.find(".mlp.");
    if (at == std::string::npos) {
      shapes.emplace_back(std::move(name), std::move(shape));
      continue;
    }
    if (name.find(".mlp.gate_proj.") == std::string::npos) continue;  // the block once, at gate_proj
    append_moe_shapes(shapes, name.substr(0, at + 1), kNames, num_local_experts, h, f);
  }
  return shapes;
}

int64_t MixtralConfig::matmul_parameters_per_layer() const {
  return attention_matmul_parameters(*this) +
         moe_matmul_parameters(num_local_experts, hidden_size, intermediate_size);
}

double MixtralConfig::flops_per_token(int64_t seq_len) const {
  const double active =
      static_cast<double>(attention_matmul_parameters(*this) + num_local_experts * hidden_size +
                          num_experts_per_tok * 3 * hidden_size * intermediate_size);
  return decoder_flops_per_token(*this, static_cast<double>(num_hidden_layers) * active, seq_len);
}

namespace {
DecoderSpec mixtral_spec(const MixtralConfig& config) {
  DecoderSpec s = llama_spec(config);
  for (LayerSpec& layer : s.layer_specs) layer.feed_forward = FeedForwardKind::moe;
  set_softmax_moe(s, config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                  config.intermediate_size, /*normalize=*/true, kNames);
  s.router_aux_loss_coef = config.training_router_aux_loss_coef();
  return s;
}
}  // namespace

MixtralModel::MixtralModel(const MixtralConfig& config, nn::ComputeOptions options, float init_std,
                           bool with_grads, StageSpec stage, ParameterStore* into)
    : DecoderStack(config, mixtral_spec(config), options, init_std, with_grads, stage, into, "") {}

ModelFamily mixtral_family() {
  return family_entry<MixtralConfig, MixtralModel>("MixtralForCausalLM", "mixtral");
}

}  // namespace forge::models
