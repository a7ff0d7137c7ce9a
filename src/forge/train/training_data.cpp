#include "forge/train/training_data.h"

#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include "forge/core/error.h"
#include "forge/data/text/blended_dataset.h"
#include "forge/data/text/byte_sampler.h"
#include "forge/data/text/text_corpus.h"
#include "forge/data/tokenizer/bpe_trainer.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::data;
namespace fs = std::filesystem;

TextCodec TextCodec::bytes() {
  TextCodec codec;
  codec.description_ = "bytes (vocabulary 256)";
  codec.fingerprint_ = "bytes";
  codec.byte_lengths_.assign(kByteVocabSize, 1);
  return codec;
}

TextCodec TextCodec::from_tokenizer(Tokenizer tokenizer, std::string description) {
  TextCodec codec;
  codec.tokenizer_ = std::make_shared<const Tokenizer>(std::move(tokenizer));
  codec.description_ = std::move(description);
  // The document's canonical text (sorted keys, no spaces): the same tokenizer in any formatting.
  const std::string canonical = codec.tokenizer_->to_json().dump();
  const uLong crc = crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(canonical.data()),
                          static_cast<uInt>(canonical.size()));
  codec.fingerprint_ = fmt::format("tokenizer.json crc32:{:08x} ({} bytes)", crc, canonical.size());
  codec.byte_lengths_.resize(codec.tokenizer_->vocab_size());
  for (int64_t id = 0; id < codec.tokenizer_->vocab_size(); ++id)
    codec.byte_lengths_[id] = codec.tokenizer_->token_byte_length(static_cast<int32_t>(id));
  return codec;
}

std::vector<int32_t> TextCodec::encode(std::string_view text) const {
  if (tokenizer_) return tokenizer_->encode(text);
  return {reinterpret_cast<const uint8_t*>(text.data()),
          reinterpret_cast<const uint8_t*>(text.data()) + text.size()};
}

std::string TextCodec::decode(std::span<const int32_t> ids) const {
  if (tokenizer_) return tokenizer_->decode(ids);
  std::string text;
  text.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= kByteVocabSize) fail("byte-level decode: token {} is not a byte", id);
    text.push_back(static_cast<char>(id));
  }
  return text;
}

int64_t TextCodec::vocab_size() const { return static_cast<int64_t>(byte_lengths_.size()); }

int64_t TextCodec::byte_length(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    fail("token {} is outside the vocabulary of {} ({})", id, vocab_size(), description_);
  return byte_lengths_[id];
}

std::optional<int32_t> TextCodec::eos_id() const { return tokenizer_ ? tokenizer_->eos_id() : std::nullopt; }

fs::path trained_tokenizer_path(const TrainConfig& config, std::string_view text) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t done = 0; done < text.size();) {
    const size_t n = std::min<size_t>(text.size() - done, 1u << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(text.data() + done), static_cast<uInt>(n));
    done += n;
  }
  const std::string corpus = fs::path(config.data.corpus).stem().string();  // "kjv" for the built-in one
  // "bpe1": the version of what train_bpe produces; bump it when the trainer's output changes, so stale
  // cached tokenizers are not reused.
  return fs::path(config.data.cache_dir) /
         fmt::format("bpe1-{}-v{}-{:08x}.json", corpus, config.data.vocab_size, static_cast<uint32_t>(crc));
}

TextCodec make_text_codec(const TrainConfig& config, std::string_view training_text) {
  const std::string& choice = config.data.tokenizer;
  if (config.tokenizer_source() == TokenizerSource::bytes) return TextCodec::bytes();
  if (config.tokenizer_source() == TokenizerSource::file) {
    Tokenizer tokenizer = Tokenizer::from_file(choice);
    const int64_t vocab = tokenizer.vocab_size();
    return TextCodec::from_tokenizer(std::move(tokenizer), fmt::format("{} (vocabulary {})", choice, vocab));
  }
  const fs::path cached = trained_tokenizer_path(config, training_text);
  if (fs::exists(cached)) {
    Tokenizer tokenizer = Tokenizer::from_file(cached);
    return TextCodec::from_tokenizer(
        std::move(tokenizer),
        fmt::format("byte-level BPE, vocabulary {} ({})", config.data.vocab_size, cached.string()));
  }
  const auto start = std::chrono::steady_clock::now();
  BpeTrainerOptions options;
  options.vocab_size = config.data.vocab_size;
  options.special_tokens = {"<|endoftext|>"};
  Tokenizer tokenizer = train_bpe(training_text, options);
  fs::create_directories(cached.parent_path());
  tokenizer.save(cached);
  std::printf("trained a byte-level BPE tokenizer of %lld tokens on %.1f MB in %.1f s -> %s\n",
              static_cast<long long>(config.data.vocab_size), static_cast<double>(training_text.size()) / 1e6,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              cached.c_str());
  return TextCodec::from_tokenizer(
      std::move(tokenizer),
      fmt::format("byte-level BPE, vocabulary {} ({})", config.data.vocab_size, cached.string()));
}

CorpusTokens prepare_corpus(const TrainConfig& config) {
  std::string text = load_corpus(config.data.corpus, config.data.cache_dir);
  TextSplit split = split_heldout(text, config.data.heldout_fraction, config.data.heldout_parts);
  CorpusTokens out;
  out.codec = make_text_codec(config, split.train);
  out.train = out.codec.encode(split.train);
  out.heldout = out.codec.encode(split.heldout);
  out.train_bytes = static_cast<int64_t>(split.train.size());
  out.heldout_bytes = static_cast<int64_t>(split.heldout.size());
  return out;
}

namespace {

class CorpusData final : public TrainingData {
 public:
  CorpusData(CorpusTokens corpus, const TrainConfig& config)
      : TrainingData(std::move(corpus.codec)), corpus_(std::move(corpus)), config_(config) {
    const int64_t seq = config.data.seq_len;
    if (static_cast<int64_t>(corpus_.train.size()) <= seq + 1)
      fail("corpus '{}': its training split ({} tokens) is shorter than one sequence of {}",
           config.data.corpus, corpus_.train.size(), seq + 1);
    windows_ = num_sequential_windows(static_cast<int64_t>(corpus_.heldout.size()), seq);
    if (windows_ == 0)
      fail(
          "corpus '{}': its held-out split ({} tokens) is shorter than one sequence of {}; raise "
          "data.heldout_fraction",
          config.data.corpus, corpus_.heldout.size(), seq + 1);
  }
  void train_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    sample_batch(corpus_.train.data(), static_cast<int64_t>(corpus_.train.size()), config_.model.seed, first,
                 batch, config_.data.seq_len, ids, targets);
  }
  int64_t heldout_windows() const override { return windows_; }
  void heldout_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    sequential_batch(corpus_.heldout.data(), static_cast<int64_t>(corpus_.heldout.size()), first, batch,
                     config_.data.seq_len, ids, targets);
  }
  std::string describe() const override {
    return fmt::format(
        "corpus {}: {} training bytes -> {} tokens ({:.2f} bytes/token), {} held-out bytes -> {} tokens | "
        "tokenizer {}",
        config_.data.corpus, corpus_.train_bytes, corpus_.train.size(),
        static_cast<double>(corpus_.train_bytes) / static_cast<double>(corpus_.train.size()),
        corpus_.heldout_bytes, corpus_.heldout.size(), codec_.description());
  }

 private:
  CorpusTokens corpus_;
  TrainConfig config_;
  int64_t windows_ = 0;
};

class DatasetData final : public TrainingData {
 public:
  DatasetData(TextCodec codec, const TrainConfig& config) : TrainingData(std::move(codec)), config_(config) {
    // Every token read must be one of the tokenizer's (the dataset was preprocessed with it; the model's
    // vocabulary holds at least as many, which the trainer checks): an id beyond it names the file.
    const std::string vocab_name = fmt::format("the vocabulary of the tokenizer {}", codec_.description());
    GptDatasetConfig train_config{.seq_len = config.data.seq_len,
                                  .seed = config.model.seed,
                                  .shuffle = config.data.order == DataOrder::shuffle,
                                  .vocab_size = codec_.vocab_size(),
                                  .vocab_name = vocab_name};
    train_ = open_blended_gpt_dataset(config.data.dataset, config.data.split, DataSplit::train, train_config);
    GptDatasetConfig valid_config = train_config;
    valid_config.shuffle = false;
    valid_ = open_blended_gpt_dataset(config.data.dataset, config.data.split, DataSplit::valid, valid_config);
    // Held out: as many consecutive windows as the valid parts hold together, blended by weight.
    for (size_t k = 0; k < valid_->num_datasets(); ++k) windows_ += valid_->dataset(k).samples_per_epoch();
  }
  void train_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    train_->batch(first, batch, ids, targets);
  }
  int64_t heldout_windows() const override { return windows_; }
  void heldout_batch(int64_t first, int64_t batch, int32_t* ids, int32_t* targets) const override {
    valid_->batch(first, batch, ids, targets);
  }
  std::string describe() const override {
    int64_t train_tokens = 0, valid_tokens = 0;
    for (size_t k = 0; k < train_->num_datasets(); ++k) train_tokens += train_->dataset(k).tokens_per_epoch();
    for (size_t k = 0; k < valid_->num_datasets(); ++k) valid_tokens += valid_->dataset(k).tokens_per_epoch();
    return fmt::format(
        "dataset \"{}\" (split {}): {} training tokens, {} held-out tokens in {} windows | tokenizer {}",
        config_.data.dataset, config_.data.split, train_tokens, valid_tokens, windows_, codec_.description());
  }

 private:
  TrainConfig config_;
  std::unique_ptr<BlendedDataset> train_, valid_;
  int64_t windows_ = 0;
};

}  // namespace

int64_t heldout_tail(int64_t count, double heldout_fraction) {
  return std::min<int64_t>(
      count - 1, std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(count) * heldout_fraction)));
}

int64_t EpochOrder::operator()(int64_t index) const {
  const int64_t epoch = index / count_;
  if (epoch != epoch_ || order_.empty()) {
    order_.resize(static_cast<size_t>(count_));
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch));
    for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng() % i]);
    epoch_ = epoch;
  }
  return order_[static_cast<size_t>(index % count_)];
}

std::vector<int64_t> documents_at_eos(const int32_t* ids, int64_t batch, int64_t seq, int32_t eos) {
  std::vector<int64_t> lengths;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < seq; ++t)
      if (ids[b * seq + t] == eos || t + 1 == seq) lengths.push_back(t + 1 - start), start = t + 1;
  }
  return lengths;
}

std::unique_ptr<TrainingData> open_training_data(const TrainConfig& config,
                                                 const models::ModelConfig* model) {
  if (!config.data.sft.empty()) return open_sft_data(config);
  if (!config.data.images.empty()) {
    if (model) return open_image_text_data(config, *model);
    return open_image_text_data(config, *models::read_model_config(config.model.config));
  }
  if (config.data.dataset.empty()) return std::make_unique<CorpusData>(prepare_corpus(config), config);
  if (config.tokenizer_source() == TokenizerSource::train)
    fail(
        "data.dataset is set: data.tokenizer must name the tokenizer.json the dataset was preprocessed with "
        "(or \"bytes\"), not \"train\"");
  return std::make_unique<DatasetData>(make_text_codec(config, {}), config);
}

}  // namespace forge::train
