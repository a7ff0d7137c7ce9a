// Supervised fine-tuning conversations: the token ids and the assistant-token mask of each conversation equal
// transformers' (fixtures from tests/reference/chat_template_golden.py: return_assistant_tokens_mask for a
// template with {% generation %} blocks, the prefix rule over tokenizers' offsets for Qwen2.5's, Qwen3's and
// Mistral's templates, which have none, Qwen3's earlier turns ending at its eos_token); the JSONL reader's
// samples, ShareGPT alias, truncation, skips and one-line errors.
#include "forge/data/text/sft_data.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer_test_util.h"
#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::sft_data_test {
using namespace forge::data;
namespace {

using nlohmann::ordered_json;
using testing::expect_error_containing;

ordered_json fixture_json(const std::string& name) {
  return ordered_json::parse(testing::read_file(testing::fixture(name)));
}

TEST(SftMasks, EqualTransformersAssistantTokens) {
  int compared = 0, refused = 0;
  for (const ordered_json& setup : fixture_json("chat/sft_masks.json")) {
    const std::string name = setup["name"].get<std::string>();
    const ChatTemplate chat = ChatTemplate::from_tokenizer_config(setup["tokenizer_config"], name);
    const Tokenizer tokenizer = Tokenizer::from_file(testing::fixture(setup["tokenizer"].get<std::string>()));
    for (const ordered_json& c : setup["cases"]) {
      SCOPED_TRACE(name + " " + c["name"].get<std::string>());
      if (c.contains("error")) {
        EXPECT_THROW(tokenize_conversation(chat, tokenizer, c["messages"], c["tools"], false), Error);
        ++refused;
        continue;
      }
      const SftConversation got = tokenize_conversation(chat, tokenizer, c["messages"], c["tools"], false);
      EXPECT_EQ(got.ids, c["ids"].get<std::vector<int32_t>>());
      EXPECT_EQ(std::vector<int>(got.trained.begin(), got.trained.end()), c["mask"].get<std::vector<int>>());
      // Every token trains with the loss on all of them.
      const SftConversation all = tokenize_conversation(chat, tokenizer, c["messages"], c["tools"], true);
      EXPECT_EQ(all.ids, got.ids);
      EXPECT_EQ(std::count(all.trained.begin(), all.trained.end(), 1), static_cast<long>(all.ids.size()));
      ++compared;
    }
  }
  EXPECT_EQ(compared, 19);
  EXPECT_EQ(refused, 1);  // Mistral's template refuses a tool turn itself
}

class SftFile : public ::testing::Test {
 protected:
  void SetUp() override {
    const ordered_json setups = fixture_json("chat/sft_masks.json");
    for (const ordered_json& s : setups)
      if (s["name"] == "chatml_generation") config_ = s["tokenizer_config"];
    tokenizer_ = std::make_unique<Tokenizer>(
        Tokenizer::from_file(testing::tokenizer_fixture("families/qwen3.tokenizer.json")));
  }
  std::filesystem::path write(const std::string& text) {
    const auto path = dir_ / "sft.jsonl";
    std::ofstream(path) << text;
    return path;
  }
  SftDataset open(const std::filesystem::path& path, int64_t seq_len, bool skip_bad = false) const {
    SftOptions o;
    o.seq_len = seq_len, o.skip_bad = skip_bad;
    return SftDataset::from_jsonl(path, ChatTemplate::from_tokenizer_config(config_, "chatml"), *tokenizer_,
                                  o);
  }
  testing::TokenizerTempDir dir_;
  ordered_json config_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

// A conversation's sample: its ids padded with the pad token; targets the next token where that token is the
// assistant's, else -1. ShareGPT's conversations read as the same messages.
TEST_F(SftFile, SamplesTrainOnTheAssistantAndShareGptIsAnAlias) {
  const auto path = write(
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})"
      "\n\n"
      R"({"id": 7, "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]})"
      "\n");
  const SftDataset set = open(path, 40);
  ASSERT_EQ(set.size(), 2);
  EXPECT_EQ(set.lines(), 2);
  EXPECT_EQ(set.conversation(0).ids, set.conversation(1).ids);
  EXPECT_EQ(set.conversation(1).line, 3);
  std::vector<int32_t> ids(40), targets(40);
  set.fill(0, ids.data(), targets.data());
  const SftConversation& c = set.conversation(0);
  const std::string text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n";
  EXPECT_EQ(c.ids, tokenizer_->encode(text));
  const std::string answer = "Hello<|im_end|>";
  const size_t n = c.ids.size(), trained = tokenizer_->encode(answer).size();
  int64_t count = 0;
  for (size_t t = 0; t < 40; ++t) {
    EXPECT_EQ(ids[t], t < n ? c.ids[t] : *tokenizer_->token_to_id("<|endoftext|>")) << t;
    if (targets[t] >= 0) {
      EXPECT_EQ(targets[t], c.ids[t + 1]);
      ++count;
    }
  }
  EXPECT_EQ(count, static_cast<int64_t>(trained));
  EXPECT_EQ(set.trained_tokens(), 2 * count);
  // The last trained target is <|im_end|>, the end of the answer.
  EXPECT_EQ(targets[n - 3], *tokenizer_->token_to_id("<|im_end|>"));
}

// Packing: conversations join a sequence while they fit, in the given order; each sequence holds them one
// after another with their own targets (none across a boundary), the padding last, and the documents'
// lengths.
TEST_F(SftFile, PacksConversationsWithTheirDocuments) {
  std::string text;
  for (int i = 0; i < 5; ++i)
    text += R"({"messages": [{"role": "user", "content": "Q)" + std::to_string(i) +
            R"("}, {"role": "assistant", "content": ")" + std::string(static_cast<size_t>(1 + 3 * i), 'x') +
            R"("}]})" + "\n";
  const SftDataset set = open(write(text), 40);
  ASSERT_EQ(set.size(), 5);
  const std::vector<std::vector<int64_t>> packs = set.pack({4, 0, 1, 2, 3});
  int64_t packed = 0;
  for (const auto& p : packs) {
    int64_t used = 0;
    for (const int64_t i : p) used += set.positions(i), ++packed;
    EXPECT_LE(used, 40);
  }
  EXPECT_EQ(packed, 5);
  EXPECT_EQ(packs[0][0], 4);
  std::vector<int32_t> ids(40), targets(40), one_ids(40), one_targets(40);
  std::vector<int64_t> documents;
  set.fill_packed(packs.back(), ids.data(), targets.data());
  set.packed_documents(packs.back(), documents);
  int64_t at = 0;
  for (size_t d = 0; d < packs.back().size(); ++d) {
    const int64_t i = packs.back()[d], n = set.positions(i);
    EXPECT_EQ(documents[d], n);
    set.fill(i, one_ids.data(), one_targets.data());
    for (int64_t t = 0; t < n; ++t) {
      EXPECT_EQ(ids[at + t], one_ids[t]);
      EXPECT_EQ(targets[at + t], one_targets[t]);  // the last token of a conversation predicts nothing
    }
    at += n;
  }
  if (at < 40) {
    EXPECT_EQ(documents.back(), 40 - at);
  }
  for (int64_t t = at; t < 40; ++t) EXPECT_EQ(targets[t], -1);
}

// Longer conversations are cut to seq_len + 1 tokens and counted; those left without a trained token (the
// answer cut off, or no assistant turn) are skipped and counted.
TEST_F(SftFile, TruncatesAndSkipsWhatTrainsNothing) {
  const auto path = write(
      R"({"messages": [{"role": "user", "content": "A question that is long enough to be cut here"}, {"role": "assistant", "content": "x"}]})"
      "\n"
      R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A fairly long answer that runs past the end"}]})"
      "\n"
      R"({"messages": [{"role": "user", "content": "only a question"}]})"
      "\n");
  const SftDataset set = open(path, 12);
  EXPECT_EQ(set.size(), 1);
  EXPECT_EQ(set.truncated(), 2);
  EXPECT_EQ(set.skipped_untrained(), 2);
  EXPECT_EQ(set.conversation(0).ids.size(), 13u);
}

// Bad lines are one error naming the file and the line, or skipped and counted with skip_bad.
TEST_F(SftFile, BadLinesNameTheLineOrAreSkipped) {
  const std::string good =
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", "invalid JSON"},
      {R"({"mesages": []})", "did you mean 'messages'"},
      {R"({"messages": [], "conversations": []})", "both"},
      {R"({"conversations": [{"from": "bot", "value": "x"}]})", "'from' is 'bot'"},
      {R"({"messages": []})", "non-empty"},
      {R"([1, 2])", "JSON object"},
  };
  for (const auto& [line, words] : bad) {
    SCOPED_TRACE(line);
    const auto path = write(good + "\n" + line + "\n");
    expect_error_containing([&] { open(path, 32); }, {"sft.jsonl:2", words});
    const SftDataset set = open(path, 32, true);
    EXPECT_EQ(set.size(), 1);
    EXPECT_EQ(set.skipped_bad(), 1);
    ASSERT_EQ(set.skip_reasons().size(), 1u);
    EXPECT_NE(set.skip_reasons()[0].find("sft.jsonl:2"), std::string::npos);
  }
  expect_error_containing([&] { open(write("{not json\n"), 32, true); }, {"no usable conversation"});
  expect_error_containing([&] { open(dir_ / "missing.jsonl", 32); }, {"missing.jsonl", "cannot be read"});
}

}  // namespace
}  // namespace forge::sft_data_test
