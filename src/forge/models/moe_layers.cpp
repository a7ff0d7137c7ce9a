#include "forge/models/moe_layers.h"

#include "forge/core/error.h"

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

}  // namespace forge::models
