// The trainer's view of its data: a text codec (byte-level, or a byte-level BPE tokenizer that forge
// trains on the corpus and caches, or a given tokenizer.json) and a source of training and held-out
// windows: either a text corpus split into training and held-out token arrays, or a blend of Megatron
// indexed datasets (data.dataset) whose train and valid document splits (data.split) give the two parts.
// Held-out results are reported in bits per byte of the original text, whatever the tokenizer, so runs
// with different tokenizers stay comparable.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "forge/data/tokenizer/tokenizer.h"
#include "forge/models/model.h"
#include "forge/train/config.h"

namespace forge::train {

class TextCodec {
 public:
  static TextCodec bytes();  // token = byte value, vocabulary 256
  static TextCodec from_tokenizer(data::Tokenizer tokenizer, std::string description);

  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(std::span<const int32_t> ids) const;
  int64_t vocab_size() const;
  // Bytes of text token `id` stands for (0 for special tokens).
  int64_t byte_length(int32_t id) const;
  std::optional<int32_t> eos_id() const;
  const std::string& description() const { return description_; }
  // What the codec maps, independent of where it was read from: "bytes", or the CRC32 and size of the
  // tokenizer's canonical JSON. Checkpoints record it; a resume compares it.
  const std::string& fingerprint() const { return fingerprint_; }
  const data::Tokenizer* tokenizer() const { return tokenizer_.get(); }

 private:
  std::shared_ptr<const data::Tokenizer> tokenizer_;  // null: bytes
  std::vector<int64_t> byte_lengths_;                 // per id, cached
  std::string description_;
  std::string fingerprint_;
};

// Where a trained tokenizer for `text` is cached: <cache_dir>/bpe1-<corpus>-v<vocab>-<crc32 of text>.json
// ("bpe1" versions the trainer's output).
std::filesystem::path trained_tokenizer_path(const TrainConfig& config, std::string_view text);

// data.tokenizer = "bytes" | "train" | path. "train" learns a byte-level BPE of data.vocab_size tokens on
// `training_text` (with the special token <|endoftext|>), or reads it from the cache; prints what it did.
TextCodec make_text_codec(const TrainConfig& config, std::string_view training_text);

struct CorpusTokens {
  TextCodec codec = TextCodec::bytes();
  std::vector<int32_t> train, heldout;
  int64_t train_bytes = 0, heldout_bytes = 0;
};

// Loads data.corpus, splits off the held-out tail (data.heldout_fraction), builds the codec from the
// training part only, and encodes both parts.
CorpusTokens prepare_corpus(const TrainConfig& config);

// Samples held out of a set of `count` when no held-out file is given: its last heldout_fraction, at least
// one and at most count - 1.
int64_t heldout_tail(int64_t count, double heldout_fraction);

// Sample `index` of a training stream over `count` samples: epoch index / count takes them in a permutation
// drawn from (seed, epoch). The current epoch's permutation is kept.
class EpochOrder {
 public:
  EpochOrder() = default;
  EpochOrder(uint64_t seed, int64_t count) : seed_(seed), count_(count) {}
  int64_t operator()(int64_t index) const;

 private:
  uint64_t seed_ = 0;
  int64_t count_ = 0;
  mutable std::vector<int64_t> order_;
  mutable int64_t epoch_ = -1;
};

// Windows of data.seq_len input ids and their next-token targets ([batch, seq_len] row-major each).
class TrainingData {
 public:
  virtual ~TrainingData() = default;
  const TextCodec& codec() const { return codec_; }
  // Training samples first_sample .. first_sample + batch - 1: deterministic in (model.seed, index).
  virtual void train_batch(int64_t first_sample, int64_t batch, int32_t* input_ids,
                           int32_t* targets) const = 0;
  // The held-out set: consecutive windows, each token after the first predicted once.
  virtual int64_t heldout_windows() const = 0;
  virtual void heldout_batch(int64_t first_window, int64_t batch, int32_t* input_ids,
                             int32_t* targets) const = 0;
  // One line for the run log.
  virtual std::string describe() const = 0;
  // Packed documents of training samples first_sample .. first_sample + batch - 1 (models::MicroBatch::
  // documents: lengths over the batch's rows in order), or empty when each sequence is one document.
  virtual void train_documents(int64_t first_sample, int64_t batch, std::vector<int64_t>& lengths) const {
    lengths.clear();
  }
  // True: a step's loss is the mean over its trained tokens (targets >= 0), as transformers averages
  // fine-tuning losses; false: over all its positions (pretraining, where every position is trained).
  virtual bool loss_per_trained_token() const { return false; }

  // Image-text data (data.images): train_batch / heldout_batch and the images of those samples, as normalised
  // pixels [images, channels, height, width] in order of appearance (`pixels` resized to fit); returns the
  // image count. Text data has none: these fill ids and targets and return 0.
  virtual bool has_images() const { return false; }
  // The image processor's preprocessor_config.json as read (image-text data; "" for text), which the
  // checkpoints carry beside the weights.
  virtual std::string image_processor_json() const { return ""; }
  virtual int64_t train_batch_images(int64_t first_sample, int64_t batch, int32_t* input_ids,
                                     int32_t* targets, std::vector<float>& pixels) const {
    train_batch(first_sample, batch, input_ids, targets);
    pixels.clear();
    return 0;
  }
  virtual int64_t heldout_batch_images(int64_t first_window, int64_t batch, int32_t* input_ids,
                                       int32_t* targets, std::vector<float>& pixels) const {
    heldout_batch(first_window, batch, input_ids, targets);
    pixels.clear();
    return 0;
  }

 protected:
  explicit TrainingData(TextCodec codec) : codec_(std::move(codec)) {}
  TextCodec codec_;
};

// data.images set: image-text data for a multimodal model (model: its config; null: read from
// model.config), see open_image_text_data. Else data.dataset empty: the corpus (prepare_corpus); else the
// blend, with data.tokenizer naming the tokenizer.json it was preprocessed with (or "bytes"). Throws
// forge::Error when a part holds less than one window of seq_len + 1 tokens.
std::unique_ptr<TrainingData> open_training_data(const TrainConfig& config,
                                                 const models::ModelConfig* model = nullptr);

// data.images (a JSONL of captions or conversations, or a packed file) and its held-out part
// (data.heldout_images, else the last data.heldout_fraction of its samples), tokenized with data.tokenizer
// ("bytes" or a tokenizer.json) and preprocessed with data.image_processor, for a
// LlavaForConditionalGeneration whose config gives the image token and the tokens per image. Training samples
// are drawn in a permutation of the set per epoch, from model.seed; held-out samples in order.
std::unique_ptr<TrainingData> open_image_text_data(const TrainConfig& config,
                                                   const models::ModelConfig& model);

// data.sft (a JSONL of conversations) and its held-out part (data.heldout_sft, else the last
// data.heldout_fraction of its conversations), rendered with data.chat_template (or the chat template beside
// data.tokenizer) and tokenized with data.tokenizer, a tokenizer.json: one conversation per sequence, the
// loss on the assistant's tokens (data.sft_loss). Training conversations are drawn in a permutation per
// epoch, from model.seed; held-out ones in order.
std::unique_ptr<TrainingData> open_sft_data(const TrainConfig& config);

// data.document_mask: each sequence of ids [batch, seq] cut after every `eos` token into documents (their
// lengths, in order; Megatron's reset_attention_mask and reset_position_ids).
std::vector<int64_t> documents_at_eos(const int32_t* ids, int64_t batch, int64_t seq, int32_t eos);

}  // namespace forge::train
