// The model interface every architecture implements, and the registry that builds one from a Hugging Face
// config.json by its `architectures` entry.
//
// A Model is a *stage*: the decoder layers [first_layer, end_layer) of an architecture, with the embedding
// when it is the first stage (Megatron's pre_process) and the final norm and loss head when it is the last
// (post_process). The whole model is the one-stage case. Each stage owns the parameters of its part, under
// their Hugging Face names, in its own ParameterStore; initialisation depends only on (seed, name, element),
// so stages built apart hold exactly the weights of the whole model.
//
// Per micro-batch a stage runs three entry points, the module contract of nn/:
//   forward         ids (first stage) or the previous stage's hidden states in; hidden states out, or on the
//                   last stage the loss (whose head, a fused kernel, also computes its own gradients here);
//   backward_input  (B, the critical path) the gradient of this stage's output in, of its input out;
//   backward_weight (W, may run later) accumulates (+=) the weight gradients B left pending.
// What a micro-batch keeps between them lives in a StageActivations the caller owns, so that a schedule can
// keep several micro-batches in flight and run their B and W in any order: each W reports every gradient it
// accumulated to the ParameterStore, which counts them (readiness by count, core/parameters.h).
//
// Inference (forward_cached over a KvCache) goes through the same interface, on a one-stage model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/core/parameters.h"
#include "forge/nn/compute.h"
#include "forge/nn/kv_cache.h"
#include "forge/nn/moe.h"

namespace forge::models {

struct LossSum {
  double sum = 0;      // sum of per-token losses (nats)
  int64_t tokens = 0;  // tokens with a target (target >= 0)
  double mean() const { return tokens ? sum / static_cast<double>(tokens) : 0.0; }
};

// The sizes layouts, data and accounting need, whatever the family.
struct ModelShape {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  int64_t vocab = 0, layers = 0, max_positions = 0;
};

// What a multimodal model reads beside its text: images of this shape (channels first, normalised as its
// image processor does), each standing in the ids for tokens_per_image copies of image_token.
struct ImageInput {
  int64_t channels = 0, height = 0, width = 0;
  int32_t image_token = -1;
  int64_t tokens_per_image = 0;
};

// A model's architecture, read from a Hugging Face config.json by its family (models/<family>/).
class ModelConfig {
 public:
  virtual ~ModelConfig() = default;
  virtual std::unique_ptr<ModelConfig> clone() const = 0;
  virtual std::string architecture() const = 0;  // "LlamaForCausalLM"
  virtual ModelShape shape() const = 0;
  // HF-compatible config.json: the family's from_json reads it back to an equal config.
  virtual nlohmann::json to_json() const = 0;
  // Where it was read from (a config.json path), for messages.
  virtual const std::string& source() const = 0;
  virtual int64_t num_parameters() const = 0;
  // Model FLOPs per trained token (forward + backward), Megatron's accounting (the family documents its
  // terms).
  virtual double flops_per_token(int64_t seq_len) const = 0;
  // What a training step runs when the parts named in `frozen` (ComputeOptions::frozen: "vision",
  // "projector", "language") do not train: per token, and per image (multimodal models; the backward of a
  // frozen part computes no weight gradient, and none at all where nothing before it trains). Text models:
  // flops_per_token and no image work.
  virtual double trained_flops_per_token(int64_t seq_len, const std::vector<std::string>& frozen) const {
    (void)frozen;
    return flops_per_token(seq_len);
  }
  virtual double trained_flops_per_image(const std::vector<std::string>& frozen) const {
    (void)frozen;
    return 0;
  }
  // Routed experts per MoE layer (what expert parallelism splits); 0 for a dense model.
  virtual int64_t routed_experts() const { return 0; }
  // > 0: training adds Hugging Face's load-balancing loss over every MoE layer's router logits at once with
  // this coefficient (Mixtral's and Qwen3-MoE's output_router_logits = true; nn::MoeRouterAux).
  virtual double training_router_aux_loss_coef() const { return 0; }
  // A multimodal model's image input; none for a text model. What the trainer's data, evaluation and
  // generation need to know of a model's images, whatever its family.
  virtual std::optional<ImageInput> image_input() const { return std::nullopt; }
  // Refuses, before anything is allocated, a model larger than available_bytes (one line naming source_name).
  virtual void check_fits_in_memory(bool training, bool bf16_shadow, int64_t available_bytes,
                                    std::string_view source_name) const = 0;
  // Every tensor of the Hugging Face checkpoint under its name, with its shape, in registration order.
  virtual std::vector<std::pair<std::string, Shape>> tensor_shapes() const = 0;
  // The same architecture (what resuming a checkpoint compares).
  bool same_as(const ModelConfig& other) const { return to_json() == other.to_json(); }
};

// Which part of the model a stage holds.
struct StageSpec {
  int64_t first_layer = 0;
  int64_t end_layer = -1;    // -1: through the last layer
  bool pre_process = true;   // the embedding (the first stage)
  bool post_process = true;  // the final norm and the loss head (the last stage)
  static StageSpec whole() { return {}; }
  // Stage `index` of `stages` over `layers` decoder layers, split as evenly as possible (the first stages
  // take the remainder).
  static StageSpec split(int64_t layers, int stages, int index);
  // Stage `index` of a split given as the decoder layers of each stage in order
  // (pipeline::stage_layer_counts).
  static StageSpec of_counts(const std::vector<int64_t>& layer_counts, int index);
};

// One micro-batch: ids and targets [batch, seq] on the host (a negative target is ignored). A stage that is
// not the first reads no ids; one that is not the last reads no targets. The loss gradient is that of
// grad_scale * (sum of per-token losses).
struct MicroBatch {
  const int32_t* ids = nullptr;
  const int32_t* targets = nullptr;
  int64_t batch = 0, seq = 0;
  float grad_scale = 0.0f;
  // Multimodal inputs (a LLaVA's first stage; other models refuse them): `images` images [images, channels,
  // height, width], normalised fp32 on the host (data/image_processor.h), whose projected features replace
  // the embeddings of the image tokens in ids, in order.
  const float* pixels = nullptr;
  int64_t images = 0;
  // A training micro-batch: the data index of its first sequence (the rest follow in order), and with context
  // parallelism each local position's place in the whole sequence ([seq] on the host; null: the identity).
  // Hidden dropout's masks are drawn from them (nn::DropoutRows); first_sample < 0 (evaluation, inference):
  // no dropout.
  int64_t first_sample = -1;
  const int32_t* positions = nullptr;
  // A training micro-batch on a stage that is not the first, with Model::stage_routing_size() > 0: what the
  // earlier stages' output said (StageOutput::routing).
  const double* routing_before = nullptr;
  // Packed documents: the lengths of the documents over the batch * seq rows, in order, each within one
  // sequence (null: each sequence is one document). Attention stays within each document and positions
  // restart at its start (nn::LayerPart::Saved::documents); the targets should not cross documents (the
  // data's job: a document's last token predicts nothing).
  const std::vector<int64_t>* documents = nullptr;
};

// What a stage keeps of one micro-batch between forward, backward_input and backward_weight.
class StageActivations {
 public:
  virtual ~StageActivations() = default;
  // With Model::stage_routing_size() > 0: the micro-batch's routing over every stage's layers. Set by the
  // caller before the backward of a stage that is not the last (from the next stage's backward); the last
  // stage's backward sets it. Either way the earlier stage's backward is given it after.
  std::vector<double> routing_total;
};

struct StageOutput {
  Tensor
      hidden;  // not the last stage: [rows, hidden] for the next stage (rows / tp under sequence parallelism)
  LossSum loss;  // the last stage
  // Not the last stage, with Model::stage_routing_size() > 0: the routing through this stage, for the next
  // (MicroBatch::routing_before).
  std::vector<double> routing;
};

// ---- What the trainer sets and reads each step in families with routed experts or multi-token prediction
// (DeepSeek-V3); the defaults of Model are those of a family without them.
struct TrainStepSettings {
  // d(total loss) / d(one sequence's balance loss in one MoE layer): the sequence-wise balance loss's
  // coefficient divided by the sequences of the global batch (0: no balance loss).
  float balance_scale = 0.0f;
  // d(total loss) / d(one micro-batch's auxiliary loss in one MoE layer): the classic auxiliary loss's
  // coefficient divided by the micro-batches of the global batch (0: no auxiliary loss).
  float aux_loss_scale = 0.0f;
  // d(total loss) / d(one micro-batch's loss) for losses a family defines per micro-batch (Hugging Face's
  // load-balancing loss, Model::router_aux_loss_coef): 1 / the micro-batches of the global batch.
  float micro_batch_weight = 1.0f;
  float mtp_weight = 0.0f;  // lambda of main + lambda / D * sum_k L_k
};

// One of this stage's MoE layers. slot: its place among the model's MoE layers over every stage (main layers
// in order, then the MTP modules'), 0 .. Model::expert_layer_count() - 1. The statistics are those of this
// step's training micro-batches on this rank (loads counted in backward_input).
struct ExpertLayerView {
  int64_t layer = 0;  // the Hugging Face layer index (an MTP module's is num_hidden_layers + k - 1)
  int64_t slot = 0;
  nn::MoeStats* stats = nullptr;
  int bias = -1;  // the correction bias' parameter id (-1: none)
};

// One MTP depth over this step's training micro-batches on this rank.
struct MtpDepthTotals {
  LossSum loss;
  int64_t top1 = 0;  // tokens whose target is the argmax of the depth's logits (ties count)
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const StageSpec& stage() const = 0;
  virtual const nn::ComputeOptions& options() const = 0;
  virtual ParameterStore& params() = 0;
  virtual const ParameterStore& params() const = 0;
  virtual void initialize(uint64_t seed) { params().initialize(seed); }
  int64_t num_local_layers() const { return stage().end_layer - stage().first_layer; }

  // ---- The stage entry points. `saved` null: no backward will follow (evaluation), nothing is kept.
  // hidden: the previous stage's output (ignored by the first stage).
  virtual StageOutput forward(const MicroBatch& mb, const Tensor& hidden,
                              std::unique_ptr<StageActivations>* saved) = 0;
  // doutput: the gradient of forward's hidden output (ignored by the last stage). Returns the gradient of its
  // hidden input (undefined for the first stage, whose embedding gradient is a weight gradient).
  virtual Tensor backward_input(const Tensor& doutput, StageActivations& saved) = 0;
  virtual void backward_weight(StageActivations& saved) = 0;
  // B and W in the fused order (each layer's W right after its B: the least memory), bitwise the same
  // gradients as backward_input then backward_weight. Returns what backward_input returns.
  virtual Tensor backward(const Tensor& doutput, StageActivations& saved) = 0;
  // Besides the hidden states and their gradients, the values of this many doubles travel between pipeline
  // stages with each training micro-batch (0: none): a loss over every layer at once, Hugging Face's
  // load-balancing loss (nn::MoeRouterAux), needs the sums of every stage's routing. Forward, each stage
  // hands on StageOutput::routing (MicroBatch::routing_before of the next); backward, the last stage's
  // StageActivations::routing_total goes back to every earlier stage's.
  virtual int64_t stage_routing_size() const { return 0; }

  // ---- Whole-model conveniences (one stage holding everything).
  // One micro-batch's forward, loss and backward (B then W); gradients accumulate (+=). Outside a counted
  // gradient step (ParameterStore::begin_grad_step) it is a step of its own: its gradients are final on
  // return.
  LossSum forward_backward(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq,
                           float grad_scale);
  // Loss only (evaluation); keeps no activations.
  LossSum forward_loss(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq);
  // Full logits [batch * seq, vocab] on the host.
  virtual Tensor logits(const int32_t* ids, int64_t batch, int64_t seq) = 0;
  // A KV cache for `batch` sequences of up to `capacity` positions (0 = max_position_embeddings).
  virtual nn::KvCache make_cache(int64_t batch, int64_t capacity = 0) const = 0;
  // Runs new_tokens tokens per sequence at positions cache.length().., appends their keys and values and
  // returns the logits of each sequence's last new token [batch, vocab] (all_logits: of every new token).
  virtual Tensor forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                                bool all_logits = false) = 0;
  // The same with images (`images` of them, [images, channels, height, width] normalised on the host) whose
  // features replace the new tokens' image tokens, in order: a multimodal prompt. Models without an image
  // encoder refuse images.
  virtual Tensor forward_cached_images(const int32_t* ids, int64_t batch, int64_t new_tokens,
                                       nn::KvCache& cache, const float* pixels, int64_t images);

  // ---- Expert balancing and multi-token prediction (train/step.cpp drives them).
  // Before a step's micro-batches: clears the step's statistics and sets its scales.
  virtual void begin_train_step(const TrainStepSettings&) {}
  // MoE layers of the whole model (every stage), and this stage's.
  virtual int64_t expert_layer_count() const { return 0; }
  virtual int64_t routed_experts() const { return 0; }  // per MoE layer
  virtual std::vector<ExpertLayerView> expert_layers() { return {}; }
  // After an applied optimizer step, once each layer's loads are summed over the global batch (every data-
  // parallel replica, every copy of the stage): bias += rate * sign(mean - load), or its zero-mean variant.
  virtual void apply_bias_updates(float /*rate*/, bool /*zero_mean*/) {}
  // The step's per-depth MTP totals on this rank (empty: no MTP on this stage).
  virtual std::vector<MtpDepthTotals> mtp_totals() const { return {}; }
  // MTP depths of the whole model (the last stage holds them).
  virtual int64_t mtp_depth_count() const { return 0; }
};

// ---- The registry: one entry per family, keyed by the Hugging Face `architectures` name.
struct ModelFamily {
  std::string architecture;  // "LlamaForCausalLM"
  std::string model_type;    // "llama"
  // Reads and validates a config.json (strict: unknown keys are errors naming source).
  std::function<std::unique_ptr<ModelConfig>(const nlohmann::json& json, std::string_view source)>
      parse_config;
  // Builds a stage; with_grads = false builds an inference model (no gradient buffers). into: see
  // build_model.
  std::function<std::unique_ptr<Model>(const ModelConfig& config, const nn::ComputeOptions& options,
                                       const StageSpec& stage, float init_std, bool with_grads,
                                       ParameterStore* into)>
      build;
};

// The entry of a family whose config type reads itself (Config::from_json(json, source)) and whose model
// type builds from it (ModelType(config, options, init_std, with_grads, stage, into)).
template <typename Config, typename ModelType>
ModelFamily family_entry(std::string architecture, std::string model_type) {
  ModelFamily f;
  f.architecture = std::move(architecture);
  f.model_type = std::move(model_type);
  f.parse_config = [](const nlohmann::json& json, std::string_view source) -> std::unique_ptr<ModelConfig> {
    return std::make_unique<Config>(Config::from_json(json, source));
  };
  f.build = [name = f.architecture](const ModelConfig& config, const nn::ComputeOptions& options,
                                    const StageSpec& stage, float init_std, bool with_grads,
                                    ParameterStore* into) -> std::unique_ptr<Model> {
    const auto* typed = dynamic_cast<const Config*>(&config);
    FORGE_CHECK(typed != nullptr, "a {} config given to the {} family", config.architecture(), name);
    return std::make_unique<ModelType>(*typed, options, init_std, with_grads, stage, into);
  };
  return f;
}

const std::vector<ModelFamily>& model_families();
// Their architectures, comma-separated ("LlamaForCausalLM, DeepseekV3ForCausalLM, ..."), for messages and
// --help texts.
std::string family_names();
// The family of a config.json, by its `architectures` (or, without it, `model_type`); throws forge::Error
// naming source and the families forge implements when there is none.
const ModelFamily& family_of(const nlohmann::json& config_json, std::string_view source);
const ModelFamily& family_named(std::string_view architecture);
std::unique_ptr<ModelConfig> parse_model_config(const nlohmann::json& config_json, std::string_view source);
std::unique_ptr<ModelConfig> read_model_config(const std::string& path);  // a config.json file
// into (null: the stage's own store): register the stage's parameters into this store, which the chunks of
// one pipeline rank share (interleaved, V and DualPipe schedules: one optimizer, one set of gradient buckets
// and one checkpoint per rank). The caller allocates it once every chunk is built (bf16 shadow when the GEMM
// dtype is bf16, gradients, on options.device) and then seals options.fp8; params() is the shared store.
std::unique_ptr<Model> build_model(const ModelConfig& config, const nn::ComputeOptions& options,
                                   const StageSpec& stage = StageSpec::whole(), float init_std = 0.02f,
                                   bool with_grads = true, ParameterStore* into = nullptr);

}  // namespace forge::models
