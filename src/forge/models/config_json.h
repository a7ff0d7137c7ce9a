// Reading a Hugging Face config.json strictly: the typed readers and checks every family's config uses, each
// failing with one line "<source>: key '<prefix><key>' ..." that names the culprit. A JSON null counts as
// absent (HF writes "rope_scaling": null, "q_lora_rank": null).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "forge/core/error.h"

namespace forge::models::config_json {

// prefix: where a nested key sits ("rope_scaling."), for messages.
std::optional<int64_t> read_integer(const nlohmann::json& object, const char* key, std::string_view source,
                                    std::string_view prefix = "");
std::optional<double> read_number(const nlohmann::json& object, const char* key, std::string_view source,
                                  std::string_view prefix = "");
std::optional<bool> read_bool(const nlohmann::json& object, const char* key, std::string_view source,
                              std::string_view prefix = "");
std::optional<std::string> read_string(const nlohmann::json& object, const char* key, std::string_view source,
                                       std::string_view prefix = "");
int64_t require_integer(const nlohmann::json& object, const char* key, std::string_view source);
void require_positive(int64_t value, const char* key, std::string_view source);
void require_positive_finite(double value, const char* key, std::string_view source);
// "12.3 TiB", "24.0 GiB", "512 B": sizes of any magnitude, for messages about a model's memory.
std::string human_bytes(long double bytes);

// Keys every Hugging Face PretrainedConfig may write (generation defaults, label maps, output switches,
// bookkeeping): none changes a model's computation, and nested configs (a LLaVA's vision_config and
// text_config) often carry the whole list.
bool is_generic_hf_key(std::string_view key);

// A size key's upper bound: far above any published model, low enough that no size wraps the int the
// modules take and no product of sizes wraps int64 (a config beyond it is corrupt or hostile, not a model).
template <typename Config>
struct SizeLimit {
  const char* key;
  int64_t Config::*field;
  int64_t max;
};
// forge's bound on a model's parameters: beyond every machine (4 PiB of fp32 weights) and far from int64's
// end, so that counts of parameters and their bytes never wrap.
constexpr long double kMaxParameters = static_cast<long double>(int64_t{1} << 50);
// Refuses a size above its limit, then a model of more than kMaxParameters, before any product of sizes is
// formed in int64 (a wrapped size would build another model). parameters: the count in long double (exact
// to 2^64, whatever the sizes); summary: the sizes that make a model big, for the message.
template <typename Config, size_t N>
void check_size_limits(const Config& config, const SizeLimit<Config> (&limits)[N], long double parameters,
                       const std::string& summary, std::string_view source) {
  for (const SizeLimit<Config>& limit : limits)
    if (config.*limit.field > limit.max)
      fail(
          "{}: key '{}' is {}, above forge's limit of {}; the model would need {} for its fp32 weights alone",
          source, limit.key, config.*limit.field, limit.max, human_bytes(4 * parameters));
  if (parameters > kMaxParameters)
    fail(
        "{}: the model would have {:.3g} parameters ({}), needing {} for its fp32 weights alone; forge's "
        "limit is 2^50",
        source, static_cast<double>(parameters), summary, human_bytes(4 * parameters));
}

template <size_t N>
bool contains(const std::array<std::string_view, N>& keys, std::string_view key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

}  // namespace forge::models::config_json
