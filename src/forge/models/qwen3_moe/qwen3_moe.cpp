#include "forge/models/qwen3_moe/qwen3_moe.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/models/config_json.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/moe_layers.h"
#include "forge/models/qwen2/qwen2.h"

namespace forge::models {
namespace {
using nlohmann::json;
using namespace config_json;

const DecoderSpec::MoeNames kNames{"mlp.", "gate_proj", "up_proj", "down_proj", /*correction_bias=*/false};

// Hugging Face's Qwen3MoeConfig defaults (Qwen3-30B-A3B's family shape) for the keys a file may leave out;
// head_dim, when absent, is hidden_size / num_attention_heads (transformers reads it with getattr).
const json kDefaults = {{"vocab_size", 151936},
                        {"hidden_size", 2048},
                        {"intermediate_size", 6144},
                        {"num_hidden_layers", 24},
                        {"num_attention_heads", 32},
                        {"num_key_value_heads", 4},
                        {"max_position_embeddings", 32768}};
}  // namespace

Qwen3MoeConfig Qwen3MoeConfig::from_json(const json& j, std::string_view source) {
  Qwen3MoeConfig c;
  static_cast<LlamaConfig&>(c) = LlamaConfig::from_family_json(
      j, source, "qwen3_moe",
      {"use_sliding_window", "sliding_window", "max_window_layers", "attention_bias", "num_experts",
       "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
       "mlp_only_layers", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef"},
      kDefaults);
  c.qk_norm = true;
  require_full_attention(j, source, "Qwen3-MoE");
  if (read_bool(j, "attention_bias", source).value_or(false))
    fail("{}: key 'attention_bias' is true, but forge's Qwen3-MoE has no attention biases (must be false)",
         source);
  if (auto window = read_integer(j, "sliding_window", source)) {
    require_positive(*window, "sliding_window", source);
    c.sliding_window = window;
  }
  c.max_window_layers = read_integer(j, "max_window_layers", source);
  // Released configs say num_experts; transformers 5 writes it as num_local_experts (its attribute map).
  const auto experts = read_integer(j, "num_experts", source),
             local = read_integer(j, "num_local_experts", source);
  if (experts && local && *experts != *local)
    fail("{}: keys 'num_experts' ({}) and 'num_local_experts' ({}) disagree", source, *experts, *local);
  c.num_experts = experts ? *experts : local.value_or(c.num_experts);
  c.num_experts_per_tok = read_integer(j, "num_experts_per_tok", source).value_or(c.num_experts_per_tok);
  c.moe_intermediate_size =
      read_integer(j, "moe_intermediate_size", source).value_or(c.moe_intermediate_size);
  c.decoder_sparse_step = read_integer(j, "decoder_sparse_step", source).value_or(c.decoder_sparse_step);
  require_positive(c.num_experts, "num_experts", source);
  require_positive(c.num_experts_per_tok, "num_experts_per_tok", source);
  require_positive(c.moe_intermediate_size, "moe_intermediate_size", source);
  require_positive(c.decoder_sparse_step, "decoder_sparse_step", source);
  if (c.num_experts_per_tok > c.num_experts)
    fail("{}: key 'num_experts_per_tok' ({}) exceeds 'num_experts' ({})", source, c.num_experts_per_tok,
         c.num_experts);
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) fail("{}: key 'mlp_only_layers' must be a list of layer indices", source);
    for (const json& v : *it) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_hidden_layers)
        fail("{}: key 'mlp_only_layers' holds {}, not a layer index in [0, {})", source, v.dump(),
             c.num_hidden_layers);
      c.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  c.norm_topk_prob = read_bool(j, "norm_topk_prob", source).value_or(c.norm_topk_prob);
  c.output_router_logits = read_bool(j, "output_router_logits", source).value_or(false);
  c.router_aux_loss_coef = read_router_aux_loss_coef(j, source, c.router_aux_loss_coef);
  c.validate(source);
  return c;
}

json Qwen3MoeConfig::to_json() const {
  json j = family_json("Qwen3MoeForCausalLM", "qwen3_moe");
  j["attention_bias"] = false, j["use_sliding_window"] = false;
  j["sliding_window"] = sliding_window ? json(*sliding_window) : json(nullptr);
  if (max_window_layers) j["max_window_layers"] = *max_window_layers;
  j["num_experts"] = num_experts, j["num_experts_per_tok"] = num_experts_per_tok;
  j["moe_intermediate_size"] = moe_intermediate_size, j["decoder_sparse_step"] = decoder_sparse_step;
  j["mlp_only_layers"] = mlp_only_layers, j["norm_topk_prob"] = norm_topk_prob;
  j["output_router_logits"] = output_router_logits, j["router_aux_loss_coef"] = router_aux_loss_coef;
  return j;
}

bool Qwen3MoeConfig::is_moe_layer(int64_t index) const {
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), index) == mlp_only_layers.end() &&
         (index + 1) % decoder_sparse_step == 0;
}

std::vector<std::pair<std::string, Shape>> Qwen3MoeConfig::tensor_shapes() const {
  // LLaMA's (with Qwen3's QK-norms), the MoE layers' mlp.* replaced by the router and the experts.
  std::vector<std::pair<std::string, Shape>> shapes;
  for (auto& [name, shape] : LlamaConfig::tensor_shapes()) {
    const size_t at = name.find(".mlp.");
    const size_t layer_at = name.find("layers.");
    if (at == std::string::npos || !is_moe_layer(std::stoll(name.substr(layer_at + 7)))) {
      shapes.emplace_back(std::move(name), std::move(shape));
      continue;
    }
    if (name.find(".mlp.gate_proj.") == std::string::npos) continue;  // the block once, at gate_proj
    append_moe_shapes(shapes, name.substr(0, at + 1), kNames, num_experts, hidden_size,
                      moe_intermediate_size);
  }
  return shapes;
}

int64_t Qwen3MoeConfig::num_parameters() const {
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) moe_layers += is_moe_layer(i) ? 1 : 0;
  const int64_t dense_mlp = 3 * hidden_size * intermediate_size;
  const int64_t moe = moe_matmul_parameters(num_experts, hidden_size, moe_intermediate_size);
  // LLaMA's count with every layer dense, then the MoE layers' MLPs swapped for their experts.
  return LlamaConfig::num_parameters() + moe_layers * (moe - dense_mlp);
}

double Qwen3MoeConfig::flops_per_token(int64_t seq_len) const {
  double layers = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i)
    layers += static_cast<double>(
        attention_matmul_parameters(*this) +
        (is_moe_layer(i)
             ? num_experts * hidden_size + num_experts_per_tok * 3 * hidden_size * moe_intermediate_size
             : 3 * hidden_size * intermediate_size));
  return decoder_flops_per_token(*this, layers, seq_len);
}

namespace {
DecoderSpec qwen3_moe_spec(const Qwen3MoeConfig& config) {
  DecoderSpec s = llama_spec(config);
  for (size_t i = 0; i < s.layer_specs.size(); ++i)
    if (config.is_moe_layer(static_cast<int64_t>(i))) s.layer_specs[i].feed_forward = FeedForwardKind::moe;
  set_softmax_moe(s, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                  config.moe_intermediate_size, config.norm_topk_prob, kNames);
  s.router_aux_loss_coef = config.training_router_aux_loss_coef();
  return s;
}
}  // namespace

Qwen3MoeModel::Qwen3MoeModel(const Qwen3MoeConfig& config, nn::ComputeOptions options, float init_std,
                             bool with_grads, StageSpec stage, ParameterStore* into)
    : DecoderStack(config, qwen3_moe_spec(config), options, init_std, with_grads, stage, into, "") {}

ModelFamily qwen3_moe_family() {
  return family_entry<Qwen3MoeConfig, Qwen3MoeModel>("Qwen3MoeForCausalLM", "qwen3_moe");
}

}  // namespace forge::models
