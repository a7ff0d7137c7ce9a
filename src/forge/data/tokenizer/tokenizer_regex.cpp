#define PCRE2_CODE_UNIT_WIDTH 8
#include "forge/data/tokenizer/tokenizer_regex.h"

#include <pcre2.h>

#include <utility>

#include "forge/core/error.h"

namespace forge::data {
namespace {

// Unicode White_Space, the reference's \s.
constexpr std::string_view kWhiteSpaceItems =
    R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
// Letters and digits assigned by Unicode 15.0-16.0, which the reference's tables include and PCRE2
// 10.42's (Unicode 14) do not. Measured by comparing both over every code point; harmless with a newer
// PCRE2 that already knows them.
constexpr std::string_view kExtraLetters =
    R"(\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D4A}-\x{10D65})"
    R"(\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC4}\x{1123F}-\x{11240}\x{11380}-\x{11389}\x{1138B}\x{1138E})"
    R"(\x{11390}-\x{113B5}\x{113B7}\x{113D1}\x{113D3}\x{11BC0}-\x{11BE0}\x{11F02}\x{11F04}-\x{11F10})"
    R"(\x{11F12}-\x{11F33}\x{1342F}\x{13441}-\x{13446}\x{13460}-\x{143FA}\x{16100}-\x{1611D})"
    R"(\x{16D40}-\x{16D6C}\x{18CFF}\x{1B132}\x{1B155}\x{1DF25}-\x{1DF2A}\x{1E030}-\x{1E06D})"
    R"(\x{1E4D0}-\x{1E4EB}\x{1E5D0}-\x{1E5ED}\x{1E5F0}\x{2B739}\x{2EBF0}-\x{2EE5D}\x{31350}-\x{323AF})";
constexpr std::string_view kExtraDigits =
    R"(\x{10D40}-\x{10D49}\x{116D0}-\x{116E3}\x{11BF0}-\x{11BF9}\x{11F50}-\x{11F59}\x{16130}-\x{16139})"
    R"(\x{16D70}-\x{16D79}\x{1CCF0}-\x{1CCF9}\x{1D2C0}-\x{1D2D3}\x{1E4F0}-\x{1E4F9}\x{1E5F1}-\x{1E5FA})";
// Word characters (Rust regex \w) assigned by Unicode 15.0-16.0, which the reference's added-token
// `single_word` check knows and PCRE2 10.42 does not: letters, marks and digits of the new scripts.
// Measured over every code point against the reference (tests/reference/tokenizers_golden.py).
constexpr std::string_view kExtraWordCharacters =
    R"(\x{897}\x{CF3}\x{ECE}\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3})"
    R"(\x{10D40}-\x{10D65}\x{10D69}-\x{10D6D}\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC4}\x{10EFC}-\x{10EFF})"
    R"(\x{1123F}-\x{11241}\x{11380}-\x{11389}\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}-\x{113C0})"
    R"(\x{113C2}\x{113C5}\x{113C7}-\x{113CA}\x{113CC}-\x{113D3}\x{113E1}-\x{113E2}\x{116D0}-\x{116E3})"
    R"(\x{11BC0}-\x{11BE0}\x{11BF0}-\x{11BF9}\x{11F00}-\x{11F10}\x{11F12}-\x{11F3A}\x{11F3E}-\x{11F42})"
    R"(\x{11F50}-\x{11F5A}\x{1342F}\x{13440}-\x{13455}\x{13460}-\x{143FA}\x{16100}-\x{16139})"
    R"(\x{16D40}-\x{16D6C}\x{16D70}-\x{16D79}\x{18CFF}\x{1B132}\x{1B155}\x{1CCF0}-\x{1CCF9})"
    R"(\x{1DF25}-\x{1DF2A}\x{1E030}-\x{1E06D}\x{1E08F}\x{1E4D0}-\x{1E4F9}\x{1E5D0}-\x{1E5FA}\x{2B739})"
    R"(\x{2EBF0}-\x{2EE5D}\x{31350}-\x{323AF})";
constexpr std::string_view kHexDigitItems = "0-9a-fA-F";

std::string pcre2_error_text(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread match data (one pair: only the whole match is read) and JIT stack.
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_context* context = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (!data || !context || !jit_stack) throw Error("out of memory creating PCRE2 match data");
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchScratch() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

// A \p{...}/\pX escape starting at pattern[i] == 'p' or 'P'. Returns the property text ("L") and the
// index after the escape, or an empty name if the form is not recognised.
std::pair<std::string_view, size_t> read_property(std::string_view pattern, size_t i) {
  if (i + 1 >= pattern.size()) return {{}, i + 1};
  if (pattern[i + 1] != '{') return {pattern.substr(i + 1, 1), i + 2};
  const size_t close = pattern.find('}', i + 2);
  if (close == std::string_view::npos) return {{}, i + 1};
  return {pattern.substr(i + 2, close - i - 2), close + 1};
}

}  // namespace

std::string translate_split_pattern(std::string_view pattern, std::string_view context) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  size_t i = 0;
  while (i < pattern.size()) {
    const char c = pattern[i];
    if (c == '\\') {
      if (i + 1 >= pattern.size()) fail("{}: pattern '{}' ends with a lone backslash", context, pattern);
      const char e = pattern[i + 1];
      if (e == 's' || (e == 'S' && !in_class)) {
        if (in_class) {
          out.append(kWhiteSpaceItems);
        } else {
          out.append(e == 's' ? "[" : "[^").append(kWhiteSpaceItems).append("]");
        }
        i += 2;
        continue;
      }
      if (e == 'h' || (e == 'H' && !in_class)) {
        if (in_class) {
          out.append(kHexDigitItems);
        } else {
          out.append(e == 'h' ? "[" : "[^").append(kHexDigitItems).append("]");
        }
        i += 2;
        continue;
      }
      if (e == 'H') fail("{}: pattern '{}': \\H inside a character class is not supported", context, pattern);
      if (e == 'p' || e == 'P') {
        auto [name, next] = read_property(pattern, i + 1);
        bool negated = e == 'P';
        if (!name.empty() && name[0] == '^') {
          negated = !negated;
          name.remove_prefix(1);
        }
        const std::string_view extra = (name == "L" || name == "Letter")   ? kExtraLetters
                                       : (name == "N" || name == "Number") ? kExtraDigits
                                                                           : "";
        if (!extra.empty() && !(negated && in_class)) {
          const std::string items =
              fmt::format("\\p{{{}}}{}", name.size() == 1 ? name : name.substr(0, 1), extra);
          if (in_class) {
            out.append(items);
          } else {
            out.append(negated ? "[^" : "[").append(items).append("]");
          }
          i = next;
          continue;
        }
        out.append(pattern.substr(i, next - i));
        i = next;
        continue;
      }
      out.append(pattern.substr(i, 2));
      i += 2;
      continue;
    }
    if (in_class) {
      if (c == '[') {
        // POSIX classes ([:alpha:]) are fine; a nested class is Oniguruma-only.
        if (i + 1 < pattern.size() && pattern[i + 1] == ':') {
          const size_t close = pattern.find(":]", i + 2);
          if (close == std::string_view::npos)
            fail("{}: pattern '{}': unterminated [: in a class", context, pattern);
          out.append(pattern.substr(i, close + 2 - i));
          i = close + 2;
          continue;
        }
        fail("{}: pattern '{}': nested character classes are not supported", context, pattern);
      }
      if (c == '&' && i + 1 < pattern.size() && pattern[i + 1] == '&')
        fail("{}: pattern '{}': character class intersection (&&) is not supported", context, pattern);
      if (c == ']') in_class = false;
      out.push_back(c);
      ++i;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out.push_back('[');
      ++i;
      if (i < pattern.size() && pattern[i] == '^') out.push_back(pattern[i++]);
      // A ']' right after '[' or '[^' is a literal in both dialects.
      if (i < pattern.size() && pattern[i] == ']') out.push_back(pattern[i++]);
      continue;
    }
    out.push_back(c);
    ++i;
  }
  if (in_class) fail("{}: pattern '{}' has an unterminated character class", context, pattern);
  return out;
}

TokenizerRegex::TokenizerRegex(std::string_view pattern, std::string_view context) : pattern_(pattern) {
  const std::string translated = translate_split_pattern(pattern, context);
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                        PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, nullptr);
  if (!code_)
    fail("{}: pattern '{}' does not compile: {} (at offset {} of its PCRE2 form)", context, pattern,
         pcre2_error_text(error), offset);
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

TokenizerRegex::TokenizerRegex(TokenizerRegex&& other) noexcept
    : pattern_(std::move(other.pattern_)), code_(std::exchange(other.code_, nullptr)), jit_(other.jit_) {}

TokenizerRegex& TokenizerRegex::operator=(TokenizerRegex&& other) noexcept {
  if (this != &other) {
    pcre2_code_free(code_);
    pattern_ = std::move(other.pattern_);
    code_ = std::exchange(other.code_, nullptr);
    jit_ = other.jit_;
  }
  return *this;
}

TokenizerRegex::~TokenizerRegex() { pcre2_code_free(code_); }

bool TokenizerRegex::search(std::string_view text, size_t from, size_t& start, size_t& end) const {
  MatchScratch& s = scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc =
      jit_ ? pcre2_jit_match(code_, subject, text.size(), from, PCRE2_NO_UTF_CHECK, s.data, s.context)
           : pcre2_match(code_, subject, text.size(), from, PCRE2_NO_UTF_CHECK, s.data, s.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  // rc == 0: the match data has room for the whole match only, which is all that is read.
  if (rc < 0) fail("split pattern '{}' failed to match: {}", pattern_, pcre2_error_text(rc));
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(s.data);
  start = ovector[0];
  end = ovector[1];
  return true;
}

bool is_word_char(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  static const TokenizerRegex word(
      fmt::format(R"([\p{{Alphabetic}}\p{{M}}\p{{Nd}}\p{{Pc}}\p{{Join_Control}}{}])", kExtraWordCharacters),
      "word characters");
  std::string utf8;
  tokenizer_text::append_utf8(c, utf8);
  size_t start = 0, end = 0;
  return word.search(utf8, 0, start, end);
}

}  // namespace forge::data
