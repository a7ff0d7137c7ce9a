// The pieces the families' tokenizers add to byte-level BPE: Unicode normal forms against the reference
// over every code point, byte fallback, Metaspace's prepend schemes, the SentencePiece decoders, added
// tokens in their normalized form, refusals of what forge does not implement, and bad input.
// Parity over whole files is in tokenizer_test.cpp (ReferenceParity, Families).
#include <gtest/gtest.h>

#include <random>

#include "data/tokenizer_test_util.h"
#include "forge/core/error.h"
#include "forge/data/tokenizer/tokenizer.h"
#include "forge/data/tokenizer/tokenizer_decoder.h"
#include "forge/data/tokenizer/tokenizer_normalizer.h"
#include "forge/data/tokenizer/tokenizer_regex.h"
#include "forge/data/tokenizer/tokenizer_text.h"
#include "op_harness.h"

namespace forge::tokenizer_families_test {
using namespace forge::data;
namespace {

using nlohmann::json;
using testing::expect_error_containing;
using testing::read_json;
using testing::tokenizer_fixture;

std::string fnv1a64(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  return fmt::format("{:016x}", h);
}

Tokenizer family(const std::string& name) {
  return Tokenizer::from_file(tokenizer_fixture("families/" + name + ".tokenizer.json"));
}

// The reference's NFC, NFD, NFKC and NFKD (Unicode 9.0 tables) over all 1.1 million code points, 4096 at a
// time, and over sequences of every combining mark, built by the rule tokenizers_golden.py states.
TEST(TokenizerNormalizer, UnicodeFormsMatchTheReferenceOnEveryCodePoint) {
  const json expected = read_json(tokenizer_fixture("families/unicode_forms.json"));
  const auto chunk = expected["chunk"].get<char32_t>();
  std::vector<char32_t> marks;
  for (const json& range : expected["marks"])
    for (char32_t c = range[0].get<char32_t>(); c <= range[1].get<char32_t>(); ++c) marks.push_back(c);
  std::vector<std::string> sequences;
  std::string bases_utf8 = expected["bases"];
  std::vector<char32_t> bases;
  for (size_t i = 0; i < bases_utf8.size();) bases.push_back(tokenizer_text::next_code_point(bases_utf8, i));
  ASSERT_EQ(bases.size(), 8u);
  for (size_t i = 0; i < marks.size(); ++i) {
    std::string s;
    for (char32_t c : {bases[i % 8], marks[i], marks[(i * 7919) % marks.size()], char32_t{0x301}, marks[i]})
      tokenizer_text::append_utf8(c, s);
    sequences.push_back(std::move(s));
  }
  const std::pair<const char*, UnicodeForm> forms[] = {{"NFC", UnicodeForm::NFC},
                                                       {"NFD", UnicodeForm::NFD},
                                                       {"NFKC", UnicodeForm::NFKC},
                                                       {"NFKD", UnicodeForm::NFKD}};
  for (const auto& [name, form] : forms) {
    const json& code_point_hashes = expected[std::string(name) + "_code_points"];
    ASSERT_EQ(code_point_hashes.size(), 0x110000u / chunk);
    for (char32_t start = 0; start < 0x110000; start += chunk) {
      std::string text;
      for (char32_t c = std::max<char32_t>(start, 1); c < start + chunk; ++c)
        if (c < 0xD800 || c > 0xDFFF) tokenizer_text::append_utf8(c, text);
      EXPECT_EQ(fnv1a64(normalize_unicode(text, form)), code_point_hashes[start / chunk].get<std::string>())
          << name << " over U+" << fmt::format("{:04X}", static_cast<uint32_t>(start));
    }
    const json& mark_hashes = expected[std::string(name) + "_marks"];
    ASSERT_EQ(mark_hashes.size(), (sequences.size() + 63) / 64);
    for (size_t k = 0; k < sequences.size(); k += 64) {
      std::string text;
      for (size_t i = k; i < std::min(k + 64, sequences.size()); ++i)
        text += (i > k ? "|" : "") + sequences[i];
      EXPECT_EQ(fnv1a64(normalize_unicode(text, form)), mark_hashes[k / 64].get<std::string>())
          << name << " over mark sequences " << k;
    }
  }
}

// The characters next to which an added token with single_word is not a match (Rust regex \w, Unicode 16).
TEST(TokenizerFamilies, SingleWordCharactersMatchTheReferenceOnEveryCodePoint) {
  const json expected = read_json(tokenizer_fixture("families/unicode_forms.json"));
  std::vector<uint8_t> word(0x110000, 0);
  for (const json& range : expected["single_word_chars"])
    for (char32_t c = range[0].get<char32_t>(); c <= range[1].get<char32_t>(); ++c) word[c] = 1;
  int mismatches = 0;
  for (char32_t c = 1; c < 0x110000; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    if (is_word_char(c) != static_cast<bool>(word[c]) && ++mismatches <= 10)
      ADD_FAILURE() << fmt::format("U+{:04X}: reference {}", static_cast<uint32_t>(c), word[c]);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(TokenizerNormalizer, KnownForms) {
  EXPECT_EQ(normalize_unicode("e\xCC\x81", UnicodeForm::NFC), "\xC3\xA9");         // e + acute -> é
  EXPECT_EQ(normalize_unicode("\xC3\xA9", UnicodeForm::NFD), "e\xCC\x81");         // é -> e + acute
  EXPECT_EQ(normalize_unicode("\xEF\xAC\x81", UnicodeForm::NFKC), "fi");           // ﬁ
  EXPECT_EQ(normalize_unicode("\xEF\xAC\x81", UnicodeForm::NFC), "\xEF\xAC\x81");  // ﬁ kept
  EXPECT_EQ(normalize_unicode("\xE2\x91\xA0", UnicodeForm::NFKD), "1");            // ①
  EXPECT_EQ(normalize_unicode("\xF0\x9F\x85\xAC", UnicodeForm::NFKC),
            "\xF0\x9F\x85\xAC");  // U+1F16C is Unicode 12
  EXPECT_EQ(normalize_unicode("plain ascii", UnicodeForm::NFKC), "plain ascii");
  EXPECT_EQ(normalize_unicode("", UnicodeForm::NFC), "");
}

TEST(TokenizerDecoder, ByteFallbackTokensAreReadAsTheReferenceReadsThem) {
  EXPECT_EQ(byte_fallback_byte("<0x0A>"), 0x0A);
  EXPECT_EQ(byte_fallback_byte("<0xff>"), 0xFF);
  EXPECT_EQ(byte_fallback_byte("<0x+A>"), 0x0A);  // Rust's from_str_radix takes a sign
  EXPECT_EQ(byte_fallback_byte("<0xZZ>"), std::nullopt);
  EXPECT_EQ(byte_fallback_byte("<0x-1>"), std::nullopt);
  EXPECT_EQ(byte_fallback_byte("<0x0A"), std::nullopt);
  EXPECT_EQ(byte_fallback_byte("<0x0AB>"), std::nullopt);
}

// Mistral v0.1 (LLaMA-2's legacy form): the dummy prefix "▁" starts every piece of text between added
// tokens; characters missing from the vocabulary become their UTF-8 bytes; the decoder strips one space.
TEST(TokenizerFamilies, LegacyLlamaFormPrependsToEveryPieceAndFallsBackToBytes) {
  const Tokenizer t = family("mistral_v1");
  const int32_t bos = *t.token_to_id("<s>");
  EXPECT_EQ(t.bos_id(), bos);
  EXPECT_EQ(t.eos_id(), t.token_to_id("</s>"));
  const std::vector<int32_t> ids = t.encode("Hi<s>Hi");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(t.id_to_token(ids[0]), "▁H");
  EXPECT_EQ(t.encode("Hi<s>Hi", true).front(), bos);
  // "𠀀" (U+20000) is no piece of the trimmed vocabulary: its four bytes.
  const std::vector<int32_t> rare = t.encode("𠀀");
  ASSERT_EQ(rare.size(), 5u);
  EXPECT_EQ(t.id_to_token(rare[0]), "▁");
  EXPECT_EQ(t.id_to_token(rare[1]), "<0xF0>");
  EXPECT_EQ(t.id_to_token(rare[4]), "<0x80>");
  EXPECT_EQ(t.decode(rare), "𠀀");
  // Byte tokens that are not UTF-8 decode to one U+FFFD each; token_byte_length counts their byte.
  const std::vector<int32_t> cut = {rare[1], rare[2]};
  EXPECT_EQ(t.decode(cut), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(t.token_byte_length(rare[1]), 1);
  EXPECT_EQ(t.token_byte_length(*t.token_to_id("▁the")), 4);
  EXPECT_EQ(t.token_byte_length(bos), 0);
}

// Mistral v0.3 (Metaspace, prepend_scheme "first"): only the piece at the very start gets the "▁".
TEST(TokenizerFamilies, MetaspaceFirstPrependsOnlyAtTheStart) {
  const Tokenizer t = family("mistral_v3");
  const std::vector<int32_t> ids = t.encode("Hi[INST]Hi");
  const int32_t inst = *t.token_to_id("[INST]");
  ASSERT_EQ(std::count(ids.begin(), ids.end(), inst), 1);
  const auto at = std::find(ids.begin(), ids.end(), inst);
  EXPECT_EQ(t.id_to_token(ids.front()).value().rfind("▁", 0), 0u);
  ASSERT_NE(at + 1, ids.end());
  EXPECT_NE(t.id_to_token(*(at + 1)).value().rfind("▁", 0), 0u);
  EXPECT_EQ(t.decode(ids), "Hi[INST]Hi");
  EXPECT_EQ(t.decode(ids, true), "HiHi");
}

// Added tokens with `normalized: true` are found in the normalized text in their normalized form: under
// the Prepend("▁") normalizer "[DAY]" is found as "▁[DAY]", and decodes as " [DAY]".
TEST(TokenizerFamilies, NormalizedAddedTokensUseTheirNormalizedForm) {
  const Tokenizer t = family("llama2_style");
  const int32_t day = *t.token_to_id("[DAY]");
  EXPECT_EQ(t.encode("[DAY]"), std::vector<int32_t>{day});
  const std::vector<int32_t> spaced = t.encode("a [DAY]");  // "▁a▁[DAY]"
  EXPECT_EQ(std::count(spaced.begin(), spaced.end(), day), 1);
  const std::vector<int32_t> joined = t.encode("a[DAY]");  // "▁a[DAY]": no "▁[DAY]" in it
  EXPECT_EQ(std::count(joined.begin(), joined.end(), day), 0);
  const std::vector<int32_t> day_ids = {day};
  EXPECT_EQ(t.decode(day_ids), "[DAY]");  // " [DAY]" with the decoder's one stripped space
}

// Bad input never crashes: random valid UTF-8 through every family tokenizer, and random ids back.
TEST(TokenizerFamilies, RandomTextAndIdsNeverCrash) {
  std::mt19937 gen(11);
  for (const char* name :
       {"mistral_v1", "mistral_v3", "llama2_style", "gemma_style", "qwen3", "metaspace_nfkc"}) {
    const Tokenizer t = family(name);
    std::uniform_int_distribution<uint32_t> code(1, 0x10FFFF), length(0, 40), kind(0, 3);
    std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(t.vocab_size()) - 1);
    for (int n = 0; n < 200; ++n) {
      std::string text;
      for (uint32_t i = 0, len = length(gen); i < len; ++i) {
        uint32_t c = kind(gen) == 0   ? code(gen)
                     : kind(gen) == 1 ? 0x20 + code(gen) % 0x60
                                      : 0x2580 + code(gen) % 4;
        if (c >= 0xD800 && c <= 0xDFFF) c = ' ';
        tokenizer_text::append_utf8(c, text);
      }
      const std::vector<int32_t> ids = t.encode(text, true);
      const std::string decoded = t.decode(ids);
      EXPECT_EQ(tokenizer_text::find_invalid_utf8(decoded), std::string::npos) << name;
      std::vector<int32_t> random_ids(length(gen));
      for (int32_t& i : random_ids) i = id(gen);
      EXPECT_EQ(tokenizer_text::find_invalid_utf8(t.decode(random_ids, n % 2 == 0)), std::string::npos)
          << name;
    }
    expect_error_containing([&] { t.encode("bad \xFF"); }, {"not valid UTF-8"});
  }
}

// One line naming the file and the piece, for every family piece forge refuses or that is malformed.
TEST(TokenizerFamilies, RejectsUnsupportedAndMalformedPieces) {
  auto expect_rejected = [](const std::function<void(json&)>& edit,
                            std::initializer_list<std::string_view> parts) {
    json j = read_json(tokenizer_fixture("families/llama2_style.tokenizer.json"));
    edit(j);
    expect_error_containing([&] { Tokenizer::from_json(j, "fam.json"); }, parts);
  };
  expect_rejected(
      [](json& j) {
        j["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", ""}};
      },
      {"fam.json", "normalizer", "'Precompiled'", "not supported"});
  expect_rejected(
      [](json& j) {
        j["normalizer"]["normalizers"].push_back({{"type", "BertNormalizer"}});
      },
      {"fam.json", "normalizer.normalizers[2]", "'BertNormalizer'"});
  expect_rejected([](json& j) { j["normalizer"]["normalizers"][0].erase("prepend"); },
                  {"fam.json", "normalizer.normalizers[0]", "'prepend'"});
  expect_rejected([](json& j) { j["normalizer"]["normalizers"][1].erase("content"); },
                  {"fam.json", "normalizer.normalizers[1]", "'content'"});
  expect_rejected(
      [](json& j) {
        j["normalizer"]["normalizers"][1]["pattern"] = {{"Regex", "(ab"}};
      },
      {"fam.json", "normalizer.normalizers[1].pattern", "(ab"});
  expect_rejected([](json& j) { j["normalizer"]["normalizers"] = 3; },
                  {"fam.json", "normalizer.normalizers"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "ab"}, {"prepend_scheme", "first"}};
      },
      {"fam.json", "pre_tokenizer.replacement", "'ab'", "one character"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "sometimes"}};
      },
      {"fam.json", "pre_tokenizer.prepend_scheme", "sometimes"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"add_prefix_space", false}};
      },
      {"fam.json", "pre_tokenizer.add_prefix_space", "never"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"split", "yes"}};
      },
      {"fam.json", "pre_tokenizer.split"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Digits"}, {"individual_digits", true}};
      },
      {"fam.json", "pre_tokenizer", "'Digits'", "not supported"});
  expect_rejected(
      [](json& j) {
        j["decoder"]["decoders"].push_back({{"type", "WordPiece"}});
      },
      {"fam.json", "decoder.decoders[4]", "'WordPiece'"});
  expect_rejected([](json& j) { j["decoder"]["decoders"][3]["start"] = -1; },
                  {"fam.json", "decoder.decoders[3].start", "non-negative"});
  expect_rejected([](json& j) { j["decoder"]["decoders"][3]["content"] = ""; },
                  {"fam.json", "decoder.decoders[3].content", "one character"});
  expect_rejected([](json& j) { j["decoder"]["decoders"][0].erase("pattern"); },
                  {"fam.json", "decoder.decoders[0]", "'pattern'"});
  expect_rejected([](json& j) { j["decoder"] = {{"type", "CTC"}}; }, {"fam.json", "decoder", "'CTC'"});
  expect_rejected([](json& j) { j["decoder"] = {{"type", "Sequence"}}; }, {"fam.json", "decoder.decoders"});
  expect_rejected([](json& j) { j["model"]["type"] = "Unigram"; }, {"fam.json", "model", "Unigram"});
}

// Forms the reference reads beside the families' own: Metaspace with the older add_prefix_space (true
// keeps the scheme, false with "never"), a Strip that cuts both ends, an empty String pattern.
TEST(TokenizerFamilies, AcceptsTheOlderAndRarerForms) {
  json j = read_json(tokenizer_fixture("families/llama2_style.tokenizer.json"));
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"add_prefix_space", true}};
  const Tokenizer always = Tokenizer::from_json(j, "always");
  const std::vector<int32_t> twice = always.encode("Ab<s>Ab");
  ASSERT_EQ(twice.size() % 2, 1u);
  EXPECT_EQ(twice.front(), twice[twice.size() / 2 + 1]);  // "▁A" after <s> as at the start
  j["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", "▁"}, {"add_prefix_space", false}, {"prepend_scheme", "never"}};
  const Tokenizer never = Tokenizer::from_json(j, "never");
  EXPECT_NE(never.id_to_token(never.encode("Ab").front()).value().rfind("▁", 0), 0u);
  j["decoder"] = {{"type", "Strip"}, {"content", "x"}, {"start", 2}, {"stop", 5}};
  const Tokenizer strip = Tokenizer::from_json(j, "strip");
  const std::vector<int32_t> x = {*strip.token_to_id("x")};
  EXPECT_EQ(strip.decode(x), "");
}

}  // namespace
}  // namespace forge::tokenizer_families_test
