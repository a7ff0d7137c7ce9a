// Golden tests against the PyTorch twin (tests/reference/llava_twin.py): a CLIP and a SigLIP LLaVA, the image
// features after the projector, the logits with the features spliced in, the loss and every parameter's
// gradient, within fp32 tolerances stated below.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>

#include "forge/ckpt/safetensors.h"
#include "forge/models/llava/llava_model.h"
#include "forge/models/pretrained.h"
#include "op_harness.h"
#include "test_files.h"

namespace forge::llava_golden_test {
using namespace forge::models;
using namespace forge::ckpt;
namespace {

using testing::fixture;

// Largest |got - want| over want's largest magnitude.
using testing::rel_error;

class LlavaGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    file_ = std::make_unique<SafetensorsFile>(SafetensorsFile::open(fixture(GetParam() + ".safetensors")));
    config_ = LlavaConfig::from_json_file(fixture(GetParam() + ".config.json"));
    ids_ = file_->read("input_ids"), labels_ = file_->read("labels");
    const Tensor pixel_values = file_->read("pixel_values");  // [images, channels, size, size]
    images_ = pixel_values.dim(0);
    pixels_.assign(pixel_values.f32(), pixel_values.f32() + pixel_values.numel());
  }
  std::unique_ptr<LlavaModel> load_model(DType dtype = DType::f32) {
    auto model = std::make_unique<LlavaModel>(config_, nn::ComputeOptions{dtype, nn::Recompute::none});
    auto& params = model->params();
    for (int i = 0; i < params.count(); ++i) file_->read_into(params.info(i).name, params.param(i));
    params.refresh_bf16();
    return model;
  }
  models::MicroBatch batch() const {
    models::MicroBatch mb;
    mb.ids = ids_.i32(), mb.targets = labels_.i32(), mb.batch = ids_.dim(0), mb.seq = ids_.dim(1);
    int64_t valid = 0;
    for (int64_t i = 0; i < labels_.numel(); ++i) valid += labels_.i32()[i] >= 0;
    mb.grad_scale = 1.0f / static_cast<float>(valid);
    mb.pixels = pixels_.data(), mb.images = images_;
    return mb;
  }
  // The parameters the twin's loss does not reach (the encoder's layers past the feature layer).
  std::set<std::string> unreached() const {
    std::set<std::string> out;
    std::stringstream list(file_->metadata().at("no_gradient"));
    for (std::string name; std::getline(list, name, ',');)
      if (!name.empty()) out.insert(name);
    return out;
  }

  std::unique_ptr<SafetensorsFile> file_;
  LlavaConfig config_;
  Tensor ids_, labels_;
  int64_t images_ = 0;
  std::vector<float> pixels_;
};

TEST_P(LlavaGolden, ImageFeaturesAndLogits) {
  auto model = load_model();
  // fp32 end to end; differences come from summation order only.
  EXPECT_LT(rel_error(model->image_features(pixels_.data(), images_), file_->read("image_features")), 1e-5);
  EXPECT_LT(rel_error(model->logits(batch()), file_->read("logits")), 1e-5);
}

TEST_P(LlavaGolden, LossAndEveryGradient) {
  auto model = load_model();
  const models::MicroBatch mb = batch();
  model->params().zero_grads();
  std::unique_ptr<models::StageActivations> saved;
  const models::StageOutput out = model->forward(mb, Tensor(), &saved);
  model->backward(Tensor(), *saved);
  EXPECT_NEAR(out.loss.mean(), file_->read("loss").f32()[0], 1e-5);
  const std::set<std::string> none = unreached();
  auto& params = model->params();
  int compared = 0;
  for (int i = 0; i < params.count(); ++i) {
    const std::string& name = params.info(i).name;
    if (none.count(name)) {  // read by no feature: frozen, without a gradient
      EXPECT_FALSE(params.trainable(i)) << name;
      continue;
    }
    EXPECT_TRUE(params.trainable(i)) << name;
    const Tensor grad = params.grad(i).to(Device::cpu);
    const Tensor want = file_->read("grad." + name);
    if (name.find("k_proj.bias") != std::string::npos && name.find("vision_tower") == 0) {
      // A key bias adds q.b to every score of a query alike, which softmax ignores: its gradient is zero, and
      // both sides hold rounding noise of the other gradients' 1e-7.
      for (const Tensor* g : {&grad, &want})
        for (int64_t j = 0; j < g->numel(); ++j) EXPECT_LT(std::abs(g->f32()[j]), 1e-6f) << name;
    } else {
      // 1e-4 relative per tensor (gradients pass through more reductions than the logits).
      EXPECT_LT(rel_error(grad, want), 1e-4) << name;
    }
    ++compared;
  }
  EXPECT_EQ(compared + static_cast<int>(none.size()), params.count());
}

// B then W (what the zero-bubble schedules run) gives bitwise the gradients of the fused backward.
TEST_P(LlavaGolden, SplitBackwardEqualsFusedBitwise) {
  auto fused = load_model(), split = load_model();
  const models::MicroBatch mb = batch();
  std::unique_ptr<models::StageActivations> a, b;
  fused->params().zero_grads(), split->params().zero_grads();
  fused->forward(mb, Tensor(), &a);
  fused->backward(Tensor(), *a);
  split->forward(mb, Tensor(), &b);
  EXPECT_FALSE(split->backward_input(Tensor(), *b).defined());
  split->backward_weight(*b);
  const Tensor g1 = fused->params().grads(), g2 = split->params().grads();
  ASSERT_EQ(g1.numel(), g2.numel());
  EXPECT_EQ(std::memcmp(g1.f32(), g2.f32(), static_cast<size_t>(g1.numel()) * sizeof(float)), 0);
}

// bf16 GEMM operands stay close to the fp32 twin (scale-free similarity).
TEST_P(LlavaGolden, Bf16ComputeStaysCloseToFp32Twin) {
  auto model = load_model(DType::bf16);
  const Tensor logits = model->logits(batch()), want = file_->read("logits");
  std::vector<double> ref(want.f32(), want.f32() + want.numel());
  EXPECT_LT(testing::dissimilarity(logits.f32(), ref.data(), ref.size()), 1e-4);
}

TEST_P(LlavaGolden, ImageTokensMustMatchTheImages) {
  auto model = load_model();
  models::MicroBatch mb = batch();
  mb.images = images_ - 1;  // one image's tokens without its features
  std::unique_ptr<models::StageActivations> saved;
  try {
    model->forward(mb, Tensor(), &saved);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("image tokens"), std::string::npos) << e.what();
  }
  mb = batch();
  mb.pixels = nullptr;
  EXPECT_THROW(model->forward(mb, Tensor(), &saved), Error);
}

// Training stages by freezing parts (train.freeze): a frozen part has no gradient buffer and takes none; what
// trains gets bitwise the gradients of the unfrozen model.
TEST_P(LlavaGolden, FrozenPartsTakeNoGradientAndTheRestAreUnchanged) {
  auto full = load_model();
  const models::MicroBatch mb = batch();
  std::unique_ptr<models::StageActivations> saved;
  full->params().zero_grads();
  full->forward(mb, Tensor(), &saved);
  full->backward(Tensor(), *saved);
  const ParameterStore& all = full->params();
  for (const std::vector<std::string>& frozen :
       {std::vector<std::string>{"vision"}, {"vision", "language"}, {"projector"}, {"language"}}) {
    nn::ComputeOptions options{DType::f32, nn::Recompute::none};
    options.frozen = frozen;
    LlavaModel model(config_, options);
    auto& params = model.params();
    for (int i = 0; i < params.count(); ++i) file_->read_into(params.info(i).name, params.param(i));
    params.refresh_bf16();
    params.zero_grads();
    std::unique_ptr<models::StageActivations> s;
    const models::StageOutput out = model.forward(mb, Tensor(), &s);
    EXPECT_NEAR(out.loss.mean(), file_->read("loss").f32()[0], 1e-5);
    // B then W, as the zero-bubble schedules run it.
    model.backward_input(Tensor(), *s);
    model.backward_weight(*s);
    int64_t trained = 0;
    for (int i = 0; i < params.count(); ++i) {
      const std::string& name = params.info(i).name;
      const std::string part = name.starts_with("vision_tower.")            ? "vision"
                               : name.starts_with("multi_modal_projector.") ? "projector"
                                                                            : "language";
      const bool frozen_part = std::find(frozen.begin(), frozen.end(), part) != frozen.end();
      const int whole_id = all.find(name);
      if (frozen_part || !all.trainable(whole_id)) {
        EXPECT_FALSE(params.trainable(i)) << name;
        EXPECT_THROW(params.grad(i), Error) << name;
        continue;
      }
      ASSERT_TRUE(params.trainable(i)) << name;
      trained += params.grad(i).numel();
      const Tensor got = params.grad(i), want = all.grad(whole_id);
      EXPECT_EQ(std::memcmp(got.f32(), want.f32(), static_cast<size_t>(got.numel()) * sizeof(float)), 0)
          << name << " with " << frozen.size() << " part(s) frozen";
    }
    EXPECT_EQ(params.trained_numel(), trained);
    EXPECT_EQ(params.grads().numel(), trained);  // no gradient memory for what is frozen
  }
  nn::ComputeOptions every{DType::f32, nn::Recompute::none};
  every.frozen = {"vision", "projector", "language"};
  EXPECT_THROW(LlavaModel(config_, every), Error);
  every.frozen = {"encoder"};
  EXPECT_THROW(LlavaModel(config_, every), Error);
}

// Hugging Face folders in and out: forge -> HF (fp32) -> forge is bitwise, frozen parameters included, and
// the loaded model (built from the exported config.json by the registry) computes the same logits.
TEST_P(LlavaGolden, HuggingFaceRoundTripIsBitwise) {
  auto model = load_model();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("forge_llava_" + GetParam() + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  export_hugging_face(model->params(), model->config().to_json(), dir / "hf", {});
  auto loaded = load_pretrained_model(dir / "hf", nn::ComputeOptions{DType::f32, nn::Recompute::none});
  ASSERT_EQ(loaded->config().architecture(), "LlavaForConditionalGeneration");
  const ParameterStore& a = model->params();
  const ParameterStore& b = loaded->params();
  ASSERT_EQ(a.count(), b.count());
  for (int i = 0; i < a.count(); ++i) {
    const int j = b.find(a.info(i).name);
    ASSERT_GE(j, 0) << a.info(i).name;
    EXPECT_EQ(std::memcmp(a.param(i).f32(), b.param(j).f32(), static_cast<size_t>(a.param(i).numel()) * 4), 0)
        << a.info(i).name;
  }
  auto* llava = dynamic_cast<LlavaModel*>(loaded.get());
  ASSERT_NE(llava, nullptr);
  const Tensor x = model->logits(batch()), y = llava->logits(batch());
  EXPECT_EQ(std::memcmp(x.f32(), y.f32(), static_cast<size_t>(x.numel()) * 4), 0);
  std::filesystem::remove_all(dir);
}

// Inference with an image (forge generate --image): the prompt's prefill through the KV cache with the
// features spliced gives the last position's logits of the full forward, and a decode step after it the
// logits of the next position.
TEST_P(LlavaGolden, CachedPrefillWithImagesMatchesTheFullForward) {
  auto model = load_model();
  const int64_t seq = ids_.dim(1), vocab = config_.text.vocab_size;
  const int32_t* first = ids_.i32();  // the first sequence holds the first image
  models::MicroBatch mb;
  mb.ids = first, mb.batch = 1, mb.seq = seq, mb.pixels = pixels_.data(), mb.images = 1;
  const Tensor full = model->logits(mb);  // [seq, vocab]
  nn::KvCache cache = model->make_cache(1, seq);
  const Tensor prefill = model->forward_cached_images(first, 1, seq - 1, cache, pixels_.data(), 1);
  const Tensor step = model->forward_cached(first + seq - 1, 1, 1, cache);
  for (int64_t v = 0; v < vocab; ++v) {
    EXPECT_NEAR(prefill.f32()[v], full.f32()[(seq - 2) * vocab + v], 1e-5) << v;
    EXPECT_NEAR(step.f32()[v], full.f32()[(seq - 1) * vocab + v], 1e-5) << v;
  }
  nn::KvCache again = model->make_cache(1, seq);
  EXPECT_THROW(model->forward_cached_images(first, 1, seq - 1, again, nullptr, 0),
               Error);  // tokens, no image
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlavaGolden, ::testing::Values("llava_clip_tiny", "llava_siglip_tiny"));

}  // namespace
}  // namespace forge::llava_golden_test
