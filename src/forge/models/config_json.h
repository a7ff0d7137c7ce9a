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

template <size_t N>
bool contains(const std::array<std::string_view, N>& keys, std::string_view key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

}  // namespace forge::models::config_json
