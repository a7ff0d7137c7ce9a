#include "forge/models/llava/llava_model.h"

#include <algorithm>

#include "forge/core/error.h"
#include "forge/core/memory.h"
#include "forge/kernels/host_memory.h"
#include "forge/kernels/ops.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::models {
namespace {

// The encoder and projector run whole on every rank (no tensor split), in the model's GEMM dtype unless
// Fp8Options::vision puts them under the FP8 recipe.
nn::ComputeOptions unsplit(nn::ComputeOptions o) {
  o.tp = nullptr, o.cp = nullptr, o.ep = nullptr;
  if (o.fp8 && !o.fp8->options().vision) o.fp8 = nullptr;
  return o;
}

nn::TensorParallel* split_group(const nn::ComputeOptions& o) {
  return o.tp && o.tp->size() > 1 ? o.tp : nullptr;
}

}  // namespace

struct LlavaModel::Activations final : StageActivations {
  std::unique_ptr<StageActivations> language;
  bool has_images = false;
  int64_t images = 0;
  nn::VisionEncoder::Saved encoder;
  nn::GemmOperand proj_in, act_in;  // the projector's two GEMM inputs
  Tensor proj_hidden;               // linear_1's output before the activation (mlp2x_gelu)
  Tensor dinserted;                 // after B: the gradient of the spliced features
};

LlavaModel::LlavaModel(const LlavaConfig& config, nn::ComputeOptions options, float init_std, bool with_grads,
                       StageSpec stage, ParameterStore* into)
    : config_(config), options_(options), params_(into ? *into : own_params_) {
  const std::string source = config.origin.empty() ? "model config" : config.origin;
  config_.validate(source);
  const bool on_host = options.device == Device::cpu;
  config_.check_fits_in_memory(on_host && with_grads, on_host && options.gemm_dtype == DType::bf16,
                               model_host_memory_bytes(), source);
  for (const std::string& part : options.frozen)
    if (part != "vision" && part != "projector" && part != "language")
      fail("train.freeze: '{}' is not a part of a LLaVA (vision, projector, language)", part);
  if (options.frozen.size() >= 3 && with_grads)
    fail("train.freeze freezes every part of the model ({}): nothing would train", source);
  if (stage.pre_process) register_vision(init_std);
  const int first_language = params_.count();
  language_ = std::make_unique<LlamaModel>(config_.text, options, init_std, with_grads, stage, &params_,
                                           "language_model.");
  if (is_frozen("language"))
    for (int id = first_language; id < params_.count(); ++id) params_.freeze(id);
  // The encoder's and projector's modules before the FP8 state is sealed (they may hold FP8 Linears).
  if (stage.pre_process) build_vision_modules();
  if (!into) {
    params_.allocate(options.gemm_dtype == DType::bf16, with_grads, options.device);
    if (options.fp8) options.fp8->seal();
  }
}

void LlavaModel::build_vision_modules() {
  const VisionConfig& v = config_.vision;
  nn::VisionEncoderShape shape;
  shape.hidden = v.hidden_size, shape.heads = v.num_attention_heads, shape.ffn = v.intermediate_size;
  shape.patch_dim = v.patch_dim(), shape.patches = v.num_patches();
  shape.class_token = v.has_class_token(), shape.pre_norm = v.kind == VisionKind::clip;
  shape.eps = static_cast<float>(v.layer_norm_eps), shape.act = v.hidden_act;
  const nn::ComputeOptions whole = unsplit(options_);
  encoder_ = nn::VisionEncoder(&params_, vision_ids_, shape, whole);
  projector_.first = nn::Linear(&params_, {proj_first_}, config_.projector_input(), whole);
  if (proj_first_bias_ >= 0) projector_.first_bias = nn::Bias(&params_, {proj_first_bias_});
  if (proj_second_ >= 0) {
    projector_.second = nn::Linear(&params_, {proj_second_}, config_.text.hidden_size, whole);
    if (proj_second_bias_ >= 0) projector_.second_bias = nn::Bias(&params_, {proj_second_bias_});
  }
}

// The encoder's and projector's parameters under their Hugging Face names, every tensor of the checkpoint
// (layers past the deepest feature layer and SigLIP's head included, which no step reads). Replicated on
// every tensor-parallel rank; rank 0's copy counts.
void LlavaModel::register_vision(float init_std) {
  const VisionConfig& v = config_.vision;
  const int tp_rank = options_.tp_rank();
  const ShardSpec replicated{-1, 0, {}, tp_rank == 0};
  const std::string pre = "vision_tower.vision_model.";
  const int64_t h = v.hidden_size, f = v.intermediate_size;
  auto add = [&](const std::string& name, Shape shape, bool decay, Init init) {
    return params_.add(pre + name, std::move(shape), decay, init, init_std, replicated);
  };
  nn::VisionEncoderParams& ids = vision_ids_;
  const int first_vision = params_.count();
  if (v.has_class_token()) ids.class_embedding = add("embeddings.class_embedding", {h}, false, Init::normal);
  ids.patch = add("embeddings.patch_embedding.weight", {h, v.num_channels, v.patch_size, v.patch_size}, true,
                  Init::normal);
  if (v.kind == VisionKind::siglip)
    ids.patch_bias = add("embeddings.patch_embedding.bias", {h}, false, Init::zeros);
  ids.position = add("embeddings.position_embedding.weight", {v.num_positions(), h}, true, Init::normal);
  if (v.kind == VisionKind::clip) {
    ids.pre_norm_weight = add("pre_layrnorm.weight", {h}, false, Init::ones);
    ids.pre_norm_bias = add("pre_layrnorm.bias", {h}, false, Init::zeros);
  }
  const int64_t used = config_.encoder_layers_used();
  for (int64_t i = 0; i < v.num_hidden_layers; ++i) {
    const std::string l = "encoder.layers." + std::to_string(i) + ".";
    nn::VisionLayerParams p;
    p.norm1_weight = add(l + "layer_norm1.weight", {h}, false, Init::ones);
    p.norm1_bias = add(l + "layer_norm1.bias", {h}, false, Init::zeros);
    p.q = add(l + "self_attn.q_proj.weight", {h, h}, true, Init::normal);
    p.k = add(l + "self_attn.k_proj.weight", {h, h}, true, Init::normal);
    p.v = add(l + "self_attn.v_proj.weight", {h, h}, true, Init::normal);
    p.q_bias = add(l + "self_attn.q_proj.bias", {h}, false, Init::zeros);
    p.k_bias = add(l + "self_attn.k_proj.bias", {h}, false, Init::zeros);
    p.v_bias = add(l + "self_attn.v_proj.bias", {h}, false, Init::zeros);
    p.out = add(l + "self_attn.out_proj.weight", {h, h}, true, Init::normal);
    p.out_bias = add(l + "self_attn.out_proj.bias", {h}, false, Init::zeros);
    p.norm2_weight = add(l + "layer_norm2.weight", {h}, false, Init::ones);
    p.norm2_bias = add(l + "layer_norm2.bias", {h}, false, Init::zeros);
    p.fc1 = add(l + "mlp.fc1.weight", {f, h}, true, Init::normal);
    p.fc1_bias = add(l + "mlp.fc1.bias", {f}, false, Init::zeros);
    p.fc2 = add(l + "mlp.fc2.weight", {h, f}, true, Init::normal);
    p.fc2_bias = add(l + "mlp.fc2.bias", {h}, false, Init::zeros);
    if (i < used) ids.layers.push_back(p);
  }
  // What no feature reads: the layers past the deepest feature layer, the pooled output's norm, SigLIP's
  // head. Kept (checkpoints carry them) but never trained.
  const int first_unused =
      used < v.num_hidden_layers
          ? params_.find(pre + "encoder.layers." + std::to_string(used) + ".layer_norm1.weight")
          : params_.count();
  add("post_layernorm.weight", {h}, false, Init::ones);
  add("post_layernorm.bias", {h}, false, Init::zeros);
  for (const auto& [name, shape] : v.tensor_shapes(pre, true))
    if (name.rfind(pre + "head.", 0) == 0)
      params_.add(name, shape, shape.size() >= 2, Init::normal, init_std, replicated);
  for (int id = is_frozen("vision") ? first_vision : first_unused; id < params_.count(); ++id)
    params_.freeze(id);
  const int first_projector = params_.count();
  const int64_t th = config_.text.hidden_size;
  auto add_proj = [&](const std::string& name, Shape shape, bool decay, Init init) {
    return params_.add("multi_modal_projector." + name, std::move(shape), decay, init, init_std, replicated);
  };
  proj_first_ = add_proj("linear_1.weight", {th, config_.projector_input()}, true, Init::normal);
  if (config_.projector_bias) proj_first_bias_ = add_proj("linear_1.bias", {th}, false, Init::zeros);
  if (config_.projector == ProjectorType::mlp2x_gelu) {
    proj_second_ = add_proj("linear_2.weight", {th, th}, true, Init::normal);
    if (config_.projector_bias) proj_second_bias_ = add_proj("linear_2.bias", {th}, false, Init::zeros);
  }
  if (is_frozen("projector"))
    for (int id = first_projector; id < params_.count(); ++id) params_.freeze(id);
}

bool LlavaModel::is_frozen(const std::string& part) const {
  return std::find(options_.frozen.begin(), options_.frozen.end(), part) != options_.frozen.end();
}

void LlavaModel::patchify(const float* image, int64_t channels, int64_t height, int64_t width, int64_t patch,
                          float* out) {
  FORGE_CHECK(patch > 0 && height % patch == 0 && width % patch == 0,
              "patchify: a {} x {} image does not cut into {} x {} patches", height, width, patch, patch);
  const int64_t across = width / patch, down = height / patch, per_patch = channels * patch * patch;
  for (int64_t py = 0; py < down; ++py)
    for (int64_t px = 0; px < across; ++px) {
      float* dst = out + (py * across + px) * per_patch;
      for (int64_t c = 0; c < channels; ++c)
        for (int64_t ky = 0; ky < patch; ++ky) {
          const float* src = image + (c * height + py * patch + ky) * width + px * patch;
          std::copy_n(src, patch, dst + (c * patch + ky) * patch);
        }
    }
}

void LlavaModel::check_images(const MicroBatch& mb) const {
  if (mb.images < 0) fail("a micro-batch of {} images", mb.images);
  if (mb.images > 0 && !mb.pixels) fail("a micro-batch of {} images came without their pixels", mb.images);
}

Tensor LlavaModel::vision_forward(const MicroBatch& mb, Activations* acts) {
  const VisionConfig& v = config_.vision;
  const int64_t images = mb.images, positions = v.num_positions(), per_image = config_.tokens_per_image();
  Tensor host = Tensor::empty({images * v.num_patches(), v.patch_dim()}, DType::f32);
  const int64_t values = v.num_channels * v.image_size * v.image_size;  // per image
  for (int64_t i = 0; i < images; ++i)
    patchify(mb.pixels + i * values, v.num_channels, v.image_size, v.image_size, v.patch_size,
             host.f32() + i * v.num_patches() * v.patch_dim());
  const Tensor patches = host.to(options_.device);
  const int64_t in = config_.projector_input();
  Tensor features =
      encoder_.forward(patches, images, config_.feature_layer_indices(), acts ? &acts->encoder : nullptr);
  if (per_image != positions) {  // "default" strategy on CLIP: the class token's row is left out
    Tensor kept = Tensor::empty({images * per_image, in}, DType::f32, options_.device);
    ops::StridedCopyParams p;
    p.shape[0] = images, p.shape[1] = per_image, p.shape[2] = in;
    p.src = features.f32() + (positions - per_image) * in, p.src_stride[0] = positions * in,
    p.src_stride[1] = in;
    p.dst = kept.f32(), p.dst_stride[0] = per_image * in, p.dst_stride[1] = in;
    ops::strided_copy(p, options_.device);
    features = kept;
  }
  nn::GemmOperand first_in = projector_.first.input(features);
  Tensor y = projector_.first.forward(first_in);
  if (projector_.first_bias.defined()) projector_.first_bias.forward(y);
  if (acts) acts->proj_in = std::move(first_in);
  if (!projector_.second.out_features()) return y;
  Tensor act = Tensor::empty(y.shape(), DType::f32, options_.device);
  ops::GeluParams g;
  g.n = y.numel(), g.kind = config_.projector_hidden_act, g.x = y.f32(), g.out = act.f32();
  ops::gelu_forward(g, options_.device);
  nn::GemmOperand second_in = projector_.second.input(act);
  Tensor out = projector_.second.forward(second_in);
  if (projector_.second_bias.defined()) projector_.second_bias.forward(out);
  if (acts) acts->act_in = std::move(second_in), acts->proj_hidden = y;
  return out;
}

void LlavaModel::vision_backward(const Tensor& dfeatures, Activations& acts) {
  const VisionConfig& v = config_.vision;
  const Device device = options_.device;
  // A frozen part takes no weight gradient; a frozen encoder needs no gradient of the projector's input.
  const bool encoder_trains = !is_frozen("vision"), projector_trains = !is_frozen("projector");
  if (!encoder_trains && !projector_trains) {
    acts.encoder = {}, acts.proj_in = {}, acts.act_in = {}, acts.proj_hidden = Tensor();
    return;
  }
  Tensor d = dfeatures;
  if (projector_.second.out_features()) {
    nn::GemmOperand d_second = projector_.second.grad_output(d);
    const Tensor db = projector_.second_bias.defined() ? projector_.second_bias.backward_input(d) : Tensor();
    Tensor dact = projector_.second.backward_input(d_second);
    ops::GeluParams g;
    g.n = dact.numel(), g.kind = config_.projector_hidden_act, g.x = acts.proj_hidden.f32();
    g.dy = dact.f32(), g.dx = dact.f32();
    ops::gelu_backward(g, device);
    projector_.second.backward_weight(d_second, acts.act_in);
    if (db.defined()) projector_.second_bias.backward_weight(db);
    acts.act_in = nn::GemmOperand{}, acts.proj_hidden = Tensor();
    d = dact;
  }
  nn::GemmOperand d_first = projector_.first.grad_output(d);
  if (projector_.first_bias.defined())
    projector_.first_bias.backward_weight(projector_.first_bias.backward_input(d));
  projector_.first.backward_weight(d_first, acts.proj_in);
  acts.proj_in = nn::GemmOperand{};
  if (!encoder_trains) {
    acts.encoder = {};
    return;
  }
  Tensor dselected = projector_.first.backward_input(d_first);
  const int64_t images = acts.images, positions = v.num_positions(), per_image = config_.tokens_per_image();
  const int64_t in = config_.projector_input();
  Tensor dall = dselected;
  if (per_image != positions) {  // the class token's row took no part: its gradient is zero
    dall = Tensor::zeros({images * positions, in}, DType::f32, device);
    ops::StridedCopyParams p;
    p.shape[0] = images, p.shape[1] = per_image, p.shape[2] = in;
    p.src = dselected.f32(), p.src_stride[0] = per_image * in, p.src_stride[1] = in;
    p.dst = dall.f32() + (positions - per_image) * in, p.dst_stride[0] = positions * in, p.dst_stride[1] = in;
    ops::strided_copy(p, device);
  }
  encoder_.backward(dall, acts.encoder);
}

StageOutput LlavaModel::forward(const MicroBatch& mb, const Tensor& hidden,
                                std::unique_ptr<StageActivations>* saved) {
  check_images(mb);
  auto acts = std::make_unique<Activations>();
  std::unique_ptr<StageActivations>* language_saved = saved ? &acts->language : nullptr;
  StageOutput out;
  if (!stage().pre_process) {  // the images went through the first stage
    MicroBatch text = mb;
    text.pixels = nullptr, text.images = 0;
    out = language_->forward(text, hidden, language_saved);
  } else {
    MicroBatch text = mb;
    text.pixels = nullptr, text.images = 0;
    Tensor features;
    if (mb.images > 0) features = vision_forward(mb, saved ? acts.get() : nullptr);
    acts->has_images = mb.images > 0, acts->images = mb.images;
    out = language_->forward_inserted(text, static_cast<int32_t>(config_.image_token_index), features,
                                      language_saved);
  }
  if (saved) *saved = std::move(acts);
  return out;
}

// The image features' gradient after the language model's B; under sequence parallelism each rank saw that of
// its own rows only, summed here over the group.
Tensor LlavaModel::inserted_gradient(Activations& acts) {
  Tensor d = language_->inserted_gradient(*acts.language);
  if (nn::TensorParallel* tp = split_group(options_); tp && tp->sequence_parallel())
    tp->all_reduce_sum(d.f32(), d.numel(), options_.device);
  return d;
}

Tensor LlavaModel::backward_input(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  Tensor dx = language_->backward_input(doutput, *acts.language);
  if (acts.has_images) {
    acts.dinserted = inserted_gradient(acts);
  }
  return dx;
}

void LlavaModel::backward_weight(StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  language_->backward_weight(*acts.language);
  if (acts.has_images)
    vision_backward(acts.dinserted, acts), acts.dinserted = Tensor(), acts.has_images = false;
}

Tensor LlavaModel::backward(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  Tensor dx = language_->backward(doutput, *acts.language);
  if (acts.has_images) {
    vision_backward(inserted_gradient(acts), acts);
    acts.has_images = false;
  }
  return dx;
}

Tensor LlavaModel::logits(const int32_t* ids, int64_t batch, int64_t seq) {
  return language_->logits(ids, batch, seq);
}

Tensor LlavaModel::logits(const MicroBatch& mb) {
  check_images(mb);
  Tensor features;
  if (mb.images > 0) features = vision_forward(mb, nullptr);
  return language_->logits_inserted(mb.ids, mb.batch, mb.seq, static_cast<int32_t>(config_.image_token_index),
                                    features);
}

Tensor LlavaModel::image_features(const float* pixels, int64_t images) {
  MicroBatch mb;
  mb.pixels = pixels, mb.images = images;
  check_images(mb);
  return vision_forward(mb, nullptr).to(Device::cpu);
}

nn::KvCache LlavaModel::make_cache(int64_t batch, int64_t capacity) const {
  return language_->make_cache(batch, capacity);
}

Tensor LlavaModel::forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                                  bool all_logits) {
  return language_->forward_cached(ids, batch, new_tokens, cache, all_logits);
}

Tensor LlavaModel::forward_cached_images(const int32_t* ids, int64_t batch, int64_t new_tokens,
                                         nn::KvCache& cache, const float* pixels, int64_t images) {
  MicroBatch mb;
  mb.pixels = pixels, mb.images = images;
  check_images(mb);
  Tensor features;
  if (images > 0) features = vision_forward(mb, nullptr);
  return language_->forward_cached_inserted(ids, batch, new_tokens, cache,
                                            static_cast<int32_t>(config_.image_token_index), features);
}

ModelFamily llava_family() {
  return family_entry<LlavaConfig, LlavaModel>("LlavaForConditionalGeneration", "llava");
}

}  // namespace forge::models
