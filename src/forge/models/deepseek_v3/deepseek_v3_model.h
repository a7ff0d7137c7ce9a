// DeepseekV3Model: a stage of a DeepSeek-V3-family decoder (Hugging Face DeepseekV3ForCausalLM semantics) on
// the one decoder stack (models/decoder_stack.h): layers of multi-head latent attention (nn::MlaAttention)
// and a SwiGLU MLP (the first first_k_dense_replace layers) or DeepSeekMoE (nn::Moe) after them, and behind
// the loss head on the last stage the multi-token prediction modules (DeepSeek puts them there), a StackTail
// of this folder. The routers' correction biases are parameters that never get a gradient (weight decay
// off), moved once per optimizer step by apply_bias_updates.
//
// Multi-token prediction, depth k = 1..D (module model.layers.{N + k - 1}): for positions i = 0 .. T-k-1,
//   h_k = layer_k(eh_proj([enorm(emb(t_{i+k})), hnorm(h_{k-1, i})]))
// with h_0 the main model's last hidden state before the final norm; its logits
// lm_head(shared_head.norm(h_k)) (the main head) predict targets[:, k:]. The loss gradient is that of
//   main + (mtp_weight / D) * sum_k L_k
// where each L_k is normalised like the main loss: depth k's per-token gradient is grad_scale * (mtp_weight /
// D) * (tokens of the main loss / tokens of depth k) in this micro-batch (the exact mean-loss weighting when
// grad_scale = 1 / tokens of the micro-batch). The sequence-wise balance loss reaches the routers through
// set_balance_scale, the classic micro-batch auxiliary loss through set_aux_loss_scale; options.
// moe_capacity_factor sets every MoE layer's capacity (the MTP modules' too).
//
// Inference (forward_cached, on a one-stage model without tensor parallelism) keeps MLA's compressed cache:
// make_cache gives one kv head of kv_lora_rank + qk_rope_head_dim per layer; the MTP modules are not used.
//
// Not supported yet (refused in one line): topk_method greedy.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "forge/models/decoder_stack.h"
#include "forge/models/deepseek_v3/deepseek_v3_config.h"

namespace forge::models {

struct DeepseekV3Options {
  bool with_mtp = true;     // build the num_nextn_predict_layers MTP modules on the last stage
  float mtp_weight = 0.3f;  // lambda of main + lambda / D * sum_k L_k
};

// What the last micro-batch's MTP depth k measured (index k - 1), for the trainer's metrics.
struct MtpDepthStats {
  LossSum loss;
};

// The stack's description of a DeepSeek-V3 model (validates the config and refuses what forge does not
// implement yet; messages name its source). with_mtp: the MTP modules' layers are part of the model.
DecoderSpec deepseek_v3_spec(const DeepseekV3Config& config, bool with_mtp);

class MtpTail;

class DeepseekV3Model final : public DecoderStack {
 public:
  DeepseekV3Model(const DeepseekV3Config& config, nn::ComputeOptions options, float init_std = 0.02f,
                  bool with_grads = true, StageSpec stage = StageSpec::whole(),
                  ParameterStore* into = nullptr, DeepseekV3Options model_options = {});

  const DeepseekV3Config& config() const override {
    return static_cast<const DeepseekV3Config&>(DecoderStack::config());
  }
  int64_t mtp_depth() const;  // this stage's MTP modules (the last stage holds them)
  // The last forward's per-depth MTP losses (not part of StageOutput::loss, which is the main loss).
  const std::vector<MtpDepthStats>& mtp_stats() const;
  std::vector<MtpDepthTotals> mtp_totals() const override;
  int64_t mtp_depth_count() const override { return with_mtp_ ? config().num_nextn_predict_layers : 0; }

 private:
  const MtpTail* mtp() const;
  bool with_mtp_ = true;
};

// The registry's entry for DeepseekV3ForCausalLM.
ModelFamily deepseek_v3_family();

}  // namespace forge::models
