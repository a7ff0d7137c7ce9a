// FP8 recipes as in TransformerEngine: which 8-bit format each tensor role uses and how its scale is chosen.
//   delayed: per-tensor scale from an amax history of previous steps (scaling.h, DelayedScalingGroup);
//   current: per-tensor scale from the tensor's own amax, computed just before the cast;
//   block:   DeepSeek-V3 / TE Float8BlockScaling, one scale per 1x128 tile (activations, gradients) or per
//            128x128 block (weights), computed from that tile's amax (quantize.h).
#pragma once

#include <cstdint>
#include <string_view>

#include "forge/core/dtype.h"

namespace forge::fp8 {

// e4m3: every tensor in E4M3. hybrid: E4M3 for forward tensors (inputs, weights), E5M2 for gradients,
// whose wider range matters more than their precision.
enum class Format : uint8_t { e4m3, hybrid };
// How delayed scaling reduces the history to one amax: its maximum, or the latest entry alone.
enum class AmaxCompute : uint8_t { max, most_recent };
enum class Recipe : uint8_t { delayed, current, block };
// The operand roles of a Linear's three GEMMs.
enum class TensorRole : uint8_t { input, weight, grad_output };

// The tile edge of the block recipe; the block kernels (quantize.h) are written for it.
constexpr int64_t kBlockTile = 128;

struct RecipeConfig {
  Recipe recipe = Recipe::delayed;
  Format format = Format::hybrid;
  // Delayed scaling: history length (steps) and its reduction; TE's defaults.
  int64_t amax_history_len = 1024;
  AmaxCompute amax_compute = AmaxCompute::max;
  // scale = (fp8_max / amax) / 2^margin: a margin > 0 leaves headroom for amax growth (delayed, current).
  int margin = 0;
  // Block recipe only: round each tile's scale down to a power of two, so that scaling is exact (TE's
  // Float8BlockScaling default).
  bool power_of_two_scales = true;
  // Block recipe only: must be kBlockTile.
  int64_t tile = kBlockTile;
};

// Throws forge::Error naming the first bad field (history length < 1, margin outside [0, 64], tile !=
// kBlockTile). The one statement of these rules: training configs check their fp8.* keys through it.
void validate(const RecipeConfig& config);

// The largest finite value of an FP8 dtype: 448 (E4M3), 57344 (E5M2); throws for a non-FP8 dtype.
float fp8_max(DType fp8);
// The FP8 dtype a tensor of `role` uses under `format`.
DType dtype_for(Format format, TensorRole role);

std::string_view recipe_name(Recipe recipe);        // "delayed", "current", "block"
std::string_view format_name(Format format);        // "e4m3", "hybrid"
std::string_view amax_compute_name(AmaxCompute a);  // "max", "most_recent"
// Parsers for the names above; they throw forge::Error naming the bad value and listing the valid ones.
Recipe recipe_from_name(std::string_view name);
Format format_from_name(std::string_view name);
AmaxCompute amax_compute_from_name(std::string_view name);

}  // namespace forge::fp8
