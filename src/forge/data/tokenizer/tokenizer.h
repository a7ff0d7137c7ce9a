// BPE tokenizers in Hugging Face `tokenizer.json` format: byte-level (GPT-2, LLaMA-3, Qwen) and
// SentencePiece-style with byte fallback (LLaMA-2, Mistral, Gemma).
//
// Encoding follows the reference implementation (Hugging Face tokenizers): added tokens are split out of
// the text, the rest normalized (NFC, Prepend, Replace, ...), pre-tokenized (split patterns run with
// PCRE2, the GPT-2 byte-to-unicode mapping, Metaspace) and merged by BPE ranks (bytes as <0xNN> tokens
// where a character is missing); the post-processor may add special tokens (BOS) when asked. Decoding
// runs the decoder's steps (byte-level mapping, ▁ back to spaces, byte fallback, fuse, strip).
// The components supported (and the ones refused) are listed in docs/formats.md; parity with the
// reference is tested against fixtures from tests/reference/tokenizer/.
//
// Text must be valid UTF-8: encode throws forge::Error naming the offset of the first bad byte (the
// reference only takes Unicode strings). encode and decode are const and thread-safe; a word cache shared
// by all threads makes repeated words cheap.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace forge::data {

class Tokenizer {
 public:
  // Throws forge::Error naming the file and the offending component for anything unsupported or
  // malformed (a model type other than BPE, a merge naming an unknown token, bad JSON, ...).
  static Tokenizer from_file(const std::filesystem::path& path);
  static Tokenizer from_json(const nlohmann::json& json, std::string_view source_name);
  // Parses the text of a tokenizer.json; save() then writes exactly this text.
  static Tokenizer from_json_text(std::string_view text, std::string_view source_name);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // add_special_tokens: apply the post-processor (e.g. LLaMA-3's <|begin_of_text|>).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Bytes that split a character decode to U+FFFD, as in the reference. Throws forge::Error for an id
  // that names no token (the reference skips those silently).
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // Bytes of text that token `id` stands for (for bits-per-byte accounting); special tokens count 0.
  int64_t token_byte_length(int32_t id) const;

  int64_t vocab_size() const;  // the largest id + 1, added tokens included
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  // End-of-sequence / document token: the first of <|endoftext|>, <|end_of_text|>, </s> that is an added
  // token marked special. Beginning of sequence: likewise <|begin_of_text|>, <s>.
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> bos_id() const;

  nlohmann::json to_json() const;        // the document it was loaded from
  const std::string& json_text() const;  // ... as the text it was loaded from
  // Atomic (checked writes, fsync, tmp + rename; no temporary left on failure); the loaded text unchanged.
  void save(const std::filesystem::path& path) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend struct TokenizerAccess;
};

}  // namespace forge::data
