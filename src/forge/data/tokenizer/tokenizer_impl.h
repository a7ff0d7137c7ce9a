// Internals of forge::data::Tokenizer shared by its translation units (tokenizer.cpp runs the pipeline,
// tokenizer_config.cpp builds it from tokenizer.json). Not part of the public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "forge/data/tokenizer/tokenizer.h"
#include "forge/data/tokenizer/tokenizer_bpe.h"
#include "forge/data/tokenizer/tokenizer_decoder.h"
#include "forge/data/tokenizer/tokenizer_normalizer.h"
#include "forge/data/tokenizer/tokenizer_regex.h"

namespace forge::data {
namespace tokenizer_detail {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  // A `normalized` token is found, and decoded, in its normalized form (the reference's
  // normalized_cache): a Prepend("▁") normalizer makes "<x>" into "▁<x>". Otherwise the content.
  std::string form;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// Finds added tokens (their `form`) in text: leftmost match first, the longest one where several start
// there, never overlapping (the reference's Aho-Corasick "leftmost longest" search).
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token);
  bool empty() const { return count_ == 0; }
  // The first match at or after `from`: true and sets start and token.
  bool find(std::string_view text, size_t from, size_t& start, const AddedToken*& token) const;

 private:
  std::vector<const AddedToken*> by_first_byte_[256];  // longest first
  size_t count_ = 0, distinct_first_bytes_ = 0;
  char only_first_byte_ = 0;  // when all tokens start with the same byte: found with memchr
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct PreTokenizerStep {
  enum class Kind { ByteLevel, Split, Metaspace } kind = Kind::ByteLevel;
  // ByteLevel: prepend a space to pieces that do not start with one; split with the GPT-2 pattern.
  bool add_prefix_space = false, use_regex = true;
  // Metaspace: spaces become `replacement`, which is prepended as `prepend_scheme` says ("first": only
  // to the piece at the very start of the text); with `split`, pieces are cut before each replacement.
  std::string replacement;
  PrependScheme prepend_scheme = PrependScheme::Always;
  bool split = true;
  // Split: by a regular expression (a String pattern is compiled as its escaped text); also ByteLevel's
  // GPT-2 pattern and Metaspace's split on its replacement.
  std::shared_ptr<TokenizerRegex> regex;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
};

// One item of a TemplateProcessing "single" template: the input sequence, or a special token's ids.
struct TemplateItem {
  bool is_sequence = false;
  std::vector<int32_t> ids;
};

struct PostProcessorStep {
  bool is_template = false;  // false: ByteLevel, which changes offsets only
  std::vector<TemplateItem> single;
};

}  // namespace tokenizer_detail

struct Tokenizer::Impl {
  std::string source;     // file name or description, for error messages
  std::string json_text;  // what save() writes and to_json() parses

  Normalizer normalizer;
  std::unique_ptr<BpeModel> model;
  std::vector<tokenizer_detail::AddedToken> added_tokens;  // in file order
  TokenIdMap added_by_content;                             // content -> index in added_tokens
  std::vector<int32_t> added_index_by_id;                  // id -> index in added_tokens, or -1
  tokenizer_detail::AddedTokenMatcher non_normalized_tokens, normalized_tokens;

  std::vector<tokenizer_detail::PreTokenizerStep> pre_tokenizers;
  std::vector<tokenizer_detail::PostProcessorStep> post_processors;
  std::optional<Decoder> decoder;  // none: tokens are joined with spaces

  // Per id: the string the decoder is given (an added token's form, or the model's token); the bytes of
  // text it stands for on its own (Decoder::token_text); whether it is an added token marked special;
  // whether decode skips it with skip_special_tokens (its string is the content of a special token, the
  // reference's test); whether it exists.
  std::vector<std::string> token_string, text_bytes;
  std::vector<uint8_t> is_special, skip_as_special, exists;
  std::optional<int32_t> eos, bos;

  const tokenizer_detail::AddedToken* added_by_id(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= added_index_by_id.size() || added_index_by_id[id] < 0)
      return nullptr;
    return &added_tokens[added_index_by_id[id]];
  }
};

// Friend of Tokenizer: builds and inspects its Impl.
struct TokenizerAccess {
  using Impl = Tokenizer::Impl;
  // Parses tokenizer.json; throws forge::Error "<source>: <component>: <problem>".
  static std::unique_ptr<Impl> parse(const nlohmann::json& json, std::string_view source);
  static Tokenizer make(std::unique_ptr<Impl> impl) { return Tokenizer(std::move(impl)); }
  static const Impl& impl(const Tokenizer& tokenizer) { return *tokenizer.impl_; }
  // Runs the added-token split and the pre-tokenizers over valid UTF-8 `text` and calls on_word for
  // every word the model would see (byte_level: the word is raw text standing for its byte-level form).
  static void pre_tokenize(const Tokenizer& tokenizer, std::string_view text,
                           const std::function<void(std::string_view word, bool byte_level)>& on_word);
};

}  // namespace forge::data
