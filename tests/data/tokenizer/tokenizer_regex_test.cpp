// Split patterns under PCRE2 match what the reference's Oniguruma matches: \p{L}, \p{N} and \s over
// every code point (recorded by tests/reference/tokenizer/generate_fixtures.js), the iteration over empty
// matches, and the rejected constructs.
#include "forge/data/tokenizer/tokenizer_regex.h"

#include <gtest/gtest.h>

#include "data/tokenizer_test_util.h"
#include "forge/core/error.h"
#include "forge/data/tokenizer/tokenizer_text.h"
#include "op_harness.h"

namespace forge::tokenizer_regex_test {
using namespace forge::data;
namespace {

using testing::expect_error_containing;

TEST(TokenizerRegex, CharacterClassesMatchTheReferenceOnEveryCodePoint) {
  const nlohmann::json classes = testing::read_json(testing::tokenizer_fixture("unicode_classes.json"));
  for (const char* name : {"L", "N", "s"}) {
    std::vector<uint8_t> expected(0x110000, 0);
    for (const auto& range : classes[name])
      for (uint32_t c = range[0]; c <= range[1].get<uint32_t>(); ++c) expected[c] = 1;
    // One pattern over a string of all code points: every match is one member of the class.
    const TokenizerRegex regex(std::string("\\") + (name[0] == 's' ? "s" : std::string("p{") + name + "}"),
                               name);
    std::string all;
    std::vector<uint32_t> code_at;  // code point starting at each byte offset
    for (uint32_t c = 1; c < 0x110000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      code_at.resize(all.size() + 1, 0);
      code_at[all.size()] = c;
      tokenizer_text::append_utf8(c, all);
    }
    std::vector<uint8_t> got(0x110000, 0);
    regex.for_each_match(all, [&](size_t start, size_t) { got[code_at[start]] = 1; });
    size_t mismatches = 0;
    for (uint32_t c = 1; c < 0x110000; ++c) {
      if (got[c] != expected[c] && mismatches++ < 5)
        ADD_FAILURE() << name << " differs at U+" << std::hex << c;
    }
    EXPECT_EQ(mismatches, 0u) << name;
  }
}

TEST(TokenizerRegex, TranslatesOnigurumaOnlyConstructs) {
  EXPECT_EQ(
      translate_split_pattern("a\\sb", "t"),
      "a[\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
      "\\x{3000}]b");
  EXPECT_EQ(translate_split_pattern("[\\h]\\H", "t"), "[0-9a-fA-F][^0-9a-fA-F]");
  EXPECT_EQ(translate_split_pattern("\\d+\\w\\(\\)", "t"), "\\d+\\w\\(\\)");
  EXPECT_NE(translate_split_pattern("[^\\p{L}]", "t").find("\\x{105C0}"), std::string::npos);
  EXPECT_NE(translate_split_pattern("\\pN", "t").find("\\x{10D40}"), std::string::npos);
  EXPECT_EQ(translate_split_pattern("[]a]", "t"), "[]a]");
  expect_error_containing([] { translate_split_pattern("[a-z[^b]]", "ctx"); }, {"ctx", "nested"});
  expect_error_containing([] { translate_split_pattern("[a&&b]", "ctx"); }, {"ctx", "intersection"});
  expect_error_containing([] { translate_split_pattern("[abc", "ctx"); }, {"ctx", "unterminated"});
  expect_error_containing([] { translate_split_pattern("ab\\", "ctx"); }, {"ctx", "backslash"});
  expect_error_containing([] { TokenizerRegex("a(", "ctx"); }, {"ctx", "does not compile"});
}

std::vector<std::pair<size_t, size_t>> matches(const TokenizerRegex& regex, std::string_view text) {
  std::vector<std::pair<size_t, size_t>> out;
  regex.for_each_match(text, [&](size_t s, size_t e) { out.emplace_back(s, e); });
  return out;
}

// An empty match right where the previous match ended is skipped (one character forward), as the
// reference's Oniguruma iterator does; other empty matches count.
TEST(TokenizerRegex, IteratesEmptyMatchesLikeTheReference) {
  using M = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(matches(TokenizerRegex("", "t"), "ab"), (M{{0, 0}, {1, 1}, {2, 2}}));
  EXPECT_EQ(matches(TokenizerRegex("a*", "t"), "aab"), (M{{0, 2}, {3, 3}}));
  EXPECT_EQ(matches(TokenizerRegex("\\d*", "t"), "a12b"), (M{{0, 0}, {1, 3}, {4, 4}}));
  EXPECT_EQ(matches(TokenizerRegex("x*", "t"), "é"), (M{{0, 0}, {2, 2}}));     // steps a whole character
  EXPECT_EQ(matches(TokenizerRegex("^a", "t"), "a\na"), (M{{0, 1}, {2, 3}}));  // line anchors
}

TEST(TokenizerRegex, PretokenizesWithTheGpt2AndLlama3Patterns) {
  auto pieces = [](std::string_view pattern, std::string_view text) {
    std::vector<std::string> out;
    size_t previous = 0;
    TokenizerRegex(pattern, "t").for_each_match(text, [&](size_t s, size_t e) {
      if (s > previous) out.emplace_back(text.substr(previous, s - previous));
      out.emplace_back(text.substr(s, e - s));
      previous = e;
    });
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces(kGpt2SplitPattern, "It'S 'LL  x"), (V{"It", "'", "S", " '", "LL", " ", " x"}));
  EXPECT_EQ(pieces(kLlama3SplitPattern, "It'S 'LL 12345\r\n\n x"),
            (V{"It", "'S", " '", "LL", " ", "123", "45", "\r\n\n", " x"}));
  EXPECT_EQ(pieces(kLlama3SplitPattern, "x'ſs"), (V{"x", "'ſ", "s"}));  // (?i) folds ſ to s, as the reference
}

TEST(TokenizerRegex, WordCharacters) {
  EXPECT_TRUE(is_word_char('a'));
  EXPECT_TRUE(is_word_char('_'));
  EXPECT_TRUE(is_word_char('7'));
  EXPECT_TRUE(is_word_char(0x0301));  // combining acute accent (a mark)
  EXPECT_TRUE(is_word_char(0x4E2D));  // 中
  EXPECT_TRUE(is_word_char(0x200D));  // zero-width joiner
  EXPECT_FALSE(is_word_char('-'));
  EXPECT_FALSE(is_word_char(' '));
  EXPECT_FALSE(is_word_char(0x00B2));   // superscript two: a number, not a decimal digit
  EXPECT_FALSE(is_word_char(0x1F642));  // emoji
}

}  // namespace
}  // namespace forge::tokenizer_regex_test
