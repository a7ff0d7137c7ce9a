#include "forge/models/deepseek_v3/deepseek_v3_config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/suggest.h"
#include "forge/kernels/rope_tables.h"
#include "forge/models/config_json.h"

namespace forge::models {
namespace {

using nlohmann::json;
using namespace config_json;

// Keys forge reads: every key of HF's DeepseekV3Config that changes the computation. head_dim and
// qk_head_dim are attributes HF derives (qk_rope_head_dim and qk_nope + qk_rope) and save_pretrained writes;
// they are checked against the sizes they derive from.
constexpr std::array<std::string_view, 36> kKnownKeys = {"rope_parameters",
                                                         "hidden_size",
                                                         "intermediate_size",
                                                         "moe_intermediate_size",
                                                         "num_hidden_layers",
                                                         "num_attention_heads",
                                                         "num_key_value_heads",
                                                         "q_lora_rank",
                                                         "kv_lora_rank",
                                                         "qk_nope_head_dim",
                                                         "qk_rope_head_dim",
                                                         "v_head_dim",
                                                         "head_dim",
                                                         "qk_head_dim",
                                                         "n_routed_experts",
                                                         "n_shared_experts",
                                                         "num_experts_per_tok",
                                                         "n_group",
                                                         "topk_group",
                                                         "routed_scaling_factor",
                                                         "norm_topk_prob",
                                                         "scoring_func",
                                                         "topk_method",
                                                         "first_k_dense_replace",
                                                         "moe_layer_freq",
                                                         "num_nextn_predict_layers",
                                                         "rope_theta",
                                                         "rope_scaling",
                                                         "rope_interleave",
                                                         "attention_bias",
                                                         "attention_dropout",
                                                         "rms_norm_eps",
                                                         "tie_word_embeddings",
                                                         "vocab_size",
                                                         "max_position_embeddings",
                                                         "hidden_act"};

// The names to_json always writes (checked when present).
constexpr std::array<std::string_view, 2> kNameKeys = {"architectures", "model_type"};

// Bookkeeping keys kept verbatim for export: they do not change what forge computes. Names and dtype of the
// saved weights, token ids (the tokenizer's), the std of HF's own initialiser, HF's generation cache and
// tensor-parallel split (pretraining_tp), DeepSeek's expert-parallel size (ep_size) and its auxiliary-loss
// hints (aux_loss_alpha, seq_aux: the balance-loss coefficient is a setting of the training run, not of
// the architecture).
constexpr std::array<std::string_view, 13> kKeptKeys = {"transformers_version",
                                                        "torch_dtype",
                                                        "use_cache",
                                                        "_name_or_path",
                                                        "auto_map",
                                                        "bos_token_id",
                                                        "eos_token_id",
                                                        "pad_token_id",
                                                        "initializer_range",
                                                        "pretraining_tp",
                                                        "ep_size",
                                                        "aux_loss_alpha",
                                                        "seq_aux"};

constexpr std::array<std::string_view, 10> kRopeScalingKeys = {
    "rope_type",        "type",      "factor", "original_max_position_embeddings",
    "beta_fast",        "beta_slow", "mscale", "mscale_all_dim",
    "attention_factor", "truncate"};

std::string did_you_mean_key(std::string_view key) {
  std::vector<std::string_view> candidates(kKnownKeys.begin(), kKnownKeys.end());
  candidates.insert(candidates.end(), kKeptKeys.begin(), kKeptKeys.end());
  candidates.insert(candidates.end(), kNameKeys.begin(), kNameKeys.end());
  return forge::did_you_mean(key, candidates);
}

// The keys whose only accepted value is the one forge implements, and the two name keys.
void check_fixed_keys(const json& j, std::string_view source) {
  if (auto it = j.find("hidden_act"); it != j.end() && !(it->is_string() && it->get<std::string>() == "silu"))
    fail("{}: key 'hidden_act' is {}, but forge's DeepSeek-V3 MLPs implement only \"silu\"", source,
         it->dump());
  if (auto it = j.find("attention_bias"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) fail("{}: key 'attention_bias' must be true or false, got {}", source, it->dump());
    if (it->get<bool>())
      fail(
          "{}: key 'attention_bias' is true: biases on q_a_proj, kv_a_proj_with_mqa and o_proj are not "
          "supported yet",
          source);
  }
  if (auto it = j.find("attention_dropout");
      it != j.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 0.0))
    fail("{}: key 'attention_dropout' is {}, but forge does not implement dropout (must be 0)", source,
         it->dump());
  if (auto it = j.find("model_type");
      it != j.end() && !(it->is_string() && it->get<std::string>() == "deepseek_v3"))
    fail("{}: key 'model_type' is {}, expected \"deepseek_v3\"", source, it->dump());
  if (auto it = j.find("architectures"); it != j.end()) {
    if (!it->is_array() || it->empty() || std::any_of(it->begin(), it->end(), [](const json& a) {
          return !(a.is_string() && a.get<std::string>() == "DeepseekV3ForCausalLM");
        }))
      fail("{}: key 'architectures' is {}, expected [\"DeepseekV3ForCausalLM\"]", source, it->dump());
  }
}

// `rope` is the object of key `name`: "rope_scaling" (HF up to v4), or "rope_parameters" (transformers v5,
// which also holds rope_theta).
YarnScaling read_rope_scaling(const json& rope, const std::string& name, int64_t max_position_embeddings,
                              std::string_view source) {
  YarnScaling yarn;
  if (!rope.is_object())
    fail("{}: key '{}' must be an object or null, got {} {}", source, name, rope.type_name(), rope.dump());
  for (const auto& [key, value] : rope.items()) {
    if (key == "rope_theta" && name == "rope_parameters") continue;
    if (!contains(kRopeScalingKeys, key))
      fail("{}: unknown key '{}.{}'{}", source, name, key,
           forge::did_you_mean(
               key, std::vector<std::string_view>(kRopeScalingKeys.begin(), kRopeScalingKeys.end())));
  }
  // DeepSeek's own config spells the kind "type", newer HF configs "rope_type".
  std::optional<std::string> type;
  for (const char* type_key : {"rope_type", "type"}) {
    auto t = rope.find(type_key);
    if (t == rope.end()) continue;
    if (!t->is_string()) fail("{}: key '{}.{}' must be a string, got {}", source, name, type_key, t->dump());
    if (type && *type != t->get<std::string>())
      fail("{}: keys '{}.rope_type' and '{}.type' disagree", source, name, name);
    type = t->get<std::string>();
  }
  if (!type) fail("{}: missing required key '{}.rope_type'", source, name);
  if (*type == "default") return yarn;
  if (*type != "yarn")
    fail("{}: unsupported {} type '{}' (forge's DeepSeek-V3 implements 'yarn' and 'default')", source, name,
         *type);
  const std::string prefix = name + ".";
  const std::string_view field = prefix;
  yarn.enabled = true;
  auto factor = read_number(rope, "factor", source, field);
  if (!factor) fail("{}: missing required key '{}factor' for rope_type 'yarn'", source, field);
  yarn.factor = *factor;
  yarn.original_max_position_embeddings =
      read_integer(rope, "original_max_position_embeddings", source, field).value_or(max_position_embeddings);
  yarn.beta_fast = read_number(rope, "beta_fast", source, field).value_or(yarn.beta_fast);
  yarn.beta_slow = read_number(rope, "beta_slow", source, field).value_or(yarn.beta_slow);
  yarn.mscale = read_number(rope, "mscale", source, field).value_or(0.0);
  yarn.mscale_all_dim = read_number(rope, "mscale_all_dim", source, field).value_or(0.0);
  if (auto attention_factor = read_number(rope, "attention_factor", source, field)) {
    if (!(*attention_factor > 0.0) || !std::isfinite(*attention_factor))
      fail("{}: key '{}attention_factor' must be a positive finite number, got {}", source, field,
           *attention_factor);
    yarn.attention_factor = *attention_factor;
  }
  yarn.truncate = read_bool(rope, "truncate", source, field).value_or(true);
  return yarn;
}

// Upper bounds far above any published model (DeepSeek-V3: hidden 7168, 61 layers, 256 experts, vocabulary
// 129280, 163840 positions), low enough that no size wraps an int and no product of sizes wraps int64.
constexpr SizeLimit<DeepseekV3Config> kSizeLimits[] = {
    {"hidden_size", &DeepseekV3Config::hidden_size, int64_t{1} << 20},
    {"intermediate_size", &DeepseekV3Config::intermediate_size, int64_t{1} << 22},
    {"moe_intermediate_size", &DeepseekV3Config::moe_intermediate_size, int64_t{1} << 22},
    {"num_hidden_layers", &DeepseekV3Config::num_hidden_layers, int64_t{1} << 16},
    {"num_attention_heads", &DeepseekV3Config::num_attention_heads, int64_t{1} << 16},
    {"q_lora_rank", &DeepseekV3Config::q_lora_rank, int64_t{1} << 20},
    {"kv_lora_rank", &DeepseekV3Config::kv_lora_rank, int64_t{1} << 20},
    {"qk_nope_head_dim", &DeepseekV3Config::qk_nope_head_dim, int64_t{1} << 16},
    {"qk_rope_head_dim", &DeepseekV3Config::qk_rope_head_dim, int64_t{1} << 16},
    {"v_head_dim", &DeepseekV3Config::v_head_dim, int64_t{1} << 16},
    {"n_routed_experts", &DeepseekV3Config::n_routed_experts, int64_t{1} << 16},
    {"n_shared_experts", &DeepseekV3Config::n_shared_experts, int64_t{1} << 16},
    {"num_nextn_predict_layers", &DeepseekV3Config::num_nextn_predict_layers, int64_t{1} << 10},
    {"vocab_size", &DeepseekV3Config::vocab_size, int64_t{1} << 30},  // token ids are int32
    {"max_position_embeddings", &DeepseekV3Config::max_position_embeddings, int64_t{1} << 24},
};

// The parameter count in long double, for sizes that may be out of range.
long double wide_parameter_count(const DeepseekV3Config& c) {
  const long double h = c.hidden_size, heads = c.num_attention_heads,
                    qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const long double q = c.q_lora_rank > 0 ? h * c.q_lora_rank + c.q_lora_rank +
                                                static_cast<long double>(c.q_lora_rank) * heads * qk
                                          : h * heads * qk;
  const long double attention =
      q + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank +
      static_cast<long double>(c.kv_lora_rank) * heads * (c.qk_nope_head_dim + c.v_head_dim) +
      heads * c.v_head_dim * h + 2 * h;
  const long double moe =
      static_cast<long double>(c.n_routed_experts) * h +
      3 * h * c.moe_intermediate_size * (static_cast<long double>(c.n_routed_experts) + c.n_shared_experts);
  const long double layers = static_cast<long double>(c.num_hidden_layers) + c.num_nextn_predict_layers;
  const long double mlp = std::max<long double>(moe, 3 * h * c.intermediate_size);
  return static_cast<long double>(c.vocab_size) * h * 2 + layers * (attention + mlp + 2 * h * h + 3 * h) + h;
}

std::string size_summary(const DeepseekV3Config& c) {
  return fmt::format(
      "hidden_size {}, num_hidden_layers {} + {} MTP, n_routed_experts {}, moe_intermediate_size {}, "
      "vocab_size {}",
      c.hidden_size, c.num_hidden_layers, c.num_nextn_predict_layers, c.n_routed_experts,
      c.moe_intermediate_size, c.vocab_size);
}

}  // namespace

DeepseekV3Config DeepseekV3Config::from_json_file(const std::filesystem::path& path) {
  const std::string source = path.string();
  const std::string text = read_file(path, "model config");
  return from_json(parse_json_strict(text, source), source);
}

DeepseekV3Config DeepseekV3Config::from_json(const json& j, std::string_view source) {
  if (!j.is_object()) fail("{}: expected a JSON object at the top level, got {}", source, j.type_name());
  DeepseekV3Config c;
  for (const auto& [key, value] : j.items()) {
    if (contains(kKnownKeys, key) || contains(kNameKeys, key)) continue;
    if (contains(kKeptKeys, key)) {
      c.kept[key] = value;
      continue;
    }
    if (key == "quantization_config")
      fail(
          "{}: key 'quantization_config' (FP8 block-quantized weights with weight_scale_inv tensors) is not "
          "supported yet; convert the checkpoint to bf16 first",
          source);
    fail("{}: unknown key '{}'{}", source, key, did_you_mean_key(key));
  }
  check_fixed_keys(j, source);

  c.hidden_size = require_integer(j, "hidden_size", source);
  c.intermediate_size = require_integer(j, "intermediate_size", source);
  c.moe_intermediate_size = require_integer(j, "moe_intermediate_size", source);
  c.num_hidden_layers = require_integer(j, "num_hidden_layers", source);
  c.num_attention_heads = require_integer(j, "num_attention_heads", source);
  if (auto kv_heads = read_integer(j, "num_key_value_heads", source);
      kv_heads && *kv_heads != c.num_attention_heads)
    fail(
        "{}: key 'num_key_value_heads' is {}, but MLA has no grouped-query attention: it must equal "
        "'num_attention_heads' ({}) or be absent",
        source, *kv_heads, c.num_attention_heads);
  // HF's default for an absent q_lora_rank is DeepSeek-V3's 1536, which a small config would not mean: the
  // key must be there, null for a plain q_proj.
  if (!j.contains("q_lora_rank"))
    fail("{}: missing required key 'q_lora_rank' (null for a plain q_proj)", source);
  if (auto rank = read_integer(j, "q_lora_rank", source)) {
    if (*rank <= 0) fail("{}: key 'q_lora_rank' must be positive or null, got {}", source, *rank);
    c.q_lora_rank = *rank;
  }
  c.kv_lora_rank = require_integer(j, "kv_lora_rank", source);
  c.qk_nope_head_dim = require_integer(j, "qk_nope_head_dim", source);
  c.qk_rope_head_dim = require_integer(j, "qk_rope_head_dim", source);
  c.v_head_dim = require_integer(j, "v_head_dim", source);
  if (auto head_dim = read_integer(j, "head_dim", source); head_dim && *head_dim != c.qk_rope_head_dim)
    fail("{}: key 'head_dim' is {}, but HF's DeepseekV3Config derives it as 'qk_rope_head_dim' ({})", source,
         *head_dim, c.qk_rope_head_dim);
  if (auto qk = read_integer(j, "qk_head_dim", source); qk && *qk != c.qk_nope_head_dim + c.qk_rope_head_dim)
    fail("{}: key 'qk_head_dim' is {}, but it must be 'qk_nope_head_dim' + 'qk_rope_head_dim' ({})", source,
         *qk, c.qk_nope_head_dim + c.qk_rope_head_dim);
  c.n_routed_experts = require_integer(j, "n_routed_experts", source);
  c.n_shared_experts = require_integer(j, "n_shared_experts", source);
  c.num_experts_per_tok = require_integer(j, "num_experts_per_tok", source);
  c.n_group = require_integer(j, "n_group", source);
  c.topk_group = require_integer(j, "topk_group", source);
  auto scaling = read_number(j, "routed_scaling_factor", source);
  if (!scaling) fail("{}: missing required key 'routed_scaling_factor'", source);
  c.routed_scaling_factor = *scaling;
  c.norm_topk_prob = read_bool(j, "norm_topk_prob", source).value_or(true);
  if (auto scoring = read_string(j, "scoring_func", source)) {
    if (*scoring == "sigmoid") {
      c.scoring_func = ScoringFunc::sigmoid;
    } else if (*scoring == "softmax") {
      c.scoring_func = ScoringFunc::softmax;
    } else {
      fail("{}: key 'scoring_func' is \"{}\", but forge implements \"sigmoid\" and \"softmax\"", source,
           *scoring);
    }
  }
  if (auto method = read_string(j, "topk_method", source)) {
    if (*method == "noaux_tc") {
      c.topk_method = TopkMethod::noaux_tc;
    } else if (*method == "greedy") {
      c.topk_method = TopkMethod::greedy;
    } else {
      fail(
          "{}: key 'topk_method' is \"{}\", but forge implements \"noaux_tc\" and \"greedy\" (with n_group "
          "1)",
          source, *method);
    }
  }
  c.first_k_dense_replace = require_integer(j, "first_k_dense_replace", source);
  if (auto freq = read_integer(j, "moe_layer_freq", source); freq && *freq != 1)
    fail(
        "{}: key 'moe_layer_freq' is {}, but forge supports only 1 (every layer from first_k_dense_replace "
        "on is "
        "MoE)",
        source, *freq);
  c.num_nextn_predict_layers = read_integer(j, "num_nextn_predict_layers", source).value_or(0);
  c.vocab_size = require_integer(j, "vocab_size", source);
  c.max_position_embeddings =
      read_integer(j, "max_position_embeddings", source).value_or(c.max_position_embeddings);
  // transformers v5 writes rope_theta and the scaling together as rope_parameters; to_json writes the v4
  // form, which v5 still reads.
  const auto present = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  if (present("rope_parameters")) {
    if (present("rope_scaling") || present("rope_theta"))
      fail("{}: keys 'rope_parameters' and 'rope_scaling' or 'rope_theta' are both given; keep one form",
           source);
    const json& rope = j["rope_parameters"];
    if (rope.is_object())
      c.rope_theta = read_number(rope, "rope_theta", source, "rope_parameters.").value_or(c.rope_theta);
    c.rope_scaling = read_rope_scaling(rope, "rope_parameters", c.max_position_embeddings, source);
  } else {
    c.rope_theta = read_number(j, "rope_theta", source).value_or(c.rope_theta);
    if (present("rope_scaling"))
      c.rope_scaling =
          read_rope_scaling(j["rope_scaling"], "rope_scaling", c.max_position_embeddings, source);
  }
  c.rope_interleave = read_bool(j, "rope_interleave", source).value_or(true);
  c.rms_norm_eps = read_number(j, "rms_norm_eps", source).value_or(c.rms_norm_eps);
  c.tie_word_embeddings = read_bool(j, "tie_word_embeddings", source).value_or(false);
  c.origin.name = std::string(source);
  c.validate(source);
  return c;
}

void DeepseekV3Config::validate(std::string_view source) const {
  require_positive(hidden_size, "hidden_size", source);
  require_positive(intermediate_size, "intermediate_size", source);
  require_positive(moe_intermediate_size, "moe_intermediate_size", source);
  require_positive(num_hidden_layers, "num_hidden_layers", source);
  require_positive(num_attention_heads, "num_attention_heads", source);
  if (q_lora_rank < 0) fail("{}: key 'q_lora_rank' must be positive or null, got {}", source, q_lora_rank);
  require_positive(kv_lora_rank, "kv_lora_rank", source);
  require_positive(qk_nope_head_dim, "qk_nope_head_dim", source);
  require_positive(qk_rope_head_dim, "qk_rope_head_dim", source);
  require_positive(v_head_dim, "v_head_dim", source);
  require_positive(n_routed_experts, "n_routed_experts", source);
  if (n_shared_experts < 0)
    fail("{}: key 'n_shared_experts' must be 0 or more, got {}", source, n_shared_experts);
  require_positive(num_experts_per_tok, "num_experts_per_tok", source);
  require_positive(n_group, "n_group", source);
  require_positive(topk_group, "topk_group", source);
  require_positive(vocab_size, "vocab_size", source);
  require_positive(max_position_embeddings, "max_position_embeddings", source);
  if (first_k_dense_replace < 0)
    fail("{}: key 'first_k_dense_replace' must be 0 or more, got {}", source, first_k_dense_replace);
  if (num_nextn_predict_layers < 0)
    fail("{}: key 'num_nextn_predict_layers' must be 0 or more, got {}", source, num_nextn_predict_layers);
  check_size_limits(*this, kSizeLimits, wide_parameter_count(*this), size_summary(*this), source);

  // Routing.
  if (num_experts_per_tok > n_routed_experts)
    fail("{}: key 'num_experts_per_tok' ({}) must not exceed 'n_routed_experts' ({})", source,
         num_experts_per_tok, n_routed_experts);
  if (n_routed_experts % n_group != 0)
    fail("{}: key 'n_group' ({}) must divide 'n_routed_experts' ({})", source, n_group, n_routed_experts);
  if (topk_group > n_group)
    fail("{}: key 'topk_group' ({}) must not exceed 'n_group' ({})", source, topk_group, n_group);
  if (num_experts_per_tok > topk_group * experts_per_group())
    fail(
        "{}: key 'num_experts_per_tok' ({}) exceeds the {} experts of the 'topk_group' ({}) groups a token "
        "may "
        "use ('n_routed_experts' / 'n_group' = {} each)",
        source, num_experts_per_tok, topk_group * experts_per_group(), topk_group, experts_per_group());
  // noaux_tc scores each group by the sum of its two best experts.
  if (topk_method == TopkMethod::noaux_tc && experts_per_group() < 2)
    fail(
        "{}: 'topk_method' \"noaux_tc\" scores each group by its two best experts, but 'n_routed_experts' / "
        "'n_group' is {}",
        source, experts_per_group());
  // HF's DeepseekV3 ignores topk_method and always runs the noaux_tc selection; "greedy" is accepted only
  // where the two select the same experts: one group.
  if (topk_method == TopkMethod::greedy && (n_group != 1 || topk_group != 1))
    fail(
        "{}: 'topk_method' \"greedy\" needs 'n_group' 1 and 'topk_group' 1 (got {} and {}); use \"noaux_tc\" "
        "for "
        "group-limited routing",
        source, n_group, topk_group);
  if (first_k_dense_replace > num_hidden_layers)
    fail("{}: key 'first_k_dense_replace' ({}) must not exceed 'num_hidden_layers' ({})", source,
         first_k_dense_replace, num_hidden_layers);
  require_positive_finite(routed_scaling_factor, "routed_scaling_factor", source);

  // RoPE rotates pairs of channels.
  if (qk_rope_head_dim % 2 != 0)
    fail("{}: key 'qk_rope_head_dim' must be even for rotary embeddings, got {}", source, qk_rope_head_dim);
  require_positive_finite(rms_norm_eps, "rms_norm_eps", source);
  require_positive_finite(rope_theta, "rope_theta", source);
  if (rope_theta == 1.0)
    fail("{}: key 'rope_theta' must not be 1 (RoPE frequencies divide by its log)", source);
  if (rope_scaling.enabled) {
    const YarnScaling& y = rope_scaling;
    if (!(y.factor >= 1.0) || !std::isfinite(y.factor))
      fail("{}: key 'rope_scaling.factor' must be a finite number >= 1, got {}", source, y.factor);
    require_positive(y.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings",
                     source);
    if (y.original_max_position_embeddings > (int64_t{1} << 24))
      fail("{}: key 'rope_scaling.original_max_position_embeddings' is {}, above forge's limit of {}", source,
           y.original_max_position_embeddings, int64_t{1} << 24);
    require_positive_finite(y.beta_fast, "rope_scaling.beta_fast", source);
    require_positive_finite(y.beta_slow, "rope_scaling.beta_slow", source);
    if (!(y.beta_fast > y.beta_slow))
      fail("{}: key 'rope_scaling.beta_fast' ({}) must be greater than 'rope_scaling.beta_slow' ({})", source,
           y.beta_fast, y.beta_slow);
    for (const auto& [key, value] :
         {std::pair{"rope_scaling.mscale", y.mscale}, {"rope_scaling.mscale_all_dim", y.mscale_all_dim}})
      if (!(value >= 0.0) || !std::isfinite(value))
        fail("{}: key '{}' must be a finite number >= 0, got {}", source, key, value);
    if (y.attention_factor < 0.0 || !std::isfinite(y.attention_factor))
      fail("{}: key 'rope_scaling.attention_factor' must be a positive finite number, got {}", source,
           y.attention_factor);
  }
}

json DeepseekV3Config::to_json() const {
  json j = kept;
  j["architectures"] = json::array({"DeepseekV3ForCausalLM"});
  j["model_type"] = "deepseek_v3";
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_attention_heads;
  j["q_lora_rank"] = q_lora_rank > 0 ? json(q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = kv_lora_rank;
  j["qk_nope_head_dim"] = qk_nope_head_dim;
  j["qk_rope_head_dim"] = qk_rope_head_dim;
  j["v_head_dim"] = v_head_dim;
  j["n_routed_experts"] = n_routed_experts;
  j["n_shared_experts"] = n_shared_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["n_group"] = n_group;
  j["topk_group"] = topk_group;
  j["routed_scaling_factor"] = routed_scaling_factor;
  j["norm_topk_prob"] = norm_topk_prob;
  j["scoring_func"] = scoring_func == ScoringFunc::sigmoid ? "sigmoid" : "softmax";
  j["topk_method"] = topk_method == TopkMethod::noaux_tc ? "noaux_tc" : "greedy";
  j["first_k_dense_replace"] = first_k_dense_replace;
  j["moe_layer_freq"] = 1;
  j["num_nextn_predict_layers"] = num_nextn_predict_layers;
  j["rope_theta"] = rope_theta;
  if (rope_scaling.enabled) {
    const YarnScaling& y = rope_scaling;
    json r = {{"rope_type", "yarn"},
              {"factor", y.factor},
              {"original_max_position_embeddings", y.original_max_position_embeddings},
              {"beta_fast", y.beta_fast},
              {"beta_slow", y.beta_slow}};
    if (y.mscale != 0) r["mscale"] = y.mscale;
    if (y.mscale_all_dim != 0) r["mscale_all_dim"] = y.mscale_all_dim;
    if (y.attention_factor != 0) r["attention_factor"] = y.attention_factor;
    if (!y.truncate) r["truncate"] = false;
    j["rope_scaling"] = r;
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["rope_interleave"] = rope_interleave;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  return j;
}

// ---- RoPE (HF's _compute_yarn_parameters, in double).

std::vector<double> DeepseekV3Config::rope_inv_freq() const {
  const int64_t dim = qk_rope_head_dim, half = dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[static_cast<size_t>(i)] =
        1.0 / std::pow(rope_theta, static_cast<double>(2 * i) / static_cast<double>(dim));
  if (!rope_scaling.enabled) return inv_freq;
  const YarnScaling& y = rope_scaling;
  // The channel whose wavelength makes `rotations` turns over the original context.
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) *
           std::log(static_cast<double>(y.original_max_position_embeddings) /
                    (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(rope_theta));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0), high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;  // 1: the original frequency, 0: divided by factor
    double& f = inv_freq[static_cast<size_t>(i)];
    f = f / y.factor * (1.0 - extrapolation) + f * extrapolation;
  }
  return inv_freq;
}

double DeepseekV3Config::rope_attention_factor() const {
  const YarnScaling& y = rope_scaling;
  if (!y.enabled) return 1.0;
  if (y.attention_factor != 0) return y.attention_factor;
  if (y.mscale != 0 && y.mscale_all_dim != 0)
    return RopeScaling::yarn_mscale(y.factor, y.mscale) /
           RopeScaling::yarn_mscale(y.factor, y.mscale_all_dim);
  return RopeScaling::yarn_mscale(y.factor, 1.0);
}

double DeepseekV3Config::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope_scaling.enabled && rope_scaling.mscale_all_dim != 0) {
    const double m = RopeScaling::yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

// ---- Counts.

int64_t DeepseekV3Config::attention_parameters() const {
  const int64_t h = hidden_size, heads = num_attention_heads;
  const int64_t q = q_lora_rank > 0 ? h * q_lora_rank + q_lora_rank + q_lora_rank * heads * qk_head_dim()
                                    : h * heads * qk_head_dim();
  const int64_t kv = h * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank +
                     kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim);
  const int64_t o = heads * v_head_dim * h;
  return q + kv + o + 2 * h;  // + input_layernorm and post_attention_layernorm
}

int64_t DeepseekV3Config::dense_mlp_parameters() const { return 3 * hidden_size * intermediate_size; }

int64_t DeepseekV3Config::moe_parameters() const {
  return n_routed_experts * hidden_size +
         3 * hidden_size * moe_intermediate_size * (n_routed_experts + n_shared_experts);
}

int64_t DeepseekV3Config::main_model_parameters() const {
  const int64_t embedding = vocab_size * hidden_size;
  int64_t total = embedding + hidden_size + (tie_word_embeddings ? 0 : embedding);
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer)
    total += attention_parameters() + (is_moe_layer(layer) ? moe_parameters() : dense_mlp_parameters());
  return total;
}

int64_t DeepseekV3Config::mtp_module_parameters(int64_t k) const {
  const int64_t h = hidden_size;
  const int64_t layer = num_hidden_layers + k;
  return 2 * h + 2 * h * h + attention_parameters() +
         (is_moe_layer(layer) ? moe_parameters() : dense_mlp_parameters()) + h;
}

int64_t DeepseekV3Config::num_parameters() const {
  int64_t total = main_model_parameters();
  for (int64_t k = 0; k < num_nextn_predict_layers; ++k) total += mtp_module_parameters(k);
  return total;
}

int64_t DeepseekV3Config::checkpoint_elements() const {
  int64_t moe_layers = 0;
  for (int64_t layer = 0; layer < num_layers_with_mtp(); ++layer) moe_layers += is_moe_layer(layer);
  return num_parameters() + moe_layers * n_routed_experts +
         num_nextn_predict_layers * 2 * vocab_size * hidden_size;
}

int64_t DeepseekV3Config::activated_parameters(bool with_mtp) const {
  const int64_t h = hidden_size;
  const int64_t moe_active =
      n_routed_experts * h + 3 * h * moe_intermediate_size * (num_experts_per_tok + n_shared_experts);
  auto layer = [&](int64_t index) {
    return attention_parameters() + (is_moe_layer(index) ? moe_active : dense_mlp_parameters());
  };
  const int64_t embedding = vocab_size * h;
  int64_t total = embedding + h + (tie_word_embeddings ? 0 : embedding);
  for (int64_t i = 0; i < num_hidden_layers; ++i) total += layer(i);
  if (with_mtp)
    for (int64_t k = 0; k < num_nextn_predict_layers; ++k)
      total += 3 * h + 2 * h * h + layer(num_hidden_layers + k);
  return total;
}

double DeepseekV3Config::flops_per_token(int64_t seq_len) const {
  const double h = static_cast<double>(hidden_size), heads = static_cast<double>(num_attention_heads);
  // MLA matmuls (no norms).
  const double q = q_lora_rank > 0
                       ? h * q_lora_rank + static_cast<double>(q_lora_rank) * heads * qk_head_dim()
                       : h * heads * qk_head_dim();
  const double attention =
      q + h * static_cast<double>(kv_lora_rank + qk_rope_head_dim) +
      static_cast<double>(kv_lora_rank) * heads * static_cast<double>(qk_nope_head_dim + v_head_dim) +
      heads * static_cast<double>(v_head_dim) * h;
  const double moe_active = static_cast<double>(n_routed_experts) * h +
                            3.0 * h * static_cast<double>(moe_intermediate_size) *
                                static_cast<double>(num_experts_per_tok + n_shared_experts);
  const double dense = 3.0 * h * static_cast<double>(intermediate_size);
  const double head = static_cast<double>(vocab_size) * h;
  double matmul = head;
  for (int64_t i = 0; i < num_layers_with_mtp(); ++i) {
    matmul += attention + (is_moe_layer(i) ? moe_active : dense);
    if (i >= num_hidden_layers) matmul += 2.0 * h * h + head;  // eh_proj and the shared head
  }
  const double attention_scores = 6.0 * static_cast<double>(num_layers_with_mtp()) * heads *
                                  static_cast<double>(seq_len) *
                                  static_cast<double>(qk_head_dim() + v_head_dim);
  return 6.0 * matmul + attention_scores;
}

int64_t DeepseekV3Config::memory_bytes(bool training, bool bf16_shadow) const {
  const int64_t per_parameter = 4 + (bf16_shadow ? 2 : 0) + (training ? 4 + 8 : 0);
  const int64_t biases = checkpoint_elements() - num_parameters() -
                         num_nextn_predict_layers * 2 * vocab_size * hidden_size;  // fp32 buffers
  const int64_t rope_tables = 2 * max_position_embeddings * (qk_rope_head_dim / 2) * 4;
  return num_parameters() * per_parameter + biases * 4 + rope_tables;
}

void DeepseekV3Config::check_fits_in_memory(bool training, bool bf16_shadow, int64_t available_bytes,
                                            std::string_view source) const {
  const int64_t needed = memory_bytes(training, bf16_shadow);
  if (needed <= available_bytes) return;
  fail("{}: the model needs {} for its {} ({:.3g} parameters: {}); this machine has {}", source,
       human_bytes(needed), training ? "weights, gradients and optimizer state" : "weights",
       static_cast<double>(num_parameters()), size_summary(*this), human_bytes(available_bytes));
}

ModelShape DeepseekV3Config::shape() const {
  ModelShape s;
  s.hidden = hidden_size, s.heads = num_attention_heads, s.kv_heads = num_attention_heads;
  s.head_dim = qk_head_dim(), s.ffn = intermediate_size, s.vocab = vocab_size, s.layers = num_hidden_layers;
  s.max_positions = max_position_embeddings;
  return s;
}

// ---- Tensor names: HF's DeepseekV3ForCausalLM state_dict, and DeepSeek's MTP modules as layers N + k.

std::vector<std::pair<std::string, Shape>> DeepseekV3Config::tensor_shapes() const {
  const int64_t h = hidden_size, v = vocab_size, heads = num_attention_heads;
  std::vector<std::pair<std::string, Shape>> shapes = {{"model.embed_tokens.weight", {v, h}}};
  auto mlp = [&](const std::string& p, int64_t width) {
    shapes.push_back({p + "gate_proj.weight", {width, h}});
    shapes.push_back({p + "up_proj.weight", {width, h}});
    shapes.push_back({p + "down_proj.weight", {h, width}});
  };
  auto decoder_layer = [&](int64_t layer, const std::string& p) {
    shapes.push_back({p + "input_layernorm.weight", {h}});
    if (q_lora_rank > 0) {
      shapes.push_back({p + "self_attn.q_a_proj.weight", {q_lora_rank, h}});
      shapes.push_back({p + "self_attn.q_a_layernorm.weight", {q_lora_rank}});
      shapes.push_back({p + "self_attn.q_b_proj.weight", {heads * qk_head_dim(), q_lora_rank}});
    } else {
      shapes.push_back({p + "self_attn.q_proj.weight", {heads * qk_head_dim(), h}});
    }
    shapes.push_back({p + "self_attn.kv_a_proj_with_mqa.weight", {kv_lora_rank + qk_rope_head_dim, h}});
    shapes.push_back({p + "self_attn.kv_a_layernorm.weight", {kv_lora_rank}});
    shapes.push_back(
        {p + "self_attn.kv_b_proj.weight", {heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank}});
    shapes.push_back({p + "self_attn.o_proj.weight", {h, heads * v_head_dim}});
    shapes.push_back({p + "post_attention_layernorm.weight", {h}});
    if (!is_moe_layer(layer)) {
      mlp(p + "mlp.", intermediate_size);
      return;
    }
    shapes.push_back({p + "mlp.gate.weight", {n_routed_experts, h}});
    shapes.push_back({p + "mlp.gate.e_score_correction_bias", {n_routed_experts}});
    for (int64_t e = 0; e < n_routed_experts; ++e)
      mlp(p + "mlp.experts." + std::to_string(e) + ".", moe_intermediate_size);
    if (n_shared_experts > 0) mlp(p + "mlp.shared_experts.", moe_intermediate_size * n_shared_experts);
  };
  for (int64_t i = 0; i < num_hidden_layers; ++i) decoder_layer(i, "model.layers." + std::to_string(i) + ".");
  shapes.push_back({"model.norm.weight", {h}});
  if (!tie_word_embeddings) shapes.push_back({"lm_head.weight", {v, h}});
  for (int64_t k = 0; k < num_nextn_predict_layers; ++k) {
    const int64_t layer = num_hidden_layers + k;
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    shapes.push_back({p + "enorm.weight", {h}});
    shapes.push_back({p + "hnorm.weight", {h}});
    shapes.push_back({p + "eh_proj.weight", {h, 2 * h}});
    decoder_layer(layer, p);
    shapes.push_back({p + "shared_head.norm.weight", {h}});
  }
  return shapes;
}

bool DeepseekV3Config::is_ignored_duplicate(std::string_view name) const {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) return false;
  name.remove_prefix(kPrefix.size());
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot > 9) return false;
  int64_t layer = 0;
  for (char ch : name.substr(0, dot)) {
    if (ch < '0' || ch > '9') return false;
    layer = layer * 10 + (ch - '0');
  }
  if (dot > 1 && name[0] == '0') return false;  // "07" is not layer 7
  if (layer < num_hidden_layers || layer >= num_layers_with_mtp()) return false;
  const std::string_view rest = name.substr(dot + 1);
  return rest == "embed_tokens.weight" || rest == "shared_head.head.weight";
}

}  // namespace forge::models
