// Regular expressions for tokenizer split patterns, run with PCRE2 (UTF + UCP, JIT).
//
// tokenizer.json patterns are written for the reference implementation, which runs them with Oniguruma
// (Ruby syntax). The constructs whose meaning differs are translated before PCRE2 compiles them, so the
// same pattern matches the same characters in both (checked over every code point against the
// reference, see tests/data/tokenizer_regex_test.cpp):
//   \s, \S (outside classes)  Unicode White_Space exactly (PCRE2's \s also takes U+180E);
//   \p{L}, \p{N}, \pL, \pN    PCRE2's tables plus the letters and digits that Unicode 15 and 16
//                             added (PCRE2 10.42 knows Unicode 14, the reference 16);
//   \h, \H                    hexadecimal digit (PCRE2 reads horizontal space);
//   ^, $                      line anchors (compiled with PCRE2_MULTILINE, as in Ruby).
// Everything else passes through; other properties use PCRE2's Unicode tables. Nested classes and
// class intersection ([a-z&&[^x]]) are rejected.
//
// Matches are enumerated the way the reference iterates Oniguruma matches: left to right, each search
// starting where the previous match ended, and an empty match directly at the end of the previous
// match is skipped by advancing one character.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "forge/data/tokenizer/tokenizer_text.h"

struct pcre2_real_code_8;

namespace forge::data {

// The pre-tokenization patterns of GPT-2 (the ByteLevel pre-tokenizer's built-in pattern) and LLaMA-3.
inline constexpr std::string_view kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kLlama3SplitPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

class TokenizerRegex {
 public:
  // Throws forge::Error "<context>: ..." if the pattern does not compile or uses a rejected construct.
  TokenizerRegex(std::string_view pattern, std::string_view context);
  TokenizerRegex(TokenizerRegex&& other) noexcept;
  TokenizerRegex& operator=(TokenizerRegex&& other) noexcept;
  TokenizerRegex(const TokenizerRegex&) = delete;
  TokenizerRegex& operator=(const TokenizerRegex&) = delete;
  ~TokenizerRegex();

  const std::string& pattern() const { return pattern_; }

  // Finds the first match at or after byte `from` of valid UTF-8 `text`; false if none.
  bool search(std::string_view text, size_t from, size_t& start, size_t& end) const;

  // Calls on_match(start, end) for every match in `text` (valid UTF-8), in the reference's iteration order.
  template <typename OnMatch>
  void for_each_match(std::string_view text, OnMatch&& on_match) const {
    size_t from = 0, start = 0, end = 0, last_match_end = 0;
    bool matched_before = false;
    while (from <= text.size() && search(text, from, start, end)) {
      if (start == end && matched_before && last_match_end == end) {
        from += from < text.size() ? tokenizer_text::utf8_length(static_cast<uint8_t>(text[from])) : 1;
        continue;
      }
      from = end;
      last_match_end = end;
      matched_before = true;
      on_match(start, end);
    }
  }

 private:
  std::string pattern_;
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
};

// The PCRE2 form of a pattern written for the reference (see above). Throws forge::Error naming
// `context` for rejected constructs.
std::string translate_split_pattern(std::string_view pattern, std::string_view context);

// Whether code point c is a word character for the reference's added-token `single_word` check
// (Rust regex \w: Alphabetic, marks, decimal digits, connector punctuation, join controls).
bool is_word_char(char32_t c);

}  // namespace forge::data
