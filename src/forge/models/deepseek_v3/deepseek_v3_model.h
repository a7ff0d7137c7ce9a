// DeepseekV3Model: a stage of a DeepSeek-V3-family decoder (Hugging Face DeepseekV3ForCausalLM semantics):
// decoder layers of multi-head latent attention (nn::MlaAttention) and a SwiGLU MLP (the first
// first_k_dense_replace layers) or DeepSeekMoE (nn::Moe) after them, the embedding on the first stage, and on
// the last the final norm, the fused loss head and the multi-token prediction modules (DeepSeek puts them
// there). Parameters live under their Hugging Face names in one ParameterStore; the routers' correction
// biases are parameters that never get a gradient (weight decay off), moved once per optimizer step by
// apply_bias_updates.
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
// Not supported yet (refused in one line): FP8 (the MoE's grouped GEMMs have no FP8 path), topk_method
// greedy, MTP under sequence parallelism.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "forge/models/deepseek_v3/deepseek_v3_config.h"
#include "forge/models/model.h"
#include "forge/nn/attention.h"
#include "forge/nn/decoder_layer.h"
#include "forge/nn/embedding.h"
#include "forge/nn/linear.h"
#include "forge/nn/loss_head.h"
#include "forge/nn/mla_attention.h"
#include "forge/nn/mlp.h"
#include "forge/nn/moe.h"
#include "forge/nn/rmsnorm.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::models {

struct DeepseekV3Options {
  bool with_mtp = true;     // build the num_nextn_predict_layers MTP modules on the last stage
  float mtp_weight = 0.3f;  // lambda of main + lambda / D * sum_k L_k
};

// What the last micro-batch's MTP depth k measured (index k - 1), for the trainer's metrics.
struct MtpDepthStats {
  LossSum loss;
};

class DeepseekV3Model final : public Model {
 public:
  DeepseekV3Model(const DeepseekV3Config& config, nn::ComputeOptions options, float init_std = 0.02f,
                  bool with_grads = true, StageSpec stage = StageSpec::whole(),
                  ParameterStore* into = nullptr, DeepseekV3Options model_options = {});
  DeepseekV3Model(const DeepseekV3Model&) = delete;
  DeepseekV3Model& operator=(const DeepseekV3Model&) = delete;

  const DeepseekV3Config& config() const override { return config_; }
  const StageSpec& stage() const override { return stage_; }
  const nn::ComputeOptions& options() const override { return options_; }
  ParameterStore& params() override { return params_; }
  const ParameterStore& params() const override { return params_; }
  int64_t padded_vocab_size() const { return padded_vocab_; }
  int64_t mtp_depth() const { return static_cast<int64_t>(mtp_.size()); }

  StageOutput forward(const MicroBatch& mb, const Tensor& hidden,
                      std::unique_ptr<StageActivations>* saved) override;
  Tensor backward_input(const Tensor& doutput, StageActivations& saved) override;
  void backward_weight(StageActivations& saved) override;
  Tensor backward(const Tensor& doutput, StageActivations& saved) override;

  Tensor logits(const int32_t* ids, int64_t batch, int64_t seq) override;
  nn::KvCache make_cache(int64_t batch, int64_t capacity = 0) const override;
  Tensor forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                        bool all_logits = false) override;

  // ---- Balancing. Per local MoE layer (main layers in order, then the MTP modules' MoE layers), the
  // statistics of this step's training micro-batches (counted in backward).
  std::deque<nn::MoeStats>& moe_stats() { return moe_stats_; }
  const std::deque<nn::MoeStats>& moe_stats() const { return moe_stats_; }
  // d(total loss) / d(balance loss of one sequence of one layer): the coefficient alpha divided by the
  // sequences of the global batch (0: no balance loss). Read by each forward.
  void set_balance_scale(float scale) { balance_scale_.balance = scale; }
  // d(total loss) / d(auxiliary loss of one micro-batch of one layer): its coefficient divided by the
  // micro-batches of the global batch (0: no auxiliary loss). Read by each forward.
  void set_aux_loss_scale(float scale) { balance_scale_.aux = scale; }
  // The balance loss alpha * mean over sequences of sum_i f_i P_i summed over the local MoE layers, from the
  // statistics (call before apply_bias_updates, which clears them).
  double balance_loss(double coefficient) const;
  // The auxiliary loss alpha * mean over micro-batches of sum_i f_i P_i summed over the local MoE layers,
  // likewise (0 unless set_aux_loss_scale was non-zero during the forwards).
  double aux_loss(double coefficient) const;
  // Every MoE layer's bias += rate * sign(mean - load) (the caller has summed the loads over data-parallel
  // ranks); clears the statistics.

  // The last forward's per-depth MTP losses (not part of StageOutput::loss, which is the main loss).
  const std::vector<MtpDepthStats>& mtp_stats() const { return mtp_stats_; }

  // ---- The trainer's hooks (models/model.h).
  void begin_train_step(const TrainStepSettings& settings) override;
  int64_t expert_layer_count() const override;
  int64_t routed_experts() const override { return config_.n_routed_experts; }
  std::vector<ExpertLayerView> expert_layers() override;
  void apply_bias_updates(float rate, bool zero_mean) override;
  std::vector<MtpDepthTotals> mtp_totals() const override { return step_mtp_; }
  int64_t mtp_depth_count() const override {
    return model_options_.with_mtp ? config_.num_nextn_predict_layers : 0;
  }

 private:
  struct Activations;
  struct LayerIds {
    int norm1 = -1, norm2 = -1;
    nn::MlaParams mla;
    bool moe = false;
    nn::MlpParams dense;
    nn::MoeParams experts;
  };
  struct MtpIds {
    int enorm = -1, hnorm = -1, eh_proj = -1, head_norm = -1;
    LayerIds layer;
  };
  struct MtpModule {
    nn::RmsNorm enorm, hnorm, head_norm;
    nn::Linear eh_proj;
    nn::DecoderLayer layer;
  };
  LayerIds register_layer(int64_t index, float init_std);
  nn::DecoderLayer make_layer(int64_t index, const LayerIds& ids);
  nn::ComputeOptions layer_options(int64_t index) const;  // FP8 or not, by layer
  void register_tensor_parallel_sums();
  void check_inputs(const MicroBatch& mb) const;
  void require_whole(const char* what) const;
  nn::TensorParallel* tp() const;
  // MTP: forward of every depth from h_0 (rows [batch * seq, hidden]); fills acts and out.loss.
  void mtp_forward(const MicroBatch& mb, const Tensor& h0, int64_t main_tokens, Activations* acts);
  // MTP backward (B): returns the gradient of h_0 from every depth.
  Tensor mtp_backward_input(Activations& acts);
  void mtp_backward_weight(Activations& acts);

  DeepseekV3Config config_;
  nn::ComputeOptions options_;
  StageSpec stage_;
  DeepseekV3Options model_options_;
  ParameterStore own_params_;
  ParameterStore& params_;
  nn::RopeTable rope_;
  int embed_id_ = -1, norm_id_ = -1, head_id_ = -1;
  int64_t padded_vocab_ = 0, vocab_start_ = 0, local_vocab_ = 0;
  nn::Embedding embedding_;  // the first stage's, and the MTP modules' (the same tensor on a one-stage model)
  std::vector<LayerIds> layer_ids_;
  std::vector<MtpIds> mtp_ids_;
  std::deque<nn::MoeStats> moe_stats_;  // stable addresses: the Moe layers point at them
  std::vector<const nn::Moe*> moe_layers_;
  std::vector<std::pair<int64_t, int>> moe_layer_ids_;  // [local MoE layer]: its layer index, its bias id
  nn::MoeStepScale balance_scale_;
  std::vector<nn::DecoderLayer> layers_;
  std::vector<std::unique_ptr<MtpModule>> mtp_;
  nn::RmsNorm final_norm_;
  nn::LossHead head_;
  // The MTP modules' embedding and head (the same tensors): under sequence parallelism they, and the MTP
  // layers, run on mtp_tp_, the tensor-parallel group without sequence parallelism, over every row (each
  // depth shifts the rows by a position, across the shards' boundaries).
  std::unique_ptr<nn::TensorParallel> mtp_tp_;
  nn::Embedding mtp_embedding_;
  nn::LossHead mtp_head_;
  std::vector<MtpDepthStats> mtp_stats_;
  std::vector<MtpDepthTotals> step_mtp_;  // the step's training forwards (begin_train_step clears them)
};

// The registry's entry for DeepseekV3ForCausalLM.
ModelFamily deepseek_v3_family();

}  // namespace forge::models
