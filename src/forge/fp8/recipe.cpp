#include "forge/fp8/recipe.h"

#include "forge/core/error.h"

namespace forge::fp8 {

void validate(const RecipeConfig& config) {
  // Messages name the fp8.* keys of a training config, which hold these values.
  if (config.amax_history_len < 1) fail("fp8.amax_history_len must be >= 1, got {}", config.amax_history_len);
  // 2^-64 of the format's range is already far below any amax a scale could serve.
  if (config.margin < 0 || config.margin > 64) fail("fp8.margin must be in [0, 64], got {}", config.margin);
  if (config.tile != kBlockTile)
    fail("fp8 block tile must be {} (the block kernels' tile), got {}", kBlockTile, config.tile);
}

float fp8_max(DType fp8) {
  switch (fp8) {
    case DType::e4m3:
      return kE4m3Max;
    case DType::e5m2:
      return kE5m2Max;
    default:
      fail("fp8_max: {} is not an FP8 dtype (expected fp8_e4m3 or fp8_e5m2)", dtype_name(fp8));
  }
}

DType dtype_for(Format format, TensorRole role) {
  if (format == Format::hybrid && role == TensorRole::grad_output) return DType::e5m2;
  return DType::e4m3;
}

std::string_view recipe_name(Recipe recipe) {
  switch (recipe) {
    case Recipe::delayed:
      return "delayed";
    case Recipe::current:
      return "current";
    case Recipe::block:
      return "block";
  }
  fail("recipe_name: invalid recipe code {}", static_cast<int>(recipe));
}

std::string_view format_name(Format format) {
  switch (format) {
    case Format::e4m3:
      return "e4m3";
    case Format::hybrid:
      return "hybrid";
  }
  fail("format_name: invalid format code {}", static_cast<int>(format));
}

std::string_view amax_compute_name(AmaxCompute a) {
  switch (a) {
    case AmaxCompute::max:
      return "max";
    case AmaxCompute::most_recent:
      return "most_recent";
  }
  fail("amax_compute_name: invalid code {}", static_cast<int>(a));
}

Recipe recipe_from_name(std::string_view name) {
  for (Recipe r : {Recipe::delayed, Recipe::current, Recipe::block})
    if (recipe_name(r) == name) return r;
  fail("unknown fp8 recipe '{}' (expected one of delayed, current, block)", name);
}

Format format_from_name(std::string_view name) {
  for (Format f : {Format::e4m3, Format::hybrid})
    if (format_name(f) == name) return f;
  fail("unknown fp8 format '{}' (expected one of e4m3, hybrid)", name);
}

AmaxCompute amax_compute_from_name(std::string_view name) {
  for (AmaxCompute a : {AmaxCompute::max, AmaxCompute::most_recent})
    if (amax_compute_name(a) == name) return a;
  fail("unknown fp8 amax_compute '{}' (expected one of max, most_recent)", name);
}

}  // namespace forge::fp8
