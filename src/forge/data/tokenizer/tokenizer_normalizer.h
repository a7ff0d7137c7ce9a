// The normalizers of a tokenizer.json: Unicode normal forms, Prepend and Replace, run in order over each
// piece of text the added tokens leave (as the reference does).
//
// NFC, NFD, NFKC and NFKD use ICU, restricted to the characters of Unicode 9.0: the reference normalizes
// with the tables of its unicode-normalization-alignments crate, which are Unicode 9.0, so a character
// assigned later is left as it is and treated as a starter that composes with nothing. ICU's filtered
// normalizer does exactly that (checked against the reference over every code point and over mark
// sequences of every combining class, see tests/reference/tokenizers_golden.py).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "forge/data/tokenizer/tokenizer_regex.h"

namespace forge::data {

enum class UnicodeForm { NFC, NFD, NFKC, NFKD };

struct NormalizerStep {
  enum class Kind { Unicode, Prepend, Replace } kind = Kind::Unicode;
  UnicodeForm form = UnicodeForm::NFC;  // Unicode
  std::string text;                     // Prepend: what to prepend; Replace: the replacement
  // Replace: a non-empty String pattern is found as it is; a Regex (or the empty String) by `pattern`.
  std::optional<std::string> literal;
  std::shared_ptr<TokenizerRegex> pattern;
};

class Normalizer {
 public:
  void add(NormalizerStep step) { steps_.push_back(std::move(step)); }
  bool empty() const { return steps_.empty(); }
  // The normalized form of valid UTF-8 `text` (empty text stays empty: Prepend skips it).
  std::string normalize(std::string_view text) const;

 private:
  std::vector<NormalizerStep> steps_;
};

// `text` in Unicode normal form `form` as of Unicode 9.0 (see above). Throws forge::Error if ICU fails.
std::string normalize_unicode(std::string_view text, UnicodeForm form);

// Every match of `pattern` in `text` (valid UTF-8) replaced by `content`, matches enumerated as the
// reference does (an empty match inserts `content`; empty text stays empty).
std::string replace_all(std::string_view text, const TokenizerRegex& pattern, std::string_view content);
// Every occurrence of non-empty `literal`, left to right, replaced by `content`.
std::string replace_all(std::string_view text, std::string_view literal, std::string_view content);

// A regular expression that matches `literal` exactly (the reference compiles String patterns so).
std::string escape_literal(std::string_view literal);

}  // namespace forge::data
