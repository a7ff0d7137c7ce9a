// The decoders of a tokenizer.json, each a step over the list of token strings as the reference runs
// them (its decode_chain), the result joined:
//   ByteLevel     tokens to the bytes their characters stand for, all fused into one string, then
//                 invalid UTF-8 repaired to U+FFFD;
//   Replace       a pattern replaced in every token (SentencePiece's "▁" back to " ");
//   ByteFallback  each run of <0xNN> tokens to its bytes if they are valid UTF-8, else one U+FFFD per token;
//   Fuse          all tokens into one;
//   Strip         up to `start` leading and `stop` trailing `content` characters cut from every token;
//   Metaspace     the replacement character back to " ", dropped from the first token unless the
//                 prepend scheme is "never".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "forge/data/tokenizer/tokenizer_regex.h"

namespace forge::data {

enum class PrependScheme { First, Never, Always };

struct DecoderStep {
  enum class Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace } kind = Kind::ByteLevel;
  // Replace: a non-empty String pattern is found as it is, a Regex (or the empty String) by `pattern`.
  std::optional<std::string> literal;
  std::shared_ptr<TokenizerRegex> pattern;
  std::string content;         // Replace: the replacement; Strip, Metaspace: the character (UTF-8)
  size_t start = 0, stop = 0;  // Strip
  PrependScheme prepend_scheme = PrependScheme::Always;  // Metaspace
};

class Decoder {
 public:
  void add(DecoderStep step) { steps_.push_back(std::move(step)); }
  bool empty() const { return steps_.empty(); }
  // Only ByteLevel steps: each token decodes on its own, and the bytes are repaired once at the end.
  bool byte_level_only() const;
  // The text of `tokens` (valid UTF-8 each): every step in order, then the pieces joined.
  std::string decode(std::vector<std::string> tokens) const;
  // The bytes of text one token stands for wherever it stands: the steps that map tokens one by one
  // (a byte-fallback token is its byte; Metaspace's replacement is a space), without Strip and Fuse.
  std::string token_text(std::string_view token) const;

 private:
  std::vector<DecoderStep> steps_;
};

// The bytes a ByteLevel decoder makes of one token: what its characters stand for, or the token's own
// UTF-8 if a character is outside the byte-level alphabet.
std::string byte_level_decode(std::string_view token);

// The byte a byte-fallback token such as "<0x0A>" stands for (read as the reference does), if it is one.
std::optional<uint8_t> byte_fallback_byte(std::string_view token);

}  // namespace forge::data
