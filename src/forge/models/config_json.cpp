#include "forge/models/config_json.h"

#include <cmath>
#include <iterator>
#include <limits>

#include "forge/core/error.h"

namespace forge::models::config_json {

using nlohmann::json;

std::optional<int64_t> read_integer(const json& object, const char* key, std::string_view source,
                                    std::string_view prefix) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (it->is_number_unsigned()) {
    if (it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail("{}: key '{}{}' is out of range: {}", source, prefix, key, it->dump());
    return static_cast<int64_t>(it->get<uint64_t>());
  }
  if (!it->is_number_integer())
    fail("{}: key '{}{}' must be an integer, got {} {}", source, prefix, key, it->type_name(), it->dump());
  return it->get<int64_t>();
}

std::optional<double> read_number(const json& object, const char* key, std::string_view source,
                                  std::string_view prefix) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (!it->is_number())
    fail("{}: key '{}{}' must be a number, got {} {}", source, prefix, key, it->type_name(), it->dump());
  return it->get<double>();
}

std::optional<bool> read_bool(const json& object, const char* key, std::string_view source,
                              std::string_view prefix) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean())
    fail("{}: key '{}{}' must be true or false, got {} {}", source, prefix, key, it->type_name(), it->dump());
  return it->get<bool>();
}

std::optional<std::string> read_string(const json& object, const char* key, std::string_view source,
                                       std::string_view prefix) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (!it->is_string())
    fail("{}: key '{}{}' must be a string, got {} {}", source, prefix, key, it->type_name(), it->dump());
  return it->get<std::string>();
}

int64_t require_integer(const json& object, const char* key, std::string_view source) {
  auto value = read_integer(object, key, source);
  if (!value) fail("{}: missing required key '{}'", source, key);
  return *value;
}

void require_positive(int64_t value, const char* key, std::string_view source) {
  if (value <= 0) fail("{}: key '{}' must be positive, got {}", source, key, value);
}

void require_positive_finite(double value, const char* key, std::string_view source) {
  if (!(value > 0.0) || !std::isfinite(value))
    fail("{}: key '{}' must be a positive finite number, got {}", source, key, value);
}

std::string human_bytes(long double bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  size_t unit = 0;
  while (bytes >= 1024 && unit + 1 < std::size(kUnits)) bytes /= 1024, ++unit;
  return unit == 0 ? fmt::format("{} B", static_cast<int64_t>(bytes))
                   : fmt::format("{:.1f} {}", static_cast<double>(bytes), kUnits[unit]);
}

}  // namespace forge::models::config_json
