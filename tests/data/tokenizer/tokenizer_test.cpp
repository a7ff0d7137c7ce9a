// The tokenizer against the reference implementation (Hugging Face tokenizers 0.23.2 and 0.23.3): ids
// and decoded text recorded by tests/reference/tokenizer/generate_fixtures.js for seven byte-level
// tokenizer.json files and by tests/reference/tokenizers_golden.py for the families' tokenizers
// (families/), the reference's split behaviours, round trips, byte lengths, and every error path.
#include "forge/data/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "data/tokenizer_test_util.h"
#include "forge/core/error.h"
#include "forge/data/tokenizer/tokenizer_impl.h"
#include "forge/data/tokenizer/tokenizer_text.h"
#include "op_harness.h"

namespace forge::tokenizer_test {
using namespace forge::data;
namespace {

using nlohmann::json;
using testing::expect_error_containing;
using testing::read_file;
using testing::read_json;
using testing::small_tokenizer_json;
using testing::tokenizer_fixture;

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

// Every case of an expected.json: encode with and without special tokens, decode both ways.
void expect_reference_parity(const std::filesystem::path& tokenizer_file,
                             const std::filesystem::path& expected_file) {
  const std::string name = tokenizer_file.filename().string();
  const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_file);
  const json expected = read_json(expected_file);
  EXPECT_EQ(tokenizer.vocab_size(), expected["vocab_size"].get<int64_t>());
  ASSERT_GE(expected["encode"].size(), 200u);
  for (const json& c : expected["encode"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tokenizer.encode(text), ids_of(c["ids"])) << name << ": " << c.dump();
    const std::vector<int32_t> with_special = tokenizer.encode(text, true);
    EXPECT_EQ(with_special, ids_of(c["ids_with_special_tokens"])) << name << ": " << c.dump();
    EXPECT_EQ(tokenizer.decode(with_special), c["decoded"].get<std::string>()) << name << ": " << c.dump();
    EXPECT_EQ(tokenizer.decode(with_special, true), c["decoded_skip_special"].get<std::string>())
        << name << ": " << c.dump();
  }
  ASSERT_FALSE(expected["decode"].empty());
  for (const json& c : expected["decode"]) {
    const std::vector<int32_t> ids = ids_of(c["ids"]);
    EXPECT_EQ(tokenizer.decode(ids), c["text"].get<std::string>()) << name << ": " << c.dump();
    EXPECT_EQ(tokenizer.decode(ids, true), c["text_skip_special"].get<std::string>())
        << name << ": " << c.dump();
  }
}

class ReferenceParity : public ::testing::TestWithParam<const char*> {};

TEST_P(ReferenceParity, EncodeAndDecodeMatchTheReference) {
  const std::string name = GetParam();
  expect_reference_parity(tokenizer_fixture(name + ".tokenizer.json"),
                          tokenizer_fixture(name + ".expected.json"));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ReferenceParity,
                         ::testing::Values("gpt2_style", "llama3_style", "handwritten", "split_behaviors",
                                           "char_unk", "hf_trained_gpt2", "hf_trained_llama3"));

// The families' tokenizers (tests/reference/tokenizers_golden.py): Mistral v0.1 (LLaMA-2's legacy form)
// and v0.3 (Metaspace), SentencePiece BPE in LLaMA-2's and Gemma's layouts, Qwen3, and NFKC + Metaspace
// with split, over a hard multilingual corpus whole and line by line.
INSTANTIATE_TEST_SUITE_P(Families, ReferenceParity,
                         ::testing::Values("families/mistral_v1", "families/mistral_v3",
                                           "families/llama2_style", "families/gemma_style", "families/qwen3",
                                           "families/metaspace_nfkc"));

// The untrimmed Mistral and Qwen files, written by `tokenizers_golden.py --full DIR` (too large to commit):
// run with FORGE_TOKENIZER_FULL_DIR=DIR.
TEST(Tokenizer, FullFamilyFilesMatchTheReference) {
  const char* dir = std::getenv("FORGE_TOKENIZER_FULL_DIR");
  if (!dir) GTEST_SKIP() << "FORGE_TOKENIZER_FULL_DIR is not set";
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    const std::string suffix = ".tokenizer.json";
    if (file.size() <= suffix.size() || file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string stem = file.substr(0, file.size() - suffix.size());
    expect_reference_parity(entry.path(), entry.path().parent_path() / (stem + ".expected.json"));
    ++files;
  }
  EXPECT_GT(files, 0) << dir;
}

// Every fixture text that is valid UTF-8 comes back unchanged from a byte-level tokenizer without a
// prefix space, including the long words merged by the heap algorithm.
TEST(Tokenizer, DecodeOfEncodeIsTheText) {
  for (const char* name : {"gpt2_style", "llama3_style"}) {
    const Tokenizer tokenizer =
        Tokenizer::from_file(tokenizer_fixture(std::string(name) + ".tokenizer.json"));
    for (const json& c : read_json(tokenizer_fixture(std::string(name) + ".expected.json"))["encode"]) {
      const std::string text = c["text"];
      EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), text) << name;
      EXPECT_EQ(tokenizer.decode(tokenizer.encode(text, true), true), text) << name;
    }
    const std::string corpus = read_file(tokenizer_fixture("corpus.txt"));
    EXPECT_EQ(tokenizer.decode(tokenizer.encode(corpus)), corpus) << name;
  }
}

// Random byte strings that happen to be valid UTF-8 (mostly multi-byte characters) round-trip too.
TEST(Tokenizer, RandomUnicodeRoundTrips) {
  const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_fixture("llama3_style.tokenizer.json"));
  std::mt19937 gen(7);
  std::uniform_int_distribution<uint32_t> code(1, 0x10FFFF), length(0, 30), kind(0, 3);
  for (int n = 0; n < 300; ++n) {
    std::string text;
    for (uint32_t i = 0, len = length(gen); i < len; ++i) {
      uint32_t c = kind(gen) == 0 ? code(gen) : kind(gen) == 1 ? 0x20 + code(gen) % 0x60 : code(gen) % 0x3000;
      if (c >= 0xD800 && c <= 0xDFFF) c = 'x';
      tokenizer_text::append_utf8(c, text);
    }
    EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), text);
  }
}

// The reference's pre-token boundaries for each split behaviour, recorded from tokenizers 0.23.2
// (PreTokenizer.preTokenizeString of a Split over "ab 12,x Qq. éz" and a few short strings).
TEST(Tokenizer, SplitBehavioursMatchTheReference) {
  struct Case {
    const char *pattern, *behavior;
    bool invert, literal;
    const char* text;
    std::vector<std::string> pieces;
  };
  const std::string t = "ab 12,x Qq. éz";
  const std::vector<std::string> chars = {"a", "b", " ", "1", "2", ",", "x",
                                          " ", "Q", "q", ".", " ", "é", "z"};
  const std::vector<Case> cases = {
      {"", "Isolated", false, true, t.c_str(), chars},
      {"", "Isolated", false, false, t.c_str(), chars},
      {"", "MergedWithPrevious", false, false, t.c_str(), chars},
      {"", "Contiguous", false, false, t.c_str(), chars},
      {"", "Removed", false, false, t.c_str(), chars},
      {"a*", "Isolated", false, false, t.c_str(), chars},
      {"a*",
       "MergedWithNext",
       false,
       false,
       t.c_str(),
       {"ab", " ", "1", "2", ",", "x", " ", "Q", "q", ".", " ", "é", "z"}},
      {" ", "MergedWithPrevious", false, true, t.c_str(), {"ab ", "12,x ", "Qq. ", "éz"}},
      {"\\p{N}+", "Contiguous", true, false, t.c_str(), {"ab ", "12", ",x Qq. éz"}},
      {"[,.!?]", "MergedWithNext", false, false, t.c_str(), {"ab 12", ",x Qq", ". éz"}},
      {"x+", "Removed", false, false, t.c_str(), {"ab 12,", " Qq. éz"}},
      {"(?i)q", "Isolated", true, false, t.c_str(), {"ab 12,x ", "Q", "q", ". éz"}},
      {"(?i)q", "Removed", true, false, t.c_str(), {"Q", "q"}},
      {"(?<=a)b", "Isolated", false, false, t.c_str(), {"a", "b", " 12,x Qq. éz"}},
      {"[a-z]", "Contiguous", false, false, "ab1cd", {"ab", "1", "cd"}},
      {"[a-z]", "MergedWithPrevious", false, false, "1ab2c", {"1a", "b", "2c"}},
      {"[a-z]", "MergedWithNext", false, false, "ab1c2", {"a", "b1", "c2"}},
      {"[a-z]", "MergedWithPrevious", true, false, "1ab2c", {"1", "a", "b2", "c"}},
      {"[a-z]", "MergedWithNext", true, false, "ab1c2", {"a", "b", "1c", "2"}},
      {"\\d*", "MergedWithPrevious", false, false, "a12b", {"a12", "b"}},
      {"\\d*", "Contiguous", false, false, "a12b", {"a", "12", "b"}},
  };
  for (const Case& c : cases) {
    json j = small_tokenizer_json();
    j["pre_tokenizer"] = {{"type", "Split"},
                          {"pattern", {{c.literal ? "String" : "Regex", c.pattern}}},
                          {"behavior", c.behavior},
                          {"invert", c.invert}};
    const Tokenizer tokenizer = Tokenizer::from_json(j, "split test");
    std::vector<std::string> pieces;
    TokenizerAccess::pre_tokenize(tokenizer, c.text,
                                  [&](std::string_view piece, bool) { pieces.emplace_back(piece); });
    EXPECT_EQ(pieces, c.pieces) << c.pattern << " " << c.behavior << " invert=" << c.invert;
  }
}

TEST(Tokenizer, TokenByteLengthsAddUpToTheText) {
  const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_fixture("gpt2_style.tokenizer.json"));
  const std::string text = "In the beginning, 中文 and emoji 👍🏽 <|endoftext|> end\n";
  int64_t bytes = 0;
  for (int32_t id : tokenizer.encode(text)) bytes += tokenizer.token_byte_length(id);
  EXPECT_EQ(bytes, static_cast<int64_t>(text.size() - std::string("<|endoftext|>").size()));
  EXPECT_EQ(tokenizer.token_byte_length(*tokenizer.token_to_id("<|endoftext|>")), 0);
  EXPECT_EQ(tokenizer.token_byte_length(*tokenizer.token_to_id("Ġ")), 1);
  EXPECT_EQ(tokenizer.token_byte_length(*tokenizer.token_to_id("Ċ")), 1);
  EXPECT_EQ(tokenizer.token_byte_length(*tokenizer.token_to_id("Ġthe")), 4);
  // A non-special added token counts the bytes the decoder makes of it.
  const Tokenizer handwritten = Tokenizer::from_file(tokenizer_fixture("handwritten.tokenizer.json"));
  EXPECT_EQ(handwritten.token_byte_length(*handwritten.token_to_id("<special token>")), 15);
  EXPECT_EQ(handwritten.token_byte_length(*handwritten.token_to_id("<mask>")), 0);
  EXPECT_EQ(handwritten.token_byte_length(*handwritten.token_to_id("é!")), 2);  // the bytes E9 21
}

TEST(Tokenizer, EndAndBeginningOfSequence) {
  const Tokenizer gpt2 = Tokenizer::from_file(tokenizer_fixture("gpt2_style.tokenizer.json"));
  EXPECT_EQ(gpt2.eos_id(), gpt2.token_to_id("<|endoftext|>"));
  EXPECT_EQ(gpt2.bos_id(), std::nullopt);
  const Tokenizer llama3 = Tokenizer::from_file(tokenizer_fixture("llama3_style.tokenizer.json"));
  EXPECT_EQ(llama3.eos_id(), llama3.token_to_id("<|end_of_text|>"));
  EXPECT_EQ(llama3.bos_id(), llama3.token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(llama3.encode("Hi", true).front(), *llama3.bos_id());
  const Tokenizer handwritten = Tokenizer::from_file(tokenizer_fixture("handwritten.tokenizer.json"));
  EXPECT_EQ(handwritten.eos_id(), handwritten.token_to_id("<|endoftext|>"));  // listed before </s>
  EXPECT_EQ(handwritten.bos_id(), handwritten.token_to_id("<s>"));
  // Not special: not an end of sequence.
  json j = small_tokenizer_json();
  j["added_tokens"][0]["special"] = false;
  EXPECT_EQ(Tokenizer::from_json(j, "t").eos_id(), std::nullopt);
}

TEST(Tokenizer, VocabularyLookups) {
  const Tokenizer t = Tokenizer::from_json(small_tokenizer_json(), "small");
  EXPECT_EQ(t.vocab_size(), 260);
  EXPECT_EQ(t.token_to_id("hell"), 258);
  EXPECT_EQ(t.token_to_id("<|endoftext|>"), 259);
  EXPECT_EQ(t.token_to_id("nope"), std::nullopt);
  EXPECT_EQ(t.id_to_token(259), "<|endoftext|>");
  EXPECT_EQ(t.id_to_token(256), "he");
  EXPECT_EQ(t.id_to_token(260), std::nullopt);
  EXPECT_EQ(t.id_to_token(-1), std::nullopt);
  EXPECT_EQ(t.encode("hello"), (std::vector<int32_t>{258, 'o'}));
  EXPECT_EQ(t.encode(""), std::vector<int32_t>{});
}

TEST(Tokenizer, SaveWritesTheLoadedTextAndLoadsBack) {
  testing::TokenizerTempDir dir;
  const auto source = tokenizer_fixture("llama3_style.tokenizer.json");
  const Tokenizer t = Tokenizer::from_file(source);
  t.save(dir / "copy.json");
  EXPECT_EQ(read_file(dir / "copy.json"), read_file(source));
  EXPECT_FALSE(std::filesystem::exists(dir / "copy.json.tmp"));
  const Tokenizer copy = Tokenizer::from_file(dir / "copy.json");
  EXPECT_EQ(copy.encode("The Lord's 1234 words"), t.encode("The Lord's 1234 words"));
  EXPECT_EQ(copy.to_json(), t.to_json());
  EXPECT_EQ(t.to_json()["model"]["type"], "BPE");
  // from_json writes its document back.
  const Tokenizer small = Tokenizer::from_json(small_tokenizer_json(), "small");
  EXPECT_EQ(small.to_json(), small_tokenizer_json());
}

// A full disk (the temporary linked to /dev/full): one line with the reason, no temporary left behind, an
// existing file untouched.
TEST(Tokenizer, SaveToAFullDiskFailsAndLeavesNoTemporary) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  testing::TokenizerTempDir dir;
  const Tokenizer t = Tokenizer::from_file(tokenizer_fixture("llama3_style.tokenizer.json"));
  std::ofstream(dir / "tokenizer.json") << "old";
  std::filesystem::create_symlink("/dev/full", dir / "tokenizer.json.tmp");
  expect_error_containing(
      [&] { t.save(dir / "tokenizer.json"); },
      {"tokenizer file", (dir / "tokenizer.json.tmp").string(), "No space left on device"});
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(dir / "tokenizer.json.tmp")));
  EXPECT_EQ(read_file(dir / "tokenizer.json"), "old");
}

// The scan and the heap merge algorithms agree on random words (the heap takes words over 96 symbols).
TEST(Tokenizer, MergeAlgorithmsAgree) {
  const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_fixture("gpt2_style.tokenizer.json"));
  const BpeModel& model = *TokenizerAccess::impl(tokenizer).model;
  std::mt19937 gen(3);
  const std::string letters = "eeeettthhhaaanndd iosrl";
  for (int n = 0; n < 300; ++n) {
    std::uniform_int_distribution<size_t> length(0, 200), pick(0, letters.size() - 1);
    std::vector<int32_t> symbols;
    for (size_t i = 0, len = length(gen); i < len; ++i)
      symbols.push_back(*tokenizer.token_to_id(testing::byte_level_char(letters[pick(gen)])));
    std::vector<int32_t> by_scan = symbols, by_heap = symbols;
    model.merge_by_scan(by_scan);
    model.merge_by_heap(by_heap);
    ASSERT_EQ(by_scan, by_heap);
  }
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_fixture("gpt2_style.tokenizer.json"));
  const std::string corpus = read_file(tokenizer_fixture("corpus.txt"));
  std::vector<int32_t> a, b;
  std::thread other([&] { b = tokenizer.encode(corpus); });
  a = tokenizer.encode(corpus);
  other.join();
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, tokenizer.encode(corpus));
}

TEST(Tokenizer, RejectsInvalidUtf8AndUnknownIds) {
  const Tokenizer t = Tokenizer::from_json(small_tokenizer_json(), "small.json");
  expect_error_containing([&] { t.encode("ab\xC3(cd"); }, {"not valid UTF-8", "offset 2"});
  expect_error_containing([&] { t.encode("\xED\xA0\x80"); }, {"not valid UTF-8", "0xED"});  // a surrogate
  expect_error_containing([&] { t.encode("\xF4\x90\x80\x80"); }, {"not valid UTF-8"});      // above U+10FFFF
  expect_error_containing([&] { t.encode("\xC0\xAF"); }, {"not valid UTF-8"});              // overlong
  const std::vector<int32_t> bad = {1, 999};
  expect_error_containing([&] { t.decode(bad); }, {"small.json", "id 999"});
  const std::vector<int32_t> negative = {-1};
  expect_error_containing([&] { t.decode(negative); }, {"id -1"});
  expect_error_containing([&] { t.token_byte_length(260); }, {"small.json", "260"});
}

// One line naming the file and the component, for every malformed or unsupported document.
TEST(Tokenizer, RejectsMalformedAndUnsupportedFiles) {
  auto expect_rejected = [](const std::function<void(json&)>& edit,
                            std::initializer_list<std::string_view> parts) {
    json j = small_tokenizer_json();
    edit(j);
    expect_error_containing([&] { Tokenizer::from_json(j, "bad.json"); }, parts);
  };
  expect_rejected([](json& j) { j.erase("model"); }, {"bad.json", "model", "missing"});
  expect_rejected([](json& j) { j["model"]["type"] = "WordPiece"; }, {"bad.json", "model", "WordPiece"});
  expect_rejected([](json& j) { j["model"]["merges"].push_back("he zz"); },
                  {"bad.json", "merges", "unknown token 'zz'"});
  expect_rejected([](json& j) { j["model"]["merges"].push_back("e h"); },
                  {"bad.json", "merge 3", "'eh'", "not in the vocab"});
  expect_rejected([](json& j) { j["model"]["merges"].push_back("a b c"); },
                  {"bad.json", "merges[3]", "a b c"});
  expect_rejected([](json& j) { j["model"]["merges"].push_back(42); }, {"bad.json", "merges[3]"});
  expect_rejected([](json& j) { j["model"]["vocab"]["dup"] = 5; }, {"bad.json", "vocab", "share id 5"});
  expect_rejected([](json& j) { j["model"]["vocab"]["neg"] = -3; }, {"bad.json", "vocab", "-3"});
  expect_rejected([](json& j) { j["model"]["vocab"]["str"] = "7"; }, {"bad.json", "vocab['str']"});
  expect_rejected([](json& j) { j["model"]["vocab"]["far"] = 100000000; },
                  {"bad.json", "vocab", "far beyond"});
  expect_rejected([](json& j) { j["model"]["dropout"] = 0.1; }, {"bad.json", "model.dropout", "0.1"});
  expect_rejected([](json& j) { j["model"]["byte_fallback"] = 1; }, {"bad.json", "model.byte_fallback"});
  expect_rejected([](json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
                  {"bad.json", "continuing_subword_prefix"});
  expect_rejected([](json& j) { j["model"]["end_of_word_suffix"] = "</w>"; },
                  {"bad.json", "end_of_word_suffix"});
  expect_rejected(
      [](json& j) {
        j["normalizer"] = {{"type", "Lowercase"}};
      },
      {"bad.json", "normalizer", "Lowercase"});
  expect_rejected([](json& j) { j["truncation"] = {{"max_length", 8}}; }, {"bad.json", "truncation"});
  expect_rejected([](json& j) { j["padding"] = {{"length", 8}}; }, {"bad.json", "padding"});
  expect_rejected([](json& j) { j["version"] = "2.0"; }, {"bad.json", "version", "2.0"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Whitespace"}};
      },
      {"bad.json", "pre_tokenizer", "Whitespace"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Sequence"},
                              {"pretokenizers", {{{"type", "ByteLevel"}}, {{"type", "Digits"}}}}};
      },
      {"bad.json", "pre_tokenizer.pretokenizers[1]", "Digits"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(ab"}}}, {"behavior", "Isolated"}};
      },
      {"bad.json", "pre_tokenizer.pattern", "(ab", "does not compile"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}};
      },
      {"bad.json", "pre_tokenizer.behavior", "Sideways"});
  expect_rejected(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Glob", "a"}}}, {"behavior", "Isolated"}};
      },
      {"bad.json", "pre_tokenizer.pattern", "Glob"});
  expect_rejected(
      [](json& j) {
        j["decoder"] = {{"type", "WordPiece"}};
      },
      {"bad.json", "decoder", "WordPiece"});
  expect_rejected(
      [](json& j) {
        j["post_processor"] = {{"type", "RobertaProcessing"}};
      },
      {"bad.json", "post_processor", "RobertaProcessing"});
  expect_rejected(
      [](json& j) {
        j["post_processor"] = {{"type", "TemplateProcessing"},
                               {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}}},
                               {"special_tokens", json::object()}};
      },
      {"bad.json", "post_processor", "'<s>'"});
  expect_rejected([](json& j) { j["added_tokens"][0]["id"] = 300; },
                  {"bad.json", "added_tokens[0]", "id 300", "259"});
  expect_rejected([](json& j) { j["added_tokens"][0]["content"] = ""; },
                  {"bad.json", "added_tokens[0]", "empty"});
  expect_rejected([](json& j) { j["added_tokens"].push_back(j["added_tokens"][0]); },
                  {"bad.json", "added_tokens[1]", "twice"});
  expect_rejected([](json& j) { j["added_tokens"][0]["content"] = "he"; },
                  {"bad.json", "added_tokens[0]", "256"});
  expect_rejected([](json& j) { j["added_tokens"][0].erase("id"); }, {"bad.json", "added_tokens[0]", "'id'"});
  expect_rejected([](json& j) { j = json::array(); }, {"bad.json", "JSON object"});
  expect_rejected([](json& j) { j["comment"] = "bad \xFF byte"; }, {"bad.json", "malformed"});

  testing::TokenizerTempDir dir;
  std::ofstream(dir / "broken.json") << "{\"model\": [1, 2";
  expect_error_containing([&] { Tokenizer::from_file(dir / "broken.json"); },
                          {"broken.json", "not valid JSON"});
  expect_error_containing([&] { Tokenizer::from_file(dir / "missing.json"); },
                          {"missing.json", "cannot open"});
  expect_error_containing([&] { Tokenizer::from_json_text("[1,", "inline"); }, {"inline", "not valid JSON"});
}

// Forms the reference accepts beside the common ones (checked with tokenizers 0.23.2): a model without
// "type", a "#version" line among "a b" merges, BPE dropout 0, and a duplicated merge keeping its last
// rank (so "abc" with merges [a b, b c, a b] becomes a + bc).
TEST(Tokenizer, AcceptsAlternativeForms) {
  json j = small_tokenizer_json();
  j["model"].erase("type");
  j["model"]["dropout"] = 0.0;
  j["model"]["merges"] = json::array({"#version: 0.2", "h e", "l l", "he ll"});
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair",
       {{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
      {"special_tokens",
       {{"<|endoftext|>", {{"id", "<|endoftext|>"}, {"ids", {259}}, {"tokens", {"<|endoftext|>"}}}}}}};
  const Tokenizer t = Tokenizer::from_json(j, "alt");
  EXPECT_EQ(t.encode("hello", true), (std::vector<int32_t>{259, 258, 'o'}));
  EXPECT_EQ(t.decode(t.encode("hello", true), true), "hello");
  // Template strings are not read from tokenizer.json by the reference, nor is a template without "pair".
  json strings = j;
  strings["post_processor"]["single"] = "<|endoftext|> $A";
  expect_error_containing([&] { Tokenizer::from_json(strings, "t.json"); },
                          {"t.json", "post_processor.single"});
  json no_pair = j;
  no_pair["post_processor"].erase("pair");
  expect_error_containing([&] { Tokenizer::from_json(no_pair, "t.json"); },
                          {"t.json", "post_processor", "'pair'"});
  json mixed = j;
  mixed["model"]["merges"] = json::array({"h e", json::array({"l", "l"})});
  expect_error_containing([&] { Tokenizer::from_json(mixed, "t.json"); }, {"t.json", "merges[1]", "mixes"});

  json dup = small_tokenizer_json();
  dup["model"]["vocab"] = {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}};
  dup["model"]["merges"] = json::array({"a b", "b c", "a b"});
  dup["added_tokens"] = json::array();
  dup["pre_tokenizer"] = nullptr;
  dup["decoder"] = nullptr;
  const Tokenizer d = Tokenizer::from_json(dup, "dup");
  EXPECT_EQ(d.encode("abc"), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(d.decode(d.encode("abc")), "a bc");  // no decoder: tokens joined by spaces
}

}  // namespace
}  // namespace forge::tokenizer_test
