// The one decoder stack every family is built on: embedding, decoder layers assembled from a per-layer spec,
// final norm, loss head, the split backward (B and W), the KV cache, pipeline slicing, sequence-parallel
// sums and the input checks, written once.
//
// A family describes its model as data (DecoderSpec: sizes, the RoPE table, and a LayerSpec per layer: which
// attention, which feed-forward, which options) and keeps in its folder only what really differs: its
// config.json reader with Hugging Face's defaults, its tensor names and FLOPs, and the extension parts the
// stack calls at fixed places. Today's extensions: LLaVA's encoder and projector in front (their features
// replace image tokens' embeddings: forward_inserted), DeepSeek-V3's multi-token prediction behind (the
// `tail_*` hooks, run on the last stage after the loss head).
//
// Parameters are registered under their Hugging Face names ("model.layers.{i}.self_attn.q_proj.weight", the
// names Llama, Qwen, Mistral and DeepSeek share), in the order embedding, each layer (input norm,
// attention, post-attention norm, feed-forward), final norm, head; the order fixes the flat buffers' layout
// and so the bits of every sum over them.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "forge/models/model.h"
#include "forge/nn/attention.h"
#include "forge/nn/decoder_layer.h"
#include "forge/nn/embedding.h"
#include "forge/nn/gelu_mlp.h"
#include "forge/nn/loss_head.h"
#include "forge/nn/mla_attention.h"
#include "forge/nn/mlp.h"
#include "forge/nn/moe.h"
#include "forge/nn/norm.h"

namespace forge::models {

enum class AttentionKind { gqa, mla };  // grouped-query (MHA when kv heads = heads); latent (MLA)
// down(silu(gate(x)) * up(x)); down(gelu_tanh(gate(x)) * up(x)) (Gemma); c_proj(gelu(c_fc(x))), ungated
// (StarCoder2; the GELU DecoderSpec::gelu); routed experts (+ shared)
enum class FeedForwardKind { swiglu, geglu, gelu_mlp, moe };

// One decoder layer, as its family chooses it.
struct LayerSpec {
  AttentionKind attention = AttentionKind::gqa;
  FeedForwardKind feed_forward = FeedForwardKind::swiglu;
  bool qkv_bias = false;  // gqa: biases on q, k and v (Qwen2), registered after the three weights
  bool qk_norm = false;   // gqa: RMSNorms over head_dim on q and k before RoPE (Qwen3), registered after o
  int64_t window = 0;     // gqa: > 0, each query sees its `window` latest keys, itself included (Mistral)
  // gqa: the scores' scale (0: 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar^-1/2) and their soft cap
  // (> 0: softcap * tanh(s / softcap), Gemma 2's attn_logit_softcapping).
  float attention_scale = 0.0f;
  float attention_softcap = 0.0f;
  // gqa: RoPE from DecoderSpec::local_rope instead of rope (Gemma 3's sliding-window layers).
  bool local_rope = false;
  // Norms after the mixer and after the feed-forward too, before each joins the residual stream (Gemma's
  // sandwich). Names: input_layernorm, post_attention_layernorm (after the mixer), pre_feedforward_layernorm,
  // post_feedforward_layernorm; without: input_layernorm and post_attention_layernorm (before the
  // feed-forward).
  bool sandwich_norms = false;
  // gqa: a bias on o_proj; gelu_mlp: biases on c_fc and c_proj (StarCoder2's use_bias). The output
  // projections' biases are added once their tensor-parallel sum is done (nn::BranchBiases).
  bool dense_bias = false;
};

// A whole model's description. Sizes are the model's, not a tensor-parallel rank's: the stack splits them.
struct DecoderSpec {
  int64_t hidden = 0, vocab = 0, layers = 0, max_positions = 0;
  double norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  // Output projections (o_proj, down_proj) start at init_std / sqrt(2 * init_depth) (GPT-2/Megatron).
  int64_t init_depth = 0;
  int64_t ffn = 0;                                // swiglu layers' intermediate width
  int64_t heads = 0, kv_heads = 0, head_dim = 0;  // gqa layers
  nn::MlaShape mla;                               // mla layers: heads = the model's
  // moe layers: widths are the model's (expert_ffn per routed expert, shared_ffn all shared experts);
  // capacity and padding come from the compute options.
  nn::MoeShape moe;
  // moe layers' Hugging Face names: "<block>gate.weight" (the router), "<block>experts.<e>.<gate>.weight",
  // <up>, <down>, "<block>shared_experts.*"; with correction_bias the router's
  // "<block>gate.e_score_correction_bias" (DeepSeek-V3's; Mixtral has none, and names block_sparse_moe.
  // w1, w3, w2).
  struct MoeNames {
    std::string block = "mlp.", gate = "gate_proj", up = "up_proj", down = "down_proj";
    bool correction_bias = true;
  };
  MoeNames moe_names;
  // > 0: Hugging Face's load-balancing loss over every MoE layer's router (nn::MoeRouterAux; Mixtral's and
  // Qwen3-MoE's output_router_logits) with this coefficient (router_aux_loss_coef).
  double router_aux_loss_coef = 0;
  // Per layer index: the model's layers, then any an extension builds (DeepSeek-V3's MTP modules' layers).
  std::vector<LayerSpec> layer_specs;
  // cos/sin [max_positions, rotary dims / 2] on the host; the stack moves them to the device. local_rope:
  // the table of layers whose spec asks for it (empty when none does).
  nn::RopeTable rope, local_rope;
  // The layers' and the final norm's kind: RMSNorm, or LayerNorm (StarCoder2) with a bias when norm_bias
  // ("<norm>.bias", registered right after "<norm>.weight"). QK-norms and MLA's latent norms are RMSNorms.
  nn::NormKind norm = nn::NormKind::rms;
  bool norm_bias = false;
  // Every RMSNorm of the stack scales by weight + this (Gemma: 1 + w, its norm weights starting at zero).
  float norm_weight_offset = 0.0f;
  ops::GeluKind gelu = ops::GeluKind::tanh;  // gelu_mlp layers' activation
  // The embedding's rows are multiplied by this (Gemma: sqrt(hidden)).
  float embedding_scale = 1.0f;
  // > 0: the head's logits are soft-capped (Gemma 2's final_logit_softcapping).
  float final_softcap = 0.0f;
  // The KV cache per layer and token: kv heads x dims (MLA: one head of the latent and the rope key).
  int64_t cache_heads = 0, cache_dim = 0;
};

class DecoderStack;

// A host array of token ids on `device`: the array itself on the CPU, else a copy kept alive by `holder`.
const int32_t* ids_on(Device device, const int32_t* ids, int64_t n, Tensor& holder);

// A family's part behind the loss head on the last stage (DeepSeek-V3's multi-token prediction). The stack
// calls it at fixed places: registration after the head's parameters, build after the stack's modules, and
// in every pass after (forward) or before (backward) the final norm.
class StackTail {
 public:
  virtual ~StackTail() = default;
  // How many times the tail reads the embedding and the head's weight per micro-batch (their gradient uses;
  // the last stage then holds the embedding even without the first layer).
  virtual int embedding_reads() const = 0;
  virtual int head_reads() const = 0;
  virtual bool reads_ids() const = 0;  // the last stage then checks and needs token ids too
  virtual void register_parameters(DecoderStack& stack, float init_std) = 0;
  virtual void build(DecoderStack& stack) = 0;
  // Gradients each tensor-parallel rank holds only a share of (summed over the group once final).
  virtual std::vector<int> tensor_parallel_sums() const = 0;
  virtual void begin_train_step(const TrainStepSettings& settings) = 0;
  virtual void check(const MicroBatch& mb) const = 0;
  // h0: the last layer's output before the final norm [rows, hidden]; main_tokens: the main loss's tokens.
  // saved null: no backward follows.
  virtual void forward(const MicroBatch& mb, const Tensor& h0, int64_t main_tokens,
                       std::unique_ptr<StageActivations>* saved) = 0;
  // B: the gradient of h0 from the tail; W: its weight gradients.
  virtual Tensor backward_input(StageActivations& saved) = 0;
  virtual void backward_weight(StageActivations& saved) = 0;
};

class DecoderStack : public Model {
 public:
  // Registers and allocates the stage's parameters; they start at zero until initialize() or a load.
  // with_grads = false builds an inference model (no gradient buffers; backward is refused). into: see
  // models::build_model (the parameters go into a store shared with other chunks, allocated by the caller).
  // name_prefix: before every parameter's name (a LLaVA's language model is "language_model.").
  // tail: an extension run behind the loss head on the last stage (null: none).
  DecoderStack(const ModelConfig& config, DecoderSpec spec, nn::ComputeOptions options, float init_std,
               bool with_grads, StageSpec stage, ParameterStore* into, std::string name_prefix = "",
               std::unique_ptr<StackTail> tail = nullptr);
  DecoderStack(const DecoderStack&) = delete;
  DecoderStack& operator=(const DecoderStack&) = delete;

  const ModelConfig& config() const override { return *config_; }
  const StageSpec& stage() const override { return stage_; }
  const nn::ComputeOptions& options() const override { return options_; }
  ParameterStore& params() override { return params_; }
  const ParameterStore& params() const override { return params_; }
  const DecoderSpec& spec() const { return spec_; }
  int64_t padded_vocab_size() const { return padded_vocab_; }  // vocabulary rows over all tp ranks

  StageOutput forward(const MicroBatch& mb, const Tensor& hidden,
                      std::unique_ptr<StageActivations>* saved) override;
  Tensor backward_input(const Tensor& doutput, StageActivations& saved) override;
  void backward_weight(StageActivations& saved) override;
  Tensor backward(const Tensor& doutput, StageActivations& saved) override;

  Tensor logits(const int32_t* ids, int64_t batch, int64_t seq) override;
  nn::KvCache make_cache(int64_t batch, int64_t capacity = 0) const override;
  Tensor forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                        bool all_logits = false) override;
  using Model::forward_cached_images;

  // ---- Embeddings inserted in place of a token's (a LLaVA's image features; models/llava/). The rows of
  // `inserted` [count, hidden] (on the model's device) replace, in order, the embeddings of the micro-batch's
  // tokens equal to `token`: forward_inserted is forward with that splice (first stage only), and after
  // backward_input (or backward) inserted_gradient hands over the gradient of those rows [count, hidden],
  // which then take no part in the embedding's own gradient. Under sequence parallelism each rank holds the
  // gradient of its own rows only (zero elsewhere): the caller sums it over the tensor-parallel group.
  StageOutput forward_inserted(const MicroBatch& mb, int32_t token, const Tensor& inserted,
                               std::unique_ptr<StageActivations>* saved);
  Tensor inserted_gradient(StageActivations& saved) const;
  // Full logits [batch * seq, vocab] on the host with the splice (the whole model only).
  Tensor logits_inserted(const int32_t* ids, int64_t batch, int64_t seq, int32_t token,
                         const Tensor& inserted);
  // forward_cached with the splice (inference of a multimodal prompt).
  Tensor forward_cached_inserted(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                                 int32_t token, const Tensor& inserted);

  // ---- Routed experts (any layer whose LayerSpec is moe): the trainer's hooks (models/model.h).
  void begin_train_step(const TrainStepSettings& settings) override;
  int64_t expert_layer_count() const override;
  int64_t routed_experts() const override { return spec_.moe.experts; }
  std::vector<ExpertLayerView> expert_layers() override;
  void apply_bias_updates(float rate, bool zero_mean) override;
  // Per local MoE layer (main layers in order, then an extension's), this step's statistics.
  std::deque<nn::MoeStats>& moe_stats() { return moe_stats_; }
  const std::deque<nn::MoeStats>& moe_stats() const { return moe_stats_; }
  // d(total loss) / d(balance loss of one sequence of one layer) and d(total loss) / d(auxiliary loss of one
  // micro-batch of one layer); read by each forward.
  void set_balance_scale(float scale) { moe_scale_.balance = scale; }
  void set_aux_loss_scale(float scale) { moe_scale_.aux = scale; }
  // The balance (auxiliary) loss: coefficient * mean over sequences (micro-batches) of sum_i f_i P_i, summed
  // over the local MoE layers, from the statistics.
  double balance_loss(double coefficient) const;
  double aux_loss(double coefficient) const;
  // > 0: Hugging Face's load-balancing loss is on with this coefficient
  // (ModelConfig::training_router_aux_loss_coef); its value is aux_loss(router_aux_loss_coef()).
  double router_aux_loss_coef() const { return spec_.router_aux_loss_coef; }
  int64_t stage_routing_size() const override {
    return spec_.router_aux_loss_coef > 0 ? spec_.moe.experts : 0;
  }

  // Module access for tests of the backward split.
  const std::vector<nn::DecoderLayer>& layers() const { return layers_; }
  Tensor embed(const int32_t* ids, int64_t rows) const;  // host ids; first stage only

  // ---- For extensions (StackTail) and families.
  // Registers layer `index` (>= spec.layers for an extension's own) under "model.layers.{index}." like the
  // stack's layers, and builds it once the store is allocated (build_extra_layer, with its registration
  // number: 0 for the first one registered).
  int register_extra_layer(int64_t index, float init_std);
  nn::DecoderLayer build_extra_layer(int registration, const nn::ComputeOptions& options);
  // The compute options of layer `index`: its recompute policy (ComputeOptions::recompute_layers) and FP8
  // or not (the first and last fp8.bf16_*_layers keep the GEMM dtype; an extension's layers count as last).
  nn::ComputeOptions layer_options(int64_t index) const;
  nn::TensorParallel* tp() const;                        // null unless split over more than one rank
  const std::string& source() const { return source_; }  // the config's path, for messages
  const nn::RopeTable& rope() const { return rope_; }
  const std::string& prefix() const { return prefix_; }
  int embedding_id() const { return embed_id_; }
  int head_id() const { return head_id_; }
  int64_t vocab_start() const { return vocab_start_; }
  // Checks of ids and targets against the vocabulary (the stack's inputs, or an extension's).
  void check_ids(const int32_t* ids, int64_t n) const;

 protected:
  struct Activations;
  StackTail* tail() const { return tail_.get(); }  // null on stages other than the last

 private:
  struct Insertion;
  struct LayerIds {
    int norm1 = -1, norm2 = -1;
    int post1 = -1, post2 = -1;  // sandwich norms: after the mixer and after the feed-forward
    nn::AttentionParams gqa;
    int q_bias = -1;  // the first of q|k|v's biases (-1: none)
    nn::MlaParams mla;
    nn::MlpParams mlp;
    nn::GeluMlpParams gelu_mlp;
    nn::MoeParams moe;
    int mixer_bias = -1, ffn_bias = -1;  // o_proj's and c_proj's biases (dense_bias)
  };
  void check_stage_and_split(bool with_grads);
  // Where the micro-batch's local rows sit in the data, for hidden dropout (inactive without it).
  nn::DropoutRows dropout_rows(const MicroBatch& mb, Tensor& positions_holder) const;
  Init norm_weight_init() const;
  // A norm's weight "<name>.weight" (and bias, with DecoderSpec::norm_bias), replicated; its weight's id.
  int register_norm(const std::string& name);
  nn::Norm make_norm(int weight) const;
  // The ids of every parameter of the norms whose weights are `weights` (-1 skipped): weights and biases.
  std::vector<int> norm_parameters(std::initializer_list<int> weights) const;
  void register_parameters(float init_std);
  void build_modules();
  LayerIds register_layer(int64_t index, float init_std);
  void register_gqa(const std::string& p, const LayerSpec& layer, float init_std, float out_std,
                    LayerIds& ids);
  void register_mla(const std::string& p, float init_std, float out_std, LayerIds& ids);
  void register_mlp(const std::string& p, int64_t width, float init_std, float out_std, nn::MlpParams& ids);
  void register_gelu_mlp(const std::string& p, bool bias, float init_std, float out_std, LayerIds& ids);
  void register_moe(const std::string& p, float init_std, float out_std, LayerIds& ids);
  nn::DecoderLayer make_layer(int64_t index, const LayerIds& ids, const nn::ComputeOptions& options);
  void register_tensor_parallel_sums();
  void sum_over_group(int id);
  void check_inputs(const MicroBatch& mb) const;
  void require_whole(const char* what) const;
  StageOutput run_forward(const MicroBatch& mb, const Tensor& hidden, const Insertion* insertion,
                          std::unique_ptr<StageActivations>* saved);
  Insertion make_insertion(const MicroBatch& mb, int32_t token, const Tensor& inserted) const;
  void splice(const Insertion* insertion, const Tensor& x) const;
  void keep_embedding_gradient(Activations& acts, Tensor dx) const;
  Tensor final_hidden(const int32_t* ids, int64_t batch, int64_t seq, const Insertion* insertion);
  Tensor run_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                    bool all_logits, const Insertion* insertion);
  // The tail's B (and W when fused), then the final norm's, from the loss head's gradient; their sum.
  Tensor head_backward(Activations& acts, bool fused);
  nn::MoeRouterAux* begin_routing(const MicroBatch& mb, nn::MoeRouterAux& record) const;
  void check_documents(const MicroBatch& mb) const;
  void finish_routing(Activations& acts) const;

  std::unique_ptr<ModelConfig> config_;
  DecoderSpec spec_;
  std::string source_;
  std::string prefix_;
  nn::ComputeOptions options_;
  StageSpec stage_;
  ParameterStore own_params_;  // unless built into a shared store
  ParameterStore& params_;
  nn::RopeTable rope_, local_rope_;
  int embed_id_ = -1, norm_id_ = -1, head_id_ = -1;
  int64_t padded_vocab_ = 0, vocab_start_ = 0, local_vocab_ = 0;
  nn::Embedding embedding_;
  std::vector<LayerIds> layer_ids_;                      // per local layer
  std::vector<std::pair<int64_t, LayerIds>> extra_ids_;  // an extension's layers: index, ids
  std::vector<nn::DecoderLayer> layers_;
  nn::Norm final_norm_;
  nn::LossHead head_;
  std::deque<nn::MoeStats> moe_stats_;  // stable addresses: the Moe layers point at them
  std::vector<const nn::Moe*> moe_layers_;
  std::vector<std::pair<int64_t, int>> moe_layer_ids_;  // per local MoE layer: its index, its bias id
  nn::MoeStepScale moe_scale_;
  std::unique_ptr<StackTail> tail_;
};

}  // namespace forge::models
