#include "forge/data/tokenizer/tokenizer_normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uniset.h>

#include <algorithm>
#include <cctype>

#include "forge/core/error.h"

namespace forge::data {
namespace {

// The four forms restricted to the characters of Unicode 9.0, built once.
class UnicodeNormalizers {
 public:
  UnicodeNormalizers() {
    UErrorCode status = U_ZERO_ERROR;
    unicode_9_ = std::make_unique<icu::UnicodeSet>(icu::UnicodeString("[:age=9.0:]", -1, US_INV), status);
    check(status, "the set of Unicode 9.0 characters");
    unicode_9_->freeze();
    const icu::Normalizer2* bases[4] = {
        icu::Normalizer2::getNFCInstance(status), icu::Normalizer2::getNFDInstance(status),
        icu::Normalizer2::getNFKCInstance(status), icu::Normalizer2::getNFKDInstance(status)};
    check(status, "the Unicode normalizers");
    for (int i = 0; i < 4; ++i)
      filtered_[i] = std::make_unique<icu::FilteredNormalizer2>(*bases[i], *unicode_9_);
  }

  const icu::Normalizer2& get(UnicodeForm form) const { return *filtered_[static_cast<int>(form)]; }

  static void check(UErrorCode status, std::string_view what) {
    if (U_FAILURE(status)) fail("tokenizer: ICU failed to build {}: {}", what, u_errorName(status));
  }

 private:
  std::unique_ptr<icu::UnicodeSet> unicode_9_;
  std::unique_ptr<icu::FilteredNormalizer2> filtered_[4];
};

const UnicodeNormalizers& unicode_normalizers() {
  static const UnicodeNormalizers normalizers;
  return normalizers;
}

}  // namespace

std::string normalize_unicode(std::string_view text, UnicodeForm form) {
  // ASCII is in every normal form, and no ASCII character combines with a following one.
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; }))
    return std::string(text);
  std::string out;
  out.reserve(text.size() + text.size() / 8);
  icu::StringByteSink<std::string> sink(&out);
  UErrorCode status = U_ZERO_ERROR;
  unicode_normalizers().get(form).normalizeUTF8(
      0, icu::StringPiece(text.data(), static_cast<int32_t>(text.size())), sink, nullptr, status);
  if (U_FAILURE(status)) fail("tokenizer: Unicode normalization failed: {}", u_errorName(status));
  return out;
}

std::string replace_all(std::string_view text, const TokenizerRegex& pattern, std::string_view content) {
  if (text.empty()) return {};
  std::string out;
  out.reserve(text.size());
  size_t previous_end = 0;
  pattern.for_each_match(text, [&](size_t start, size_t end) {
    out.append(text.substr(previous_end, start - previous_end));
    out.append(content);
    previous_end = end;
  });
  out.append(text.substr(previous_end));
  return out;
}

std::string replace_all(std::string_view text, std::string_view literal, std::string_view content) {
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  size_t from = 0;
  for (size_t hit = text.find(literal); hit != std::string_view::npos; hit = text.find(literal, from)) {
    out.append(text.substr(from, hit - from));
    out.append(content);
    from = hit + literal.size();
  }
  out.append(text.substr(from));
  return out;
}

std::string escape_literal(std::string_view literal) {
  std::string escaped;
  for (char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) escaped.push_back('\\');
    escaped.push_back(c);
  }
  return escaped;
}

std::string Normalizer::normalize(std::string_view text) const {
  std::string current(text);
  for (const NormalizerStep& step : steps_) {
    switch (step.kind) {
      case NormalizerStep::Kind::Unicode:
        current = normalize_unicode(current, step.form);
        break;
      case NormalizerStep::Kind::Prepend:
        if (!current.empty()) current.insert(0, step.text);
        break;
      case NormalizerStep::Kind::Replace:
        current = step.literal ? replace_all(current, *step.literal, step.text)
                               : replace_all(current, *step.pattern, step.text);
        break;
    }
  }
  return current;
}

}  // namespace forge::data
