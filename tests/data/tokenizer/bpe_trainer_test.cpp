// The BPE trainer: the same merges and vocabulary as the reference's BpeTrainer (tokenizers 0.23.2,
// fixtures from tests/reference/tokenizer/generate_fixtures.js), determinism, exact vocabulary sizes,
// valid merges, special tokens, and errors.
#include "forge/data/tokenizer/bpe_trainer.h"

#include <gtest/gtest.h>

#include <set>

#include "data/tokenizer_test_util.h"
#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::bpe_trainer_test {
using namespace forge::data;
namespace {

using nlohmann::json;
using testing::expect_error_containing;
using testing::read_file;
using testing::read_json;
using testing::tokenizer_fixture;

// Trained with the reference's defaults (vocabulary 30000: until no pair is left; only the bytes seen),
// forge produces the reference's vocabulary and merges, in the same order, for both split patterns.
TEST(BpeTrainer, MatchesTheReferenceTrainer) {
  for (const char* pattern : {"gpt2", "llama3"}) {
    BpeTrainerOptions options;
    options.vocab_size = 30000;
    options.pattern = pattern;
    options.full_byte_alphabet = false;
    BpeTrainerStats stats;
    const Tokenizer trained = train_bpe_from_files({tokenizer_fixture("corpus.txt")}, options, &stats);
    const json expected =
        read_json(tokenizer_fixture(std::string("hf_trained_") + pattern + ".tokenizer.json"));
    const json got = trained.to_json();
    EXPECT_EQ(got["model"]["vocab"], expected["model"]["vocab"]) << pattern;
    ASSERT_EQ(got["model"]["merges"].size(), expected["model"]["merges"].size()) << pattern;
    EXPECT_EQ(got["model"]["merges"], expected["model"]["merges"]) << pattern;
    EXPECT_EQ(got["pre_tokenizer"], expected["pre_tokenizer"]) << pattern;
    EXPECT_LT(stats.vocab_size, 30000);  // the corpus ran out of pairs
    EXPECT_EQ(stats.vocab_size, trained.vocab_size());
  }
}

BpeTrainerOptions gpt2_fixture_options() {
  BpeTrainerOptions o;
  o.vocab_size = 1000;
  o.pattern = "gpt2";
  o.special_tokens = {"<|endoftext|>"};
  return o;
}

// The committed fixtures were written by `forge tokenizer train`; training again gives the same bytes.
TEST(BpeTrainer, ReproducesTheCommittedFixturesByteForByte) {
  testing::TokenizerTempDir dir;
  train_bpe_from_files({tokenizer_fixture("corpus.txt")}, gpt2_fixture_options()).save(dir / "gpt2.json");
  EXPECT_EQ(read_file(dir / "gpt2.json"), read_file(tokenizer_fixture("gpt2_style.tokenizer.json")));
  BpeTrainerOptions llama3;
  llama3.vocab_size = 1000;
  llama3.pattern = "llama3";
  llama3.special_tokens = {"<|begin_of_text|>", "<|end_of_text|>"};
  llama3.bos_token = "<|begin_of_text|>";
  train_bpe_from_files({tokenizer_fixture("corpus.txt")}, llama3).save(dir / "llama3.json");
  EXPECT_EQ(read_file(dir / "llama3.json"), read_file(tokenizer_fixture("llama3_style.tokenizer.json")));
}

TEST(BpeTrainer, IsDeterministicAndHitsTheVocabularySize) {
  const std::string corpus = read_file(tokenizer_fixture("corpus.txt"));
  for (int64_t size : {257, 300, 777}) {
    BpeTrainerOptions o = gpt2_fixture_options();
    o.vocab_size = size;
    BpeTrainerStats stats;
    const Tokenizer a = train_bpe(corpus, o, &stats);
    const Tokenizer b = train_bpe(std::vector<std::string>{corpus}, o);
    EXPECT_EQ(a.vocab_size(), size);
    EXPECT_EQ(stats.vocab_size, size);
    EXPECT_EQ(stats.merges, size - 257);  // 1 special token + 256 byte symbols; no token made twice here
    EXPECT_EQ(a.to_json(), b.to_json());
    EXPECT_EQ(stats.sequences, 1);
    EXPECT_GT(stats.words, stats.distinct_words);
  }
}

// Every merge joins two tokens of the vocabulary into a third, merged tokens come after their parts, all
// 256 byte symbols are there, and ids are dense.
TEST(BpeTrainer, WritesAValidVocabularyAndMerges) {
  const json j = train_bpe(read_file(tokenizer_fixture("corpus.txt")), gpt2_fixture_options()).to_json();
  const json& vocab = j["model"]["vocab"];
  std::set<int64_t> ids;
  for (const auto& [token, id] : vocab.items()) ids.insert(id.get<int64_t>());
  EXPECT_EQ(ids.size(), vocab.size());
  EXPECT_EQ(*ids.begin(), 0);
  EXPECT_EQ(*ids.rbegin(), static_cast<int64_t>(vocab.size()) - 1);
  for (int b = 0; b < 256; ++b)
    EXPECT_TRUE(vocab.contains(testing::byte_level_char(static_cast<unsigned char>(b))));
  // The reference's alphabet order: specials, then byte symbols by code point ('!' first, 'Ġ' = 221).
  EXPECT_EQ(vocab["<|endoftext|>"], 0);
  EXPECT_EQ(vocab["!"], 1);
  EXPECT_EQ(vocab["Ġ"], 221);
  int64_t rank = 0;
  for (const json& merge : j["model"]["merges"]) {
    const std::string a = merge[0], b = merge[1];
    ASSERT_TRUE(vocab.contains(a) && vocab.contains(b) && vocab.contains(a + b)) << merge.dump();
    EXPECT_GT(vocab[a + b].get<int64_t>(), std::max(vocab[a].get<int64_t>(), vocab[b].get<int64_t>()));
    EXPECT_EQ(vocab[a + b].get<int64_t>(), 257 + rank++);
  }
  EXPECT_EQ(j["added_tokens"][0]["content"], "<|endoftext|>");
  EXPECT_EQ(j["added_tokens"][0]["special"], true);
}

// Special tokens are split out of the training text before counting: their text never becomes a merge.
TEST(BpeTrainer, SpecialTokensAreNotLearnedFromText) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "a document<|endoftext|>";
  BpeTrainerOptions o = gpt2_fixture_options();
  o.vocab_size = 270;
  const Tokenizer t = train_bpe(text, o);
  for (const auto& [token, id] : t.to_json()["model"]["vocab"].items()) {
    if (token != "<|endoftext|>") {
      EXPECT_EQ(token.find("endof"), std::string::npos) << token;
    }
  }
  EXPECT_EQ(t.encode("<|endoftext|>"), std::vector<int32_t>{0});
  EXPECT_EQ(t.eos_id(), 0);
}

TEST(BpeTrainer, MinFrequencyStopsEarly) {
  BpeTrainerOptions o = gpt2_fixture_options();
  o.vocab_size = 5000;
  o.min_frequency = 50;
  BpeTrainerStats stats;
  const Tokenizer t = train_bpe(read_file(tokenizer_fixture("corpus.txt")), o, &stats);
  EXPECT_GT(stats.merges, 10);
  EXPECT_LT(stats.vocab_size, 600);
  EXPECT_EQ(t.vocab_size(), stats.vocab_size);
}

TEST(BpeTrainer, CustomPatternAndBos) {
  BpeTrainerOptions o;
  o.vocab_size = 300;
  o.pattern = "\\p{L}+|\\s+|[^\\p{L}\\s]+";
  o.special_tokens = {"<s>", "</s>"};
  o.bos_token = "<s>";
  const Tokenizer t = train_bpe(read_file(tokenizer_fixture("corpus.txt")), o);
  const json j = t.to_json();
  EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"], o.pattern);
  EXPECT_EQ(j["model"]["ignore_merges"], false);
  EXPECT_EQ(t.encode("God", true).front(), 0);
  EXPECT_EQ(t.bos_id(), 0);
  EXPECT_EQ(t.eos_id(), 1);
  EXPECT_EQ(t.decode(t.encode("And God said, Let there be light.")), "And God said, Let there be light.");
}

TEST(BpeTrainer, RejectsBadOptionsAndInput) {
  const std::string text = "some text";
  BpeTrainerOptions o;
  o.vocab_size = 100;
  expect_error_containing([&] { train_bpe(text, o); }, {"vocab_size 100", "256"});
  o.vocab_size = 300;
  o.pattern = "(unclosed";
  expect_error_containing([&] { train_bpe(text, o); }, {"(unclosed", "does not compile"});
  o.pattern = "a\xFF";
  expect_error_containing([&] { train_bpe(text, o); }, {"pattern", "not valid UTF-8"});
  o.pattern = "gpt2";
  o.bos_token = "<s>";
  expect_error_containing([&] { train_bpe(text, o); }, {"bos_token '<s>'"});
  o.bos_token.clear();
  o.special_tokens = {""};
  expect_error_containing([&] { train_bpe(text, o); }, {"special token is empty"});
  o.special_tokens.clear();
  expect_error_containing([&] { train_bpe("ok\xFF", o); }, {"training text", "not valid UTF-8"});
  testing::TokenizerTempDir dir;
  std::ofstream(dir / "bad.txt") << "fine line\nbroken \xC3 line\n";
  expect_error_containing([&] { train_bpe_from_files({dir / "bad.txt"}, o); },
                          {"bad.txt", "line 2", "not valid UTF-8"});
  expect_error_containing([&] { train_bpe_from_files({dir / "none.txt"}, o); }, {"none.txt", "cannot open"});
  expect_error_containing([&] { train_bpe_from_files({}, o); }, {"no input files"});
}

}  // namespace
}  // namespace forge::bpe_trainer_test
