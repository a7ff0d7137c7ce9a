// DeepseekV3Config: the architecture of a DeepSeek-V3-family model (Hugging Face DeepseekV3ForCausalLM:
// MLA attention, DeepSeekMoE with auxiliary-loss-free balancing, multi-token prediction), read from a
// Hugging Face config.json.
//
// Reading is strict, as for LlamaConfig: every key of HF's DeepseekV3Config that changes the computation is
// read and checked; a key forge does not know is refused in one line naming it and the source (with a "did
// you mean"). The bookkeeping keys listed in deepseek_v3_config.cpp (kKeptKeys: names, dtype, token ids,
// HF's init range, cache and parallelism hints, DeepSeek's auxiliary-loss hints) do not change forge's
// computation; their values are kept verbatim and written back by to_json, so that an exported config.json
// carries them. Keys that would change the math are accepted only with the values forge implements.
//
// Layers: num_hidden_layers decoder layers (the first first_k_dense_replace with a dense SwiGLU MLP, the rest
// MoE), then num_nextn_predict_layers MTP modules stored as model.layers.{N + k}. The MTP modules share the
// embedding and the output head with the main model.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "forge/models/model.h"

namespace forge::models {

// rope_scaling of type "yarn" (HF's _compute_yarn_parameters and DeepseekV3Attention's softmax scale).
struct YarnScaling {
  bool enabled = false;  // false: rope_scaling null (or rope_type "default"): plain RoPE
  double factor = 1;
  int64_t original_max_position_embeddings = 4096;  // from_json: defaults to max_position_embeddings
  double beta_fast = 32, beta_slow = 1;
  // 0 means absent (HF tests them for truthiness, so 0 and absent are the same model).
  double mscale = 0, mscale_all_dim = 0;
  double attention_factor = 0;  // 0: absent, derived from mscale / mscale_all_dim
  bool truncate = true;         // floor/ceil the correction range (HF's default)

  bool operator==(const YarnScaling&) const = default;
};

struct DeepseekV3Config final : ModelConfig {
  enum class ScoringFunc { sigmoid, softmax };
  enum class TopkMethod { noaux_tc, greedy };

  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // the dense layers' SwiGLU width
  int64_t moe_intermediate_size = 0;  // each routed expert's width (shared experts: times n_shared_experts)
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t q_lora_rank = 0;  // 0: HF's null, a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = true;
  ScoringFunc scoring_func = ScoringFunc::sigmoid;
  TopkMethod topk_method = TopkMethod::noaux_tc;
  int64_t first_k_dense_replace = 0;
  int64_t num_nextn_predict_layers = 0;  // MTP depth D
  double rope_theta = 10000.0;
  YarnScaling rope_scaling;
  bool rope_interleave = true;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 4096;
  // The bookkeeping keys of the source config.json (kKeptKeys), verbatim, for export.
  nlohmann::json kept = nlohmann::json::object();
  struct Origin {
    std::string name;
    bool operator==(const Origin&) const { return true; }
  };
  Origin origin;

  bool operator==(const DeepseekV3Config& o) const { return to_json() == o.to_json(); }

  // ModelConfig
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<DeepseekV3Config>(*this); }
  std::string architecture() const override { return "DeepseekV3ForCausalLM"; }
  // head_dim = qk_nope + qk_rope (the query/key head), kv_heads = heads (MLA has no GQA),
  // ffn = intermediate_size, layers = num_hidden_layers (without the MTP modules).
  ModelShape shape() const override;
  const std::string& source() const override { return origin.name; }
  // Every tensor of the HF checkpoint in registration order, MTP modules included, without the
  // duplicates is_ignored_duplicate() names.
  std::vector<std::pair<std::string, Shape>> tensor_shapes() const override;
  // DeepSeek's release stores, per MTP module, copies of the shared embedding and output head
  // (model.layers.{N+k}.embed_tokens.weight and model.layers.{N+k}.shared_head.head.weight): a loader accepts
  // and skips them, an exporter may write them.
  bool is_ignored_duplicate(std::string_view tensor_name) const;

  // Errors are forge::Error with one line "<source>: <what> '<key>'".
  static DeepseekV3Config from_json_file(const std::filesystem::path& path);
  static DeepseekV3Config from_json(const nlohmann::json& json, std::string_view source_name);
  // HF-compatible: from_json(to_json()) is equal, and transformers reads it as DeepseekV3ForCausalLM.
  nlohmann::json to_json() const override;
  // Sizes (bounded so that no product wraps), divisibility and the routing rules; from_json calls it.
  void validate(std::string_view source_name) const;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t num_layers_with_mtp() const { return num_hidden_layers + num_nextn_predict_layers; }
  // Layer index i (0 .. num_layers_with_mtp() - 1; MTP module k is index num_hidden_layers + k) has a MoE
  // MLP.
  bool is_moe_layer(int64_t layer) const { return layer >= first_k_dense_replace; }
  int64_t experts_per_group() const { return n_routed_experts / n_group; }
  int64_t routed_experts() const override { return n_routed_experts; }

  // RoPE of the qk_rope_head_dim channels: the qk_rope_head_dim / 2 frequencies (YaRN-blended when
  // configured), the factor cos and sin are multiplied by (YaRN's attention_factor, else 1), and the softmax
  // scale qk_head_dim^-0.5 (times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim).
  std::vector<double> rope_inv_freq() const;
  double rope_attention_factor() const;
  double softmax_scale() const;

  // Parameter counts (trainable; the e_score_correction_bias buffers are not parameters).
  int64_t attention_parameters() const;  // one layer's MLA, its two norms included
  int64_t dense_mlp_parameters() const;
  int64_t moe_parameters() const;  // router + routed experts + shared experts
  // The main model: embedding, num_hidden_layers layers, final norm, lm_head unless tied.
  int64_t main_model_parameters() const;
  // One MTP module: enorm, hnorm, eh_proj, its decoder layer, shared_head.norm (embedding and head shared).
  int64_t mtp_module_parameters(int64_t k) const;
  // Everything forge trains: the main model and the MTP modules.
  int64_t num_parameters() const override;
  // Elements of the HF checkpoint as DeepSeek releases it: num_parameters(), the correction biases, and
  // each MTP module's copies of the embedding and the head.
  int64_t checkpoint_elements() const;
  // Parameters a token passes through (top-k routed experts, shared experts and router of each MoE layer),
  // embedding included; with_mtp adds the MTP modules (their shared embedding and head not again).
  int64_t activated_parameters(bool with_mtp) const;

  // Model FLOPs per trained token (forward + backward), the accounting of LlamaConfig::flops_per_token:
  //   6 * (activated matmul parameters: every layer's MLA projections, the dense MLPs, per MoE layer the
  //        router, top-k routed and the shared experts; each MTP module's eh_proj and layer; the lm_head once
  //        for the main model and once per MTP module)
  //   + 6 * (num_hidden_layers + D) * heads * seq_len * (qk_head_dim + v_head_dim)
  // i.e. 2 FLOPs per multiply-add, x3 for backward, of QK^T (qk_head_dim) and PV (v_head_dim); as for LLaMA
  // the attention term is NOT halved for the causal mask (Megatron's and PaLM's MFU definition). Norms, the
  // embedding lookup, routing and the softmax are not counted.
  double flops_per_token(int64_t seq_len) const override;

  // Host bytes before the first step, as LlamaConfig::memory_bytes: fp32 weights (the correction biases
  // included), a bf16 copy with bf16_shadow, with `training` fp32 gradients and AdamW's two moments, and
  // the rotary tables.
  int64_t memory_bytes(bool training, bool bf16_shadow) const;
  void check_fits_in_memory(bool training, bool bf16_shadow, int64_t available_bytes,
                            std::string_view source_name) const override;
};

}  // namespace forge::models
