// LlavaModel: a stage of a LLaVA (Hugging Face LlavaForConditionalGeneration semantics): on the first stage
// the vision encoder (nn/vision_encoder.h) and the projector, whose output replaces the embeddings of the
// image tokens, then the LLaMA's decoder layers (a LlamaModel registered under "language_model."), with the
// loss head on the last stage. Every parameter sits in one ParameterStore under its Hugging Face name.
//
// A micro-batch brings its images as flattened patches (MicroBatch::pixels, patchify() below) and as many
// image tokens in its ids as the images give features. The encoder and projector have nothing downstream
// waiting on their gradients (the pixels need none), so a stage's B (backward_input) covers only the language
// model and W (backward_weight) runs the projector's and the encoder's backward whole.
#pragma once

#include <memory>

#include "forge/models/llama/llama_model.h"
#include "forge/models/llava/llava_config.h"
#include "forge/models/model.h"
#include "forge/nn/vision_encoder.h"

namespace forge::models {

class LlavaModel final : public Model {
 public:
  LlavaModel(const LlavaConfig& config, nn::ComputeOptions options, float init_std = 0.02f,
             bool with_grads = true, StageSpec stage = StageSpec::whole(), ParameterStore* into = nullptr);
  LlavaModel(const LlavaModel&) = delete;
  LlavaModel& operator=(const LlavaModel&) = delete;

  const LlavaConfig& config() const override { return config_; }
  const StageSpec& stage() const override { return language_->stage(); }
  const nn::ComputeOptions& options() const override { return options_; }
  ParameterStore& params() override { return params_; }
  const ParameterStore& params() const override { return params_; }

  StageOutput forward(const MicroBatch& mb, const Tensor& hidden,
                      std::unique_ptr<StageActivations>* saved) override;
  Tensor backward_input(const Tensor& doutput, StageActivations& saved) override;
  void backward_weight(StageActivations& saved) override;
  Tensor backward(const Tensor& doutput, StageActivations& saved) override;

  // Text only (no image tokens): the language model's.
  Tensor logits(const int32_t* ids, int64_t batch, int64_t seq) override;
  // With images: full logits [batch * seq, vocab] on the host.
  Tensor logits(const MicroBatch& mb);
  nn::KvCache make_cache(int64_t batch, int64_t capacity = 0) const override;
  Tensor forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                        bool all_logits = false) override;
  Tensor forward_cached_images(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                               const float* pixels, int64_t images) override;

  // The projected image features [images * tokens_per_image, text hidden] (inference; on the host).
  Tensor image_features(const float* pixels, int64_t images);
  LlamaModel& language_model() { return *language_; }

  // One image [channels, height, width] (fp32, channels first, as the image processor writes it) as its
  // patches [patches, channels * patch * patch], patches row-major and each channel-major, the order of the
  // patch convolution's weight. height and width must be multiples of patch.
  static void patchify(const float* image, int64_t channels, int64_t height, int64_t width, int64_t patch,
                       float* out);

 private:
  struct Activations;
  struct Projector {
    nn::Linear first, second;
    nn::Bias first_bias, second_bias;
  };
  void register_vision(float init_std);
  void build_vision_modules();  // encoder and projector over the registered parameters
  // Encoder and projector forward: the features that replace the image tokens' embeddings.
  Tensor vision_forward(const MicroBatch& mb, Activations* acts);
  // Their backward from the features' gradient (B and W together).
  void vision_backward(const Tensor& dfeatures, Activations& acts);
  Tensor inserted_gradient(Activations& acts);
  void check_images(const MicroBatch& mb) const;
  bool is_frozen(const std::string& part) const;  // options.frozen names it

  LlavaConfig config_;
  nn::ComputeOptions options_;
  ParameterStore own_params_;
  ParameterStore& params_;
  nn::VisionEncoderParams vision_ids_;
  int proj_first_ = -1, proj_first_bias_ = -1, proj_second_ = -1, proj_second_bias_ = -1;
  std::unique_ptr<LlamaModel> language_;
  nn::VisionEncoder encoder_;
  Projector projector_;
};

// The registry's entry for LlavaForConditionalGeneration.
ModelFamily llava_family();

}  // namespace forge::models
