// The trainer's supervised fine-tuning data: data::SftDataset (conversations through the chat template)
// behind TrainingData.
#include "forge/data/text/sft_data.h"

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <random>

#include "forge/core/error.h"
#include "forge/models/pretrained.h"
#include "forge/train/training_data.h"

namespace forge::train {
namespace {

namespace fs = std::filesystem;

class SftData final : public TrainingData {
 public:
  SftData(TextCodec codec, const TrainConfig& config)
      : TrainingData(std::move(codec)), config_(config), seed_(config.model.seed) {
    const fs::path tokenizer_path = config.data.tokenizer;
    const fs::path template_path = config.data.chat_template.empty() ? tokenizer_path.parent_path()
                                                                     : fs::path(config.data.chat_template);
    chat_ = std::make_unique<data::ChatTemplate>(data::ChatTemplate::from_path(template_path));
    data::SftOptions options;
    options.seq_len = config.data.seq_len;
    options.loss_on_all = config.data.sft_loss == SftLoss::all;
    options.skip_bad = config.data.skip_bad_samples;
    const data::Tokenizer& tokenizer = *codec_.tokenizer();
    train_ = std::make_unique<data::SftDataset>(
        data::SftDataset::from_jsonl(config.data.sft, *chat_, tokenizer, options));
    if (!config.data.heldout_sft.empty()) {
      heldout_ = std::make_unique<data::SftDataset>(
          data::SftDataset::from_jsonl(config.data.heldout_sft, *chat_, tokenizer, options));
      train_samples_ = train_->size();
      heldout_first_ = 0, heldout_samples_ = heldout_->size();
    } else {  // the file's last conversations
      const int64_t n = train_->size();
      heldout_samples_ = heldout_tail(n, config.data.heldout_fraction);
      train_samples_ = n - heldout_samples_;
      heldout_first_ = train_samples_;
    }
    if (train_samples_ < 1 || heldout_samples_ < 1)
      fail("data.sft: '{}' holds {} usable conversations: too few to train on and hold some out",
           config.data.sft, train_->size());
    if (config.data.sft_pack) {  // the training conversations in an order from the seed, packed once
      conversations_ = train_samples_;
      std::vector<int64_t> order(static_cast<size_t>(train_samples_));
      std::iota(order.begin(), order.end(), int64_t{0});
      std::mt19937_64 rng(seed_ * 0x2545F4914F6CDD1Dull + 1);
      for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
      packs_ = train_->pack(order);
      train_samples_ = static_cast<int64_t>(packs_.size());
    }
    order_ = EpochOrder(seed_, train_samples_);
  }

  void train_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    const int64_t t = config_.data.seq_len;
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t sample = order_(first + i);
      if (packs_.empty())
        train_->fill(sample, ids + i * t, targets + i * t);
      else
        train_->fill_packed(packs_[static_cast<size_t>(sample)], ids + i * t, targets + i * t);
    }
  }
  void train_documents(int64_t first, int64_t batch, std::vector<int64_t>& lengths) const override {
    lengths.clear();
    if (packs_.empty()) return;
    for (int64_t i = 0; i < batch; ++i)
      train_->packed_documents(packs_[static_cast<size_t>(order_(first + i))], lengths);
  }
  int64_t heldout_windows() const override { return heldout_samples_; }
  bool loss_per_trained_token() const override { return true; }
  void heldout_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    const int64_t t = config_.data.seq_len;
    const data::SftDataset& set = heldout_ ? *heldout_ : *train_;
    for (int64_t i = 0; i < batch; ++i)
      set.fill(heldout_first_ + (first + i) % heldout_samples_, ids + i * t, targets + i * t);
  }
  std::string describe() const override {
    const int64_t skipped = train_->skipped_bad() + train_->skipped_untrained();
    return fmt::format(
        "SFT {}: {} training {}, {} held out | {} trained tokens ({}) | template {} | tokenizer {}{}{}",
        config_.data.sft, train_samples_,
        packs_.empty() ? "conversations" : fmt::format("sequences packing {} conversations", conversations_),
        heldout_samples_, train_->trained_tokens(),
        config_.data.sft_loss == SftLoss::all ? "every token" : "the assistant's", chat_->source(),
        codec_.description(),
        train_->truncated() > 0 ? fmt::format(" | {} cut to seq_len", train_->truncated()) : "",
        skipped > 0 ? fmt::format(" | skipped {} bad, {} with nothing to train", train_->skipped_bad(),
                                  train_->skipped_untrained())
                    : "");
  }

 private:
  TrainConfig config_;
  uint64_t seed_ = 0;
  std::unique_ptr<data::ChatTemplate> chat_;
  std::unique_ptr<data::SftDataset> train_, heldout_;
  int64_t train_samples_ = 0, heldout_first_ = 0, heldout_samples_ = 0;
  std::vector<std::vector<int64_t>> packs_;  // data.sft_pack: each training sequence's conversations
  int64_t conversations_ = 0;                // data.sft_pack: the training conversations packed
  EpochOrder order_;                         // the training stream's samples, a permutation per epoch
};

}  // namespace

std::unique_ptr<TrainingData> open_sft_data(const TrainConfig& given) {
  TrainConfig config = given;
  if (config.tokenizer_source() == TokenizerSource::train && !config.model.init_from.empty()) {
    // Fine-tuning a model: its own tokenizer, beside its weights.
    const fs::path dir = models::open_pretrained(config.model.init_from).dir;
    if (!fs::exists(dir / "tokenizer.json"))
      fail("data.sft: model.init_from {} has no tokenizer.json; set data.tokenizer to the model's",
           dir.string());
    config.data.tokenizer = (dir / "tokenizer.json").string();
  }
  if (config.tokenizer_source() != TokenizerSource::file)
    fail(
        "data.sft: data.tokenizer must name the model's tokenizer.json (conversations are tokenized with "
        "it), "
        "or model.init_from a model that has one");
  if (!config.data.images.empty() || !config.data.dataset.empty())
    fail("data.sft: set one of data.sft, data.images and data.dataset");
  return std::make_unique<SftData>(make_text_codec(config, {}), config);
}

}  // namespace forge::train
