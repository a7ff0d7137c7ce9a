#include "forge/models/deepseek_v3/deepseek_v3_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>
#include <set>

#include "forge/core/error.h"

namespace forge::deepseek_v3_config_test {
using namespace forge::models;
namespace {

using nlohmann::json;

// DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), without its quantization_config (the bf16
// conversions drop it; forge refuses FP8 block-quantized checkpoints, see UnsupportedFeatures).
json deepseek_v3_config() {
  return json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
    "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280})");
}

// The sizes of tests/reference/deepseek_v3_twin.py's fixtures.
json tiny_config() {
  return json{{"hidden_size", 32},
              {"intermediate_size", 40},
              {"moe_intermediate_size", 12},
              {"num_hidden_layers", 3},
              {"num_attention_heads", 4},
              {"q_lora_rank", 16},
              {"kv_lora_rank", 16},
              {"qk_nope_head_dim", 8},
              {"qk_rope_head_dim", 4},
              {"v_head_dim", 6},
              {"n_routed_experts", 8},
              {"n_shared_experts", 1},
              {"num_experts_per_tok", 2},
              {"n_group", 4},
              {"topk_group", 2},
              {"routed_scaling_factor", 2.5},
              {"first_k_dense_replace", 1},
              {"num_nextn_predict_layers", 2},
              {"vocab_size", 64},
              {"max_position_embeddings", 64}};
}

void expect_error(const json& j, std::initializer_list<std::string_view> fragments) {
  try {
    DeepseekV3Config::from_json(j, "config.json");
    ADD_FAILURE() << "no error for " << j.dump();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_TRUE(message.starts_with("config.json: ")) << message;
    for (std::string_view fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << message;
  }
}

TEST(DeepseekV3Config, ReadsThePublishedConfig) {
  const DeepseekV3Config c = DeepseekV3Config::from_json(deepseek_v3_config(), "config.json");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.experts_per_group(), 32);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.scoring_func, DeepseekV3Config::ScoringFunc::sigmoid);
  EXPECT_EQ(c.topk_method, DeepseekV3Config::TopkMethod::noaux_tc);
  EXPECT_TRUE(c.rope_interleave);  // absent: HF's default
  EXPECT_TRUE(c.rope_scaling.enabled);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 40);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_TRUE(c.is_moe_layer(61));  // the MTP module
  const ModelShape s = c.shape();
  EXPECT_EQ(s.head_dim, 192);
  EXPECT_EQ(s.kv_heads, 128);
  EXPECT_EQ(s.ffn, 18432);
  EXPECT_EQ(s.layers, 61);
  EXPECT_EQ(s.max_positions, 163840);
}

// DeepSeek publishes "671B total parameters, 37B activated per token" for the main model and 685B for the
// Hugging Face files, which add the 14B of the MTP module. The counts, derived by hand:
//   embedding = lm_head = 129280 * 7168 = 926,679,040
//   MLA per layer: q_a 7168*1536 + q_a_layernorm 1536 + q_b 1536*128*192 + kv_a 7168*576 + kv_a_layernorm 512
//                  + kv_b 512*128*256 + o 128*128*7168 = 187,107,328; + 2 norms of 7168 = 187,121,664
//   dense MLP 3*7168*18432 = 396,361,728
//   MoE: router 256*7168 + 257 experts * 3*7168*2048 = 1,835,008 + 11,318,329,344 = 11,320,164,352
//   main = 2 * 926,679,040 + 61 * 187,121,664 + 3 * 396,361,728 + 58 * 11,320,164,352 + 7168 (norm)
//        = 671,026,404,352                                                       ("671B")
//   MTP module = enorm + hnorm 14,336 + eh_proj 7168*14336 = 102,760,448 + a MoE layer 11,507,286,016
//                + shared_head.norm 7168 = 11,610,067,968
//   the file adds 59 correction biases of 256 and the MTP module's copies of the embedding and head:
//   671,026,404,352 + 11,610,067,968 + 15,104 + 2 * 926,679,040 = 684,489,845,504 ("685B"); the MTP module
//   with its bias and copies is 13,463,426,304 elements ("14B").
//   activated: a MoE layer passes through the router, 8 routed and the shared expert: 1,835,008 + 9 *
//   44,040,192 = 398,196,736, so the main model activates 37,552,282,624 ("37B"), 38,240,382,976 with the MTP
//   module.
TEST(DeepseekV3Config, ParameterCountsMatchThePublishedModel) {
  const DeepseekV3Config c = DeepseekV3Config::from_json(deepseek_v3_config(), "config.json");
  EXPECT_EQ(c.attention_parameters(), 187121664);
  EXPECT_EQ(c.moe_parameters(), 11320164352);
  EXPECT_EQ(c.main_model_parameters(), 671026404352);
  EXPECT_NEAR(static_cast<double>(c.main_model_parameters()), 671e9, 0.05e9);
  EXPECT_EQ(c.mtp_module_parameters(0), 11610067968);
  EXPECT_EQ(c.num_parameters(), 671026404352 + 11610067968);
  EXPECT_EQ(c.checkpoint_elements(), 684489845504);
  EXPECT_NEAR(static_cast<double>(c.checkpoint_elements()), 685e9, 0.55e9);
  EXPECT_EQ(c.checkpoint_elements() - c.main_model_parameters() - 58 * 256, 13463426304);
  EXPECT_EQ(c.activated_parameters(false), 37552282624);
  EXPECT_NEAR(static_cast<double>(c.activated_parameters(false)), 37e9, 0.6e9);
  EXPECT_EQ(c.activated_parameters(true), 38240382976);

  // tensor_shapes lists exactly the checkpoint without the MTP module's two copies.
  const auto shapes = c.tensor_shapes();
  int64_t elements = 0;
  for (const auto& [name, shape] : shapes) elements += shape_numel(shape);
  EXPECT_EQ(elements, c.checkpoint_elements() - 2 * 926679040);
  // 1 embedding + 3 dense layers of 12 + 58 MoE layers of 782 (9 attention and norms, router and bias, 768
  // routed and 3 shared expert matrices) + norm + lm_head + the MTP module (enorm, hnorm, eh_proj, 782,
  // norm).
  EXPECT_EQ(shapes.size(), 1 + 3 * 12 + 58 * 782 + 2 + 786);
}

TEST(DeepseekV3Config, YarnFrequenciesAndScales) {
  const DeepseekV3Config c = DeepseekV3Config::from_json(deepseek_v3_config(), "config.json");
  // The correction range for beta_fast 32 and beta_slow 1 over 4096 positions, dim 64, theta 1e4:
  // 64 ln(4096 / (32 * 2pi)) / (2 ln 1e4) = 10.47 -> 10 and 64 ln(4096 / 2pi) / (2 ln 1e4) = 22.5 -> 23.
  const std::vector<double> f = c.rope_inv_freq();
  ASSERT_EQ(f.size(), 32u);
  auto plain = [](int i) { return std::pow(10000.0, -2.0 * i / 64); };
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  EXPECT_DOUBLE_EQ(f[10], plain(10));
  EXPECT_DOUBLE_EQ(f[23], plain(23) / 40);
  EXPECT_DOUBLE_EQ(f[31], plain(31) / 40);
  const double ramp = (16.0 - 10.0) / 13.0;
  EXPECT_DOUBLE_EQ(f[16], plain(16) / 40 * ramp + plain(16) * (1 - ramp));
  // mscale == mscale_all_dim: cos and sin are not rescaled; the softmax scale is multiplied by mscale^2.
  EXPECT_DOUBLE_EQ(c.rope_attention_factor(), 1.0);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(c.softmax_scale(), m * m / std::sqrt(192.0));

  json j = tiny_config();
  EXPECT_DOUBLE_EQ(DeepseekV3Config::from_json(j, "c").softmax_scale(), 1 / std::sqrt(12.0));
  EXPECT_DOUBLE_EQ(DeepseekV3Config::from_json(j, "c").rope_inv_freq()[1], 0.01);
  j["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", 4.0},
                       {"original_max_position_embeddings", 16},
                       {"mscale", 1.0},
                       {"mscale_all_dim", 0.707}};
  const DeepseekV3Config y = DeepseekV3Config::from_json(j, "c");
  EXPECT_DOUBLE_EQ(y.rope_attention_factor(), (0.1 * std::log(4.0) + 1) / (0.0707 * std::log(4.0) + 1));
  EXPECT_DOUBLE_EQ(y.softmax_scale(), std::pow(0.0707 * std::log(4.0) + 1, 2) / std::sqrt(12.0));
  // dim 4: the range is [0, 1]: frequency 0 kept, frequency 1 divided by the factor.
  EXPECT_DOUBLE_EQ(y.rope_inv_freq()[0], 1.0);
  EXPECT_DOUBLE_EQ(y.rope_inv_freq()[1], 0.01 / 4);
  // Without mscale: HF's yarn_get_mscale(factor) multiplies cos and sin, the softmax scale is plain.
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  const DeepseekV3Config bare = DeepseekV3Config::from_json(j, "c");
  EXPECT_EQ(bare.rope_scaling.original_max_position_embeddings, 64);  // max_position_embeddings
  EXPECT_DOUBLE_EQ(bare.rope_attention_factor(), 0.1 * std::log(4.0) + 1);
  EXPECT_DOUBLE_EQ(bare.softmax_scale(), 1 / std::sqrt(12.0));
}

TEST(DeepseekV3Config, FlopsPerTokenCountsActivatedMatmuls) {
  const DeepseekV3Config c = DeepseekV3Config::from_json(deepseek_v3_config(), "config.json");
  const double h = 7168, heads = 128, vocab = 129280, seq = 4096;
  const double mla = h * 1536 + 1536 * heads * 192 + h * 576 + 512 * heads * 256 + heads * 128 * h;
  const double moe = 256 * h + 9 * 3 * h * 2048, dense = 3 * h * 18432;
  const double main = 61 * mla + 3 * dense + 58 * moe + vocab * h;
  const double mtp = 2 * h * h + mla + moe + vocab * h;
  const double attention = 6 * 62 * heads * seq * (192 + 128);
  EXPECT_DOUBLE_EQ(c.flops_per_token(4096), 6 * (main + mtp) + attention);
  // 36.6e9 matmul parameters per token in the main model (the 37.6e9 activated less the embedding and norms),
  // 38.2e9 with the MTP module and its second pass through the head.
  EXPECT_NEAR(main / 1e9, 36.62, 0.01);
  EXPECT_NEAR((main + mtp) / 1e9, 38.24, 0.01);
}

TEST(DeepseekV3Config, JsonRoundTripKeepsBookkeeping) {
  const DeepseekV3Config c = DeepseekV3Config::from_json(deepseek_v3_config(), "config.json");
  const json out = c.to_json();
  EXPECT_EQ(DeepseekV3Config::from_json(out, "round trip"), c);
  EXPECT_EQ(out["architectures"][0], "DeepseekV3ForCausalLM");
  EXPECT_EQ(out["model_type"], "deepseek_v3");
  EXPECT_EQ(out["transformers_version"], "4.33.1");
  EXPECT_EQ(out["torch_dtype"], "bfloat16");
  EXPECT_EQ(out["auto_map"]["AutoConfig"], "configuration_deepseek.DeepseekV3Config");
  EXPECT_EQ(out["rope_scaling"]["rope_type"], "yarn");
  EXPECT_EQ(out["rope_scaling"]["mscale_all_dim"], 1.0);
  EXPECT_EQ(out["num_key_value_heads"], 128);

  json j = tiny_config();
  j["q_lora_rank"] = nullptr;
  j["scoring_func"] = "softmax";
  j["n_group"] = 1;
  j["topk_group"] = 1;
  j["topk_method"] = "greedy";
  j["norm_topk_prob"] = false;
  j["rope_interleave"] = false;
  j["tie_word_embeddings"] = true;
  j["n_shared_experts"] = 0;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", 16.0},       {"beta_slow", 2.0},
                       {"truncate", false},   {"mscale", 0.5}, {"attention_factor", 1.25}};
  const DeepseekV3Config t = DeepseekV3Config::from_json(j, "tiny");
  EXPECT_EQ(t.q_lora_rank, 0);
  EXPECT_TRUE(t.to_json()["q_lora_rank"].is_null());
  EXPECT_EQ(DeepseekV3Config::from_json(t.to_json(), "round trip"), t);
  EXPECT_DOUBLE_EQ(t.rope_attention_factor(), 1.25);
  DeepseekV3Config other = t;
  other.rope_interleave = true;
  EXPECT_FALSE(other == t);
}

// transformers v5 writes rope_theta and rope_scaling as one rope_parameters object.
TEST(DeepseekV3Config, ReadsRopeParametersOfTransformersV5) {
  json v4 = deepseek_v3_config();
  json v5 = v4;
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5["rope_parameters"] = {{"rope_type", "yarn"},   {"rope_theta", 10000.0},
                           {"factor", 40.0},        {"beta_fast", 32.0},
                           {"beta_slow", 1.0},      {"mscale", 1.0},
                           {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096}};
  EXPECT_EQ(DeepseekV3Config::from_json(v5, "v5"), DeepseekV3Config::from_json(v4, "v4"));
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 50000.0}};
  const DeepseekV3Config plain = DeepseekV3Config::from_json(v5, "v5");
  EXPECT_FALSE(plain.rope_scaling.enabled);
  EXPECT_DOUBLE_EQ(plain.rope_theta, 50000.0);
  v5["rope_parameters"]["factr"] = 2.0;
  EXPECT_THROW(DeepseekV3Config::from_json(v5, "v5"), Error);
  json both = tiny_config();
  both["rope_theta"] = 10000.0;
  both["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  expect_error(both, {"'rope_parameters' and 'rope_scaling' or 'rope_theta' are both given"});
  both.erase("rope_theta");
  both["rope_parameters"] = {{"rope_type", "yarn"}};
  expect_error(both, {"missing required key 'rope_parameters.factor'"});
}

TEST(DeepseekV3Config, TensorShapesInRegistrationOrder) {
  json j = tiny_config();
  const DeepseekV3Config c = DeepseekV3Config::from_json(j, "tiny");
  const auto shapes = c.tensor_shapes();
  std::vector<std::string> names;
  for (const auto& [name, shape] : shapes) names.push_back(name);
  EXPECT_EQ(names[0], "model.embed_tokens.weight");
  const std::vector<std::string> layer0 = {"model.layers.0.input_layernorm.weight",
                                           "model.layers.0.self_attn.q_a_proj.weight",
                                           "model.layers.0.self_attn.q_a_layernorm.weight",
                                           "model.layers.0.self_attn.q_b_proj.weight",
                                           "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                           "model.layers.0.self_attn.kv_a_layernorm.weight",
                                           "model.layers.0.self_attn.kv_b_proj.weight",
                                           "model.layers.0.self_attn.o_proj.weight",
                                           "model.layers.0.post_attention_layernorm.weight",
                                           "model.layers.0.mlp.gate_proj.weight",
                                           "model.layers.0.mlp.up_proj.weight",
                                           "model.layers.0.mlp.down_proj.weight"};
  EXPECT_EQ(std::vector<std::string>(names.begin() + 1, names.begin() + 13), layer0);
  EXPECT_EQ(names[13], "model.layers.1.input_layernorm.weight");
  EXPECT_EQ(names[22], "model.layers.1.mlp.gate.weight");
  EXPECT_EQ(names[23], "model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(names[24], "model.layers.1.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(names[24 + 24], "model.layers.1.mlp.shared_experts.gate_proj.weight");
  // Per MoE layer: 9 attention and norms, 2 router, 24 routed and 3 shared expert matrices = 38.
  const size_t main_count = 1 + 12 + 2 * 38 + 2;
  EXPECT_EQ(names[main_count - 2], "model.norm.weight");
  EXPECT_EQ(names[main_count - 1], "lm_head.weight");
  EXPECT_EQ(names[main_count], "model.layers.3.enorm.weight");
  EXPECT_EQ(names[main_count + 1], "model.layers.3.hnorm.weight");
  EXPECT_EQ(names[main_count + 2], "model.layers.3.eh_proj.weight");
  EXPECT_EQ(names[main_count + 3], "model.layers.3.input_layernorm.weight");
  EXPECT_EQ(names[main_count + 3 + 38], "model.layers.3.shared_head.norm.weight");
  EXPECT_EQ(names.back(), "model.layers.4.shared_head.norm.weight");
  EXPECT_EQ(shapes.size(), main_count + 2 * (3 + 38 + 1));
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());

  auto shape_of = [&](const std::string& name) {
    for (const auto& [n, s] : shapes)
      if (n == name) return s;
    ADD_FAILURE() << name;
    return Shape{};
  };
  EXPECT_EQ(shape_of("model.layers.1.self_attn.q_b_proj.weight"), (Shape{48, 16}));
  EXPECT_EQ(shape_of("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"), (Shape{20, 32}));
  EXPECT_EQ(shape_of("model.layers.1.self_attn.kv_a_layernorm.weight"), (Shape{16}));
  EXPECT_EQ(shape_of("model.layers.1.self_attn.kv_b_proj.weight"), (Shape{56, 16}));
  EXPECT_EQ(shape_of("model.layers.1.self_attn.o_proj.weight"), (Shape{32, 24}));
  EXPECT_EQ(shape_of("model.layers.1.mlp.gate.weight"), (Shape{8, 32}));
  EXPECT_EQ(shape_of("model.layers.1.mlp.gate.e_score_correction_bias"), (Shape{8}));
  EXPECT_EQ(shape_of("model.layers.2.mlp.experts.7.down_proj.weight"), (Shape{32, 12}));
  EXPECT_EQ(shape_of("model.layers.2.mlp.shared_experts.up_proj.weight"), (Shape{12, 32}));
  EXPECT_EQ(shape_of("model.layers.0.mlp.down_proj.weight"), (Shape{32, 40}));
  EXPECT_EQ(shape_of("model.layers.4.eh_proj.weight"), (Shape{32, 64}));

  // The parameter count is the tensors' sum without the correction biases.
  int64_t elements = 0;
  for (const auto& [name, shape] : shapes) elements += shape_numel(shape);
  EXPECT_EQ(elements, c.num_parameters() + 4 * 8);
  EXPECT_EQ(c.checkpoint_elements(), elements + 2 * 2 * 64 * 32);

  // DeepSeek's duplicates of the embedding and head in the MTP modules: accepted and ignored, nothing else.
  EXPECT_TRUE(c.is_ignored_duplicate("model.layers.3.embed_tokens.weight"));
  EXPECT_TRUE(c.is_ignored_duplicate("model.layers.4.shared_head.head.weight"));
  EXPECT_FALSE(c.is_ignored_duplicate("model.layers.2.embed_tokens.weight"));
  EXPECT_FALSE(c.is_ignored_duplicate("model.layers.5.embed_tokens.weight"));
  EXPECT_FALSE(c.is_ignored_duplicate("model.layers.03.embed_tokens.weight"));
  EXPECT_FALSE(c.is_ignored_duplicate("model.layers.3.shared_head.norm.weight"));
  EXPECT_FALSE(c.is_ignored_duplicate("model.embed_tokens.weight"));
  EXPECT_FALSE(c.is_ignored_duplicate("model.layers.x.embed_tokens.weight"));

  // A plain q_proj, no shared experts, tied embeddings, no MTP.
  j["q_lora_rank"] = nullptr;
  j["n_shared_experts"] = 0;
  j["tie_word_embeddings"] = true;
  j["num_nextn_predict_layers"] = 0;
  const DeepseekV3Config plain = DeepseekV3Config::from_json(j, "tiny");
  names.clear();
  for (const auto& [name, shape] : plain.tensor_shapes()) names.push_back(name);
  EXPECT_EQ(names[2], "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(names.back(), "model.norm.weight");
  EXPECT_EQ(names.size(), 1 + 10 + 2 * 33 + 1);
  EXPECT_EQ(plain.tensor_shapes()[2].second, (Shape{48, 32}));
  EXPECT_FALSE(plain.is_ignored_duplicate("model.layers.3.embed_tokens.weight"));
}

TEST(DeepseekV3ConfigErrors, UnknownKeys) {
  json j = tiny_config();
  j["n_routed_expert"] = 8;
  expect_error(j, {"unknown key 'n_routed_expert'", "did you mean 'n_routed_experts'?"});
  j = tiny_config();
  j["sliding_window"] = 4096;
  expect_error(j, {"unknown key 'sliding_window'"});
  j = tiny_config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fats", 32.0}};
  expect_error(j, {"unknown key 'rope_scaling.beta_fats'", "did you mean 'beta_fast'?"});
  j = tiny_config();
  j["quantization_config"] = {{"quant_method", "fp8"}};
  expect_error(j, {"'quantization_config'", "not supported yet"});
}

TEST(DeepseekV3ConfigErrors, EachRuleInOneLine) {
  auto with = [](const char* key, const json& value) {
    json j = tiny_config();
    j[key] = value;
    return j;
  };
  expect_error(with("num_key_value_heads", 2),
               {"'num_key_value_heads' is 2", "must equal 'num_attention_heads' (4)"});
  expect_error(with("attention_bias", true), {"'attention_bias'", "not supported yet"});
  expect_error(with("attention_dropout", 0.1), {"'attention_dropout'", "must be 0"});
  expect_error(with("hidden_act", "gelu"), {"'hidden_act'", "gelu", "silu"});
  expect_error(with("n_group", 3), {"'n_group' (3) must divide 'n_routed_experts' (8)"});
  expect_error(with("topk_group", 5), {"'topk_group' (5) must not exceed 'n_group' (4)"});
  json j = tiny_config();
  j["topk_group"] = 1;
  j["num_experts_per_tok"] = 3;
  expect_error(j, {"'num_experts_per_tok' (3) exceeds the 2 experts", "'topk_group' (1)"});
  expect_error(with("num_experts_per_tok", 9),
               {"'num_experts_per_tok' (9) must not exceed 'n_routed_experts' (8)"});
  expect_error(with("n_group", 8), {"\"noaux_tc\" scores each group by its two best experts", "is 1"});
  expect_error(with("topk_method", "greedy"), {"\"greedy\" needs 'n_group' 1"});
  expect_error(with("topk_method", "group_limited_greedy"), {"'topk_method'", "group_limited_greedy"});
  expect_error(with("scoring_func", "tanh"), {"'scoring_func'", "tanh"});
  expect_error(with("first_k_dense_replace", 4),
               {"'first_k_dense_replace' (4) must not exceed 'num_hidden_layers' (3)"});
  expect_error(with("moe_layer_freq", 2), {"'moe_layer_freq' is 2", "only 1"});
  expect_error(with("qk_rope_head_dim", 5), {"'qk_rope_head_dim' must be even", "5"});
  expect_error(with("kv_lora_rank", 0), {"'kv_lora_rank' must be positive, got 0"});
  expect_error(with("v_head_dim", -6), {"'v_head_dim' must be positive"});
  expect_error(with("moe_intermediate_size", 0), {"'moe_intermediate_size' must be positive"});
  expect_error(with("q_lora_rank", 0), {"'q_lora_rank' must be positive or null"});
  expect_error(with("n_shared_experts", -1), {"'n_shared_experts' must be 0 or more"});
  expect_error(with("num_nextn_predict_layers", -1), {"'num_nextn_predict_layers' must be 0 or more"});
  expect_error(with("routed_scaling_factor", 0),
               {"'routed_scaling_factor' must be a positive finite number"});
  expect_error(with("rms_norm_eps", 0), {"'rms_norm_eps'"});
  expect_error(with("head_dim", 12), {"'head_dim' is 12", "'qk_rope_head_dim' (4)"});
  expect_error(with("qk_head_dim", 8), {"'qk_head_dim' is 8", "(12)"});
  expect_error(with("model_type", "deepseek_v2"), {"'model_type'", "deepseek_v3"});
  expect_error(with("architectures", json::array({"LlamaForCausalLM"})), {"'architectures'"});
  expect_error(with("norm_topk_prob", 1), {"'norm_topk_prob' must be true or false"});
  expect_error(with("hidden_size", "32"), {"'hidden_size' must be an integer", "string"});
  j = tiny_config();
  j.erase("q_lora_rank");
  expect_error(j, {"missing required key 'q_lora_rank'", "null for a plain q_proj"});
  j = tiny_config();
  j.erase("n_group");
  expect_error(j, {"missing required key 'n_group'"});
  expect_error(with("num_hidden_layers", (int64_t{1} << 32) + 2),
               {"key 'num_hidden_layers' is 4294967298, above forge's limit of 65536"});
  expect_error(json::array({1}), {"JSON object"});
}

TEST(DeepseekV3ConfigErrors, RopeScaling) {
  auto yarn = [](json fields) {
    json j = tiny_config();
    fields["rope_type"] = "yarn";
    j["rope_scaling"] = fields;
    return j;
  };
  expect_error(yarn({{"beta_fast", 32.0}}), {"missing required key 'rope_scaling.factor'"});
  expect_error(yarn({{"factor", 0.5}}), {"'rope_scaling.factor' must be a finite number >= 1, got 0.5"});
  expect_error(yarn({{"factor", 4.0}, {"beta_fast", 1.0}, {"beta_slow", 2.0}}),
               {"'rope_scaling.beta_fast' (1) must be greater than 'rope_scaling.beta_slow' (2)"});
  expect_error(yarn({{"factor", 4.0}, {"beta_slow", 0.0}}), {"'rope_scaling.beta_slow' must be a positive"});
  expect_error(yarn({{"factor", 4.0}, {"mscale", -1.0}}),
               {"'rope_scaling.mscale' must be a finite number >= 0"});
  expect_error(yarn({{"factor", 4.0}, {"original_max_position_embeddings", 0}}),
               {"'rope_scaling.original_max_position_embeddings' must be positive"});
  expect_error(yarn({{"factor", 4.0}, {"attention_factor", 0.0}}), {"'rope_scaling.attention_factor'"});
  expect_error(yarn({{"factor", "4"}}), {"'rope_scaling.factor' must be a number"});
  json j = tiny_config();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  expect_error(j, {"unsupported rope_scaling type 'llama3'"});
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"type", "linear"}, {"factor", 8.0}};
  expect_error(j, {"disagree"});
  j["rope_scaling"] = {{"factor", 8.0}};
  expect_error(j, {"missing required key 'rope_scaling.rope_type'"});
  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_FALSE(DeepseekV3Config::from_json(j, "config.json").rope_scaling.enabled);
}

TEST(DeepseekV3Config, MemoryIsCheckedBeforeAllocation) {
  const DeepseekV3Config tiny = DeepseekV3Config::from_json(tiny_config(), "tiny.json");
  const int64_t rope = 2 * 64 * 2 * 4, biases = 4 * 8 * 4;
  EXPECT_EQ(tiny.memory_bytes(false, false), 4 * tiny.num_parameters() + biases + rope);
  EXPECT_EQ(tiny.memory_bytes(true, true), 18 * tiny.num_parameters() + biases + rope);
  EXPECT_NO_THROW(tiny.check_fits_in_memory(true, true, tiny.memory_bytes(true, true), "tiny.json"));
  const DeepseekV3Config big = DeepseekV3Config::from_json(deepseek_v3_config(), "v3/config.json");
  try {
    big.check_fits_in_memory(false, false, int64_t{24} << 30, big.source());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_TRUE(
        message.starts_with("v3/config.json: the model needs 2.5 TiB for its weights (6.83e+11 parameters"))
        << message;
    EXPECT_NE(message.find("this machine has 24.0 GiB"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace forge::deepseek_v3_config_test
