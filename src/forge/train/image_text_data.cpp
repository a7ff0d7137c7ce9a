// The trainer's image-text data: data::ImageTextDataset (a JSONL or a packed file) behind TrainingData.
#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <random>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/data/image/image_text.h"
#include "forge/models/model.h"
#include "forge/train/training_data.h"

namespace forge::train {
namespace {

namespace fs = std::filesystem;

class ImageTextData final : public TrainingData {
 public:
  ImageTextData(TextCodec codec, const TrainConfig& config, const models::ImageInput& model)
      : TrainingData(std::move(codec)), config_(config), seed_(config.model.seed) {
    const std::string& images = config.data.images;
    if (!fs::exists(images)) fail("data.images: '{}' does not exist", images);
    const fs::path processor_path = config.data.image_processor.empty()
                                        ? fs::path(images).parent_path() / "preprocessor_config.json"
                                        : fs::path(config.data.image_processor);
    if (!fs::exists(processor_path))
      fail("data.image_processor: '{}' does not exist (the preprocessor_config.json of the images)",
           processor_path.string());
    processor_ =
        std::make_unique<data::ImageProcessor>(data::ImageProcessorConfig::from_json_file(processor_path));
    processor_json_ = read_file(processor_path, "image processor config");
    if (processor_json_.empty() || processor_json_.back() != '\n') processor_json_ += '\n';
    encoder_ = codec_.tokenizer() ? data::TextEncoder::from_tokenizer(*codec_.tokenizer())
                                  : data::TextEncoder::bytes();
    data::ImageTextOptions options;
    options.seq_len = config.data.seq_len;
    options.image_token_id = model.image_token;
    options.tokens_per_image = model.tokens_per_image;
    options.skip_bad = options.skip_too_long = config.data.skip_bad_samples;
    train_ = open(images, options);
    const auto [channels, height, width] = train_->image_shape();
    if (channels != model.channels || height != model.height || width != model.width)
      fail("{}: the image processor makes {}x{}x{} images but {} takes {}x{}x{}", processor_path.string(),
           channels, height, width, config.model.config, model.channels, model.height, model.width);
    if (!config.data.heldout_images.empty()) {
      heldout_ = open(config.data.heldout_images, options);
      train_samples_ = train_->num_samples();
      heldout_first_ = 0, heldout_samples_ = heldout_->num_samples();
    } else {  // the tail of the training file, as the corpus' held-out tail
      const int64_t n = train_->num_samples();
      heldout_samples_ = heldout_tail(n, config.data.heldout_fraction);
      train_samples_ = n - heldout_samples_;
      heldout_first_ = train_samples_;
    }
    if (train_samples_ < 1 || heldout_samples_ < 1)
      fail("data.images: '{}' holds {} samples: too few to train on and hold some out", images,
           train_->num_samples());
    order_ = EpochOrder(seed_, train_samples_);
  }

  bool has_images() const override { return true; }
  std::string image_processor_json() const override { return processor_json_; }
  void train_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    std::vector<float> pixels;
    train_batch_images(first, batch, ids, targets, pixels);
  }
  int64_t heldout_windows() const override { return heldout_samples_; }
  void heldout_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    std::vector<float> pixels;
    heldout_batch_images(first, batch, ids, targets, pixels);
  }
  int64_t train_batch_images(int64_t first, int64_t batch, int32_t* ids, int32_t* targets,
                             std::vector<float>& pixels) const override {
    std::vector<int64_t> indices(static_cast<size_t>(batch));
    for (int64_t i = 0; i < batch; ++i) indices[static_cast<size_t>(i)] = order_(first + i);
    return fill(*train_, indices, ids, targets, pixels);
  }
  int64_t heldout_batch_images(int64_t first, int64_t batch, int32_t* ids, int32_t* targets,
                               std::vector<float>& pixels) const override {
    std::vector<int64_t> indices(static_cast<size_t>(batch));
    for (int64_t i = 0; i < batch; ++i)
      indices[static_cast<size_t>(i)] = heldout_first_ + (first + i) % heldout_samples_;
    return fill(heldout_ ? *heldout_ : *train_, indices, ids, targets, pixels);
  }
  std::string describe() const override {
    const auto [c, h, w] = train_->image_shape();
    return fmt::format(
        "image-text {} ({}): {} training samples, {} held out, {} images of {}x{}x{}, {} tokens per image | "
        "tokenizer {}{}",
        config_.data.images, train_->packed() ? "packed" : "JSONL", train_samples_, heldout_samples_,
        train_->num_images(), c, h, w, train_->tokens_per_image(), codec_.description(),
        train_->skipped_bad() + train_->skipped_too_long() > 0
            ? fmt::format(" | skipped {} bad and {} too long", train_->skipped_bad(),
                          train_->skipped_too_long())
            : std::string());
  }

 private:
  std::unique_ptr<data::ImageTextDataset> open(const fs::path& path,
                                               const data::ImageTextOptions& options) const {
    if (data::is_packed_image_text(path)) {
      data::PackedImageTextExpectation expect;
      expect.seq_len = options.seq_len, expect.image_token_id = options.image_token_id;
      expect.tokens_per_image = options.tokens_per_image, expect.text_fingerprint = encoder_.fingerprint;
      return std::make_unique<data::ImageTextDataset>(
          data::ImageTextDataset::from_packed(path, *processor_, expect));
    }
    return std::make_unique<data::ImageTextDataset>(
        data::ImageTextDataset::from_jsonl(path, encoder_, *processor_, options));
  }
  // Sample `index` of the training stream: epoch index / n takes the samples in a permutation drawn from
  static int64_t fill(const data::ImageTextDataset& set, const std::vector<int64_t>& indices, int32_t* ids,
                      int32_t* targets, std::vector<float>& pixels) {
    const int64_t images = set.count_images(indices);
    const auto [c, h, w] = set.image_shape();
    pixels.resize(static_cast<size_t>(images * c * h * w));
    return set.fill_batch(indices, ids, targets, pixels.data(), images);
  }

  TrainConfig config_;
  uint64_t seed_ = 0;
  std::unique_ptr<data::ImageProcessor> processor_;
  data::TextEncoder encoder_;
  std::unique_ptr<data::ImageTextDataset> train_, heldout_;
  std::string processor_json_;
  int64_t train_samples_ = 0, heldout_first_ = 0, heldout_samples_ = 0;
  EpochOrder order_;  // the training stream's samples, a permutation per epoch
};

}  // namespace

std::unique_ptr<TrainingData> open_image_text_data(const TrainConfig& config,
                                                   const models::ModelConfig& model) {
  const std::optional<models::ImageInput> images = model.image_input();
  if (!images)
    fail("data.images: image-text data trains a multimodal model (LlavaForConditionalGeneration), not {}",
         model.architecture());
  if (config.tokenizer_source() == TokenizerSource::train)
    fail(
        "data.images: data.tokenizer must be \"bytes\" or a tokenizer.json (no tokenizer is trained on "
        "image-text data)");
  return std::make_unique<ImageTextData>(make_text_codec(config, {}), config, *images);
}

}  // namespace forge::train
