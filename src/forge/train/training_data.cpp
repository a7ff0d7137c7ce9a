#include "forge/train/training_data.h"

#include <zlib.h>

#include <chrono>
#include <cstdio>

#include "forge/core/error.h"
#include "forge/data/bpe_trainer.h"
#include "forge/data/byte_sampler.h"
#include "forge/data/text_corpus.h"

namespace forge {
namespace fs = std::filesystem;

TextCodec TextCodec::bytes() {
  TextCodec codec;
  codec.description_ = "bytes (vocabulary 256)";
  codec.byte_lengths_.assign(kByteVocabSize, 1);
  return codec;
}

TextCodec TextCodec::from_tokenizer(Tokenizer tokenizer, std::string description) {
  TextCodec codec;
  codec.tokenizer_ = std::make_shared<const Tokenizer>(std::move(tokenizer));
  codec.description_ = std::move(description);
  codec.byte_lengths_.resize(codec.tokenizer_->vocab_size());
  for (int64_t id = 0; id < codec.tokenizer_->vocab_size(); ++id)
    codec.byte_lengths_[id] = codec.tokenizer_->token_byte_length(static_cast<int32_t>(id));
  return codec;
}

std::vector<int32_t> TextCodec::encode(std::string_view text) const {
  if (tokenizer_) return tokenizer_->encode(text);
  return {reinterpret_cast<const uint8_t*>(text.data()), reinterpret_cast<const uint8_t*>(text.data()) + text.size()};
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
  if (id < 0 || id >= vocab_size()) fail("token {} is outside the vocabulary of {} ({})", id, vocab_size(), description_);
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
  std::string corpus = config.data.corpus == "kjv" ? "kjv" : fs::path(config.data.corpus).stem().string();
  return fs::path(config.data.cache_dir) /
         fmt::format("bpe-{}-v{}-{:08x}.json", corpus, config.data.vocab_size, static_cast<uint32_t>(crc));
}

TextCodec make_text_codec(const TrainConfig& config, std::string_view training_text) {
  const std::string& choice = config.data.tokenizer;
  if (choice == "bytes") return TextCodec::bytes();
  if (choice != "train") {
    Tokenizer tokenizer = Tokenizer::from_file(choice);
    const int64_t vocab = tokenizer.vocab_size();
    return TextCodec::from_tokenizer(std::move(tokenizer), fmt::format("{} (vocabulary {})", choice, vocab));
  }
  const fs::path cached = trained_tokenizer_path(config, training_text);
  if (fs::exists(cached)) {
    Tokenizer tokenizer = Tokenizer::from_file(cached);
    return TextCodec::from_tokenizer(std::move(tokenizer),
                                     fmt::format("byte-level BPE, vocabulary {} ({})", config.data.vocab_size,
                                                 cached.string()));
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
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), cached.c_str());
  return TextCodec::from_tokenizer(
      std::move(tokenizer), fmt::format("byte-level BPE, vocabulary {} ({})", config.data.vocab_size, cached.string()));
}

CorpusTokens prepare_corpus(const TrainConfig& config) {
  std::string text = load_corpus(config.data.corpus, config.data.cache_dir);
  TextSplit split = split_heldout(text, config.data.heldout_fraction);
  CorpusTokens out;
  out.codec = make_text_codec(config, split.train);
  out.train = out.codec.encode(split.train);
  out.heldout = out.codec.encode(split.heldout);
  out.train_bytes = static_cast<int64_t>(split.train.size());
  out.heldout_bytes = static_cast<int64_t>(split.heldout.size());
  return out;
}

}  // namespace forge
