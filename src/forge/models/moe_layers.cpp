#include "forge/models/moe_layers.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/models/config_json.h"

namespace forge::models {

void append_moe_shapes(std::vector<std::pair<std::string, Shape>>& shapes, const std::string& layer,
                       const DecoderSpec::MoeNames& names, int64_t experts, int64_t hidden, int64_t ffn) {
  FORGE_CHECK(!names.correction_bias, "append_moe_shapes: a correction bias is DeepSeek-V3's own");
  const std::string p = layer + names.block;
  shapes.push_back({p + "gate.weight", {experts, hidden}});
  for (int64_t e = 0; e < experts; ++e) {
    const std::string m = p + "experts." + std::to_string(e) + ".";
    shapes.push_back({m + names.gate + ".weight", {ffn, hidden}});
    shapes.push_back({m + names.up + ".weight", {ffn, hidden}});
  }
  for (int64_t e = 0; e < experts; ++e)
    shapes.push_back({p + "experts." + std::to_string(e) + "." + names.down + ".weight", {hidden, ffn}});
}

void set_softmax_moe(DecoderSpec& spec, int64_t hidden, int64_t experts, int64_t top_k, int64_t ffn,
                     bool normalize, const DecoderSpec::MoeNames& names) {
  spec.moe.hidden = hidden, spec.moe.experts = experts, spec.moe.top_k = top_k;
  spec.moe.expert_ffn = ffn, spec.moe.shared_ffn = 0;
  spec.moe.score = ops::MoeScore::softmax, spec.moe.normalize = normalize, spec.moe.scaling = 1.0f;
  spec.moe_names = names;
}

double read_router_aux_loss_coef(const nlohmann::json& config, std::string_view source, double fallback) {
  const double coef = config_json::read_number(config, "router_aux_loss_coef", source).value_or(fallback);
  if (!std::isfinite(coef) || coef < 0)
    fail("{}: key 'router_aux_loss_coef' must be a finite number >= 0, got {}", source, coef);
  return coef;
}

}  // namespace forge::models
