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

bool is_generic_hf_key(std::string_view key) {
  static constexpr std::array<std::string_view, 58> kKeys = {"_name_or_path",
                                                             "architectures",
                                                             "transformers_version",
                                                             "torch_dtype",
                                                             "dtype",
                                                             "return_dict",
                                                             "output_hidden_states",
                                                             "output_attentions",
                                                             "torchscript",
                                                             "use_bfloat16",
                                                             "tf_legacy_loss",
                                                             "pruned_heads",
                                                             "chunk_size_feed_forward",
                                                             "is_encoder_decoder",
                                                             "is_decoder",
                                                             "cross_attention_hidden_size",
                                                             "add_cross_attention",
                                                             "tie_encoder_decoder",
                                                             "max_length",
                                                             "min_length",
                                                             "do_sample",
                                                             "early_stopping",
                                                             "num_beams",
                                                             "num_beam_groups",
                                                             "diversity_penalty",
                                                             "temperature",
                                                             "top_k",
                                                             "top_p",
                                                             "typical_p",
                                                             "repetition_penalty",
                                                             "length_penalty",
                                                             "no_repeat_ngram_size",
                                                             "encoder_no_repeat_ngram_size",
                                                             "bad_words_ids",
                                                             "num_return_sequences",
                                                             "output_scores",
                                                             "return_dict_in_generate",
                                                             "forced_bos_token_id",
                                                             "forced_eos_token_id",
                                                             "remove_invalid_values",
                                                             "exponential_decay_length_penalty",
                                                             "suppress_tokens",
                                                             "begin_suppress_tokens",
                                                             "finetuning_task",
                                                             "id2label",
                                                             "label2id",
                                                             "tokenizer_class",
                                                             "prefix",
                                                             "bos_token_id",
                                                             "pad_token_id",
                                                             "eos_token_id",
                                                             "sep_token_id",
                                                             "decoder_start_token_id",
                                                             "task_specific_params",
                                                             "problem_type",
                                                             "use_cache",
                                                             "attn_implementation",
                                                             "_attn_implementation_autoset"};
  return contains(kKeys, key);
}

}  // namespace forge::models::config_json
