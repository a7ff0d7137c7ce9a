// forge tokenizer train / encode / decode / chat, run as the real binary.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/data/tokenizer/tokenizer.h"
#include "tools/cli_harness.h"
using namespace forge::data;

namespace forge::tokenizer_cli_test {
namespace {
namespace fs = std::filesystem;
using forge::testing::cli::expect_one_line_error;
using forge::testing::cli::Outcome;
using forge::testing::cli::run_forge;
using forge::testing::cli::Stderr;

// For output compared byte for byte: stdout alone, stderr dropped.
const forge::testing::cli::RunOptions kStdoutOnly = [] {
  forge::testing::cli::RunOptions options;
  options.stderr_to = Stderr::discarded;
  return options;
}();

std::string quote(const fs::path& p) {
  std::string quoted(1, '\'');
  quoted.append(p.string());
  quoted.push_back('\'');
  return quoted;
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids) {
    if (!out.empty()) out.push_back(' ');
    out.append(std::to_string(id));
  }
  return out;
}

class TokenizerCli : public forge::testing::cli::ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    corpus_ = fs::path(FORGE_FIXTURE_DIR) / "tokenizer" / "corpus.txt";
    fixture_ = fs::path(FORGE_FIXTURE_DIR) / "tokenizer" / "llama3_style.tokenizer.json";
  }
  fs::path corpus_, fixture_;
};

TEST_F(TokenizerCli, TrainPrintsStatsAndWritesALoadableTokenizer) {
  const fs::path out = dir_ / "tok.json";
  const Outcome o =
      run_forge("tokenizer train --input " + quote(corpus_) + " --vocab-size 400 --output " + quote(out) +
                " --pattern llama3 --special-token '<|begin_of_text|>' --special-token '<|end_of_text|>'" +
                " --bos-token '<|begin_of_text|>'");
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("400-token vocabulary"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("267 lines"), std::string::npos) << o.output;
  const forge::data::Tokenizer t = forge::data::Tokenizer::from_file(out);
  EXPECT_EQ(t.vocab_size(), 400);
  EXPECT_EQ(t.bos_id(), 0);
  EXPECT_EQ(t.eos_id(), 1);
}

TEST_F(TokenizerCli, EncodeAndDecodeRoundTrip) {
  const forge::data::Tokenizer t = forge::data::Tokenizer::from_file(fixture_);
  const std::string text = "In the beginning God created the heaven 中文 👍🏽\n";
  const std::string expected = join_ids(t.encode(text));

  const fs::path input = write("in.txt", text);
  const Outcome from_stdin =
      run_forge("tokenizer encode --tokenizer " + quote(fixture_) + " < " + quote(input), kStdoutOnly);
  ASSERT_EQ(from_stdin.status, 0);
  EXPECT_EQ(from_stdin.output, expected + "\n");

  const Outcome from_flag =
      run_forge("tokenizer encode --tokenizer " + quote(fixture_) + " --text 'Hello world'", kStdoutOnly);
  const std::string hello = join_ids(t.encode("Hello world"));
  EXPECT_EQ(from_flag.output, hello + "\n");

  const Outcome special = run_forge(
      "tokenizer encode --tokenizer " + quote(fixture_) + " --add-special-tokens --text Hi", kStdoutOnly);
  EXPECT_EQ(special.output.rfind(std::to_string(*t.bos_id()) + " ", 0), 0u) << special.output;

  const fs::path ids = write("ids.txt", from_stdin.output);
  const Outcome decoded =
      run_forge("tokenizer decode --tokenizer " + quote(fixture_) + " < " + quote(ids), kStdoutOnly);
  ASSERT_EQ(decoded.status, 0);
  EXPECT_EQ(decoded.output, text);  // exactly, no newline added
  const Outcome from_args =
      run_forge("tokenizer decode --tokenizer " + quote(fixture_) + " " + hello, kStdoutOnly);
  EXPECT_EQ(from_args.output, "Hello world");
  const Outcome skip = run_forge("tokenizer decode --skip-special-tokens --tokenizer " + quote(fixture_) +
                                     " " + special.output.substr(0, special.output.size() - 1),
                                 kStdoutOnly);
  EXPECT_EQ(skip.output, "Hi");
}

TEST_F(TokenizerCli, ErrorsAreOneLine) {
  expect_one_line_error("tokenizer decode --tokenizer " + quote(fixture_) + " 12 abc",
                        "'abc' is not a token id");
  expect_one_line_error("tokenizer decode --tokenizer " + quote(fixture_) + " 99999", "id 99999");
  const fs::path broken = write("broken.json", "{ not json");
  expect_one_line_error("tokenizer encode --tokenizer " + quote(broken) + " --text x", "broken.json");
  const fs::path bad_utf8 = write("bad.txt", "ok \xFF no");
  expect_one_line_error("tokenizer encode --tokenizer " + quote(fixture_) + " < " + quote(bad_utf8),
                        "not valid UTF-8");
  expect_one_line_error(
      "tokenizer train --input " + quote(corpus_) + " --vocab-size 10 --output " + quote(dir_ / "x.json"),
      "vocab_size 10");
  EXPECT_NE(run_forge("tokenizer").status, 0);
  EXPECT_NE(run_forge("tokenizer encode --text x").status, 0);  // --tokenizer is required
  EXPECT_EQ(run_forge("tokenizer --help").status, 0);
}

// forge tokenizer chat renders a conversation as transformers does (the Qwen3 fixture's conversation with
// tools, from a tokenizer_config.json and from a folder), takes variables and the generation prompt, prints
// the rendering's ids with a tokenizer, and refuses bad input in one line.
TEST_F(TokenizerCli, ChatRendersAsTransformers) {
  const auto fixture = nlohmann::ordered_json::parse(
      forge::testing::cli::read_file(fs::path(FORGE_FIXTURE_DIR) / "chat" / "qwen3.json"));
  const fs::path config = dir_ / "tokenizer_config.json";
  std::ofstream(config) << fixture["tokenizer_config"].dump();
  for (const auto& c : fixture["cases"]) {
    const std::string name = c["name"].get<std::string>();
    if (name != "tools" && name != "thinking_off") continue;
    SCOPED_TRACE(name);
    const fs::path messages = dir_ / (name + ".json");
    nlohmann::ordered_json row;
    row["messages"] = c["messages"];
    if (c["options"].contains("tools")) row["tools"] = c["options"]["tools"];
    std::ofstream(messages) << row.dump();
    std::string args = "tokenizer chat --template " + quote(config) + " --messages " + quote(messages);
    if (c["options"].value("add_generation_prompt", false)) args += " --add-generation-prompt";
    if (c["options"].contains("enable_thinking")) args += " --var enable_thinking=false";
    const Outcome o = run_forge(args, kStdoutOnly);
    ASSERT_EQ(o.status, 0) << o.output;
    EXPECT_EQ(o.output, c["text"].get<std::string>());
    // The folder form, the messages on standard input.
    const Outcome from_dir =
        run_forge("tokenizer chat --template " + quote(dir_) + " " +
                      (name == "thinking_off" ? "--add-generation-prompt --var enable_thinking=false" : "") +
                      " < " + quote(messages),
                  kStdoutOnly);
    EXPECT_EQ(from_dir.output, c["text"].get<std::string>());
  }
  // Token ids of the rendering (no special tokens added, as apply_chat_template(tokenize=True)).
  const fs::path tokenizer = fs::path(FORGE_FIXTURE_DIR) / "tokenizer" / "families" / "qwen3.tokenizer.json";
  const fs::path hi = dir_ / "hi.json";
  std::ofstream(hi) << R"([{"role": "user", "content": "Hello"}])";
  const Outcome ids = run_forge("tokenizer chat --template " + quote(config) + " --messages " + quote(hi) +
                                    " --tokenizer " + quote(tokenizer),
                                kStdoutOnly);
  ASSERT_EQ(ids.status, 0) << ids.output;
  const std::string text = "<|im_start|>user\nHello<|im_end|>\n";
  EXPECT_EQ(ids.output, join_ids(Tokenizer::from_file(tokenizer).encode(text)) + "\n");
  // --mask: the ids, then the assistant tokens fine-tuning trains on (Qwen2.5's template, the prefix rule).
  const auto sft = nlohmann::ordered_json::parse(
      forge::testing::cli::read_file(fs::path(FORGE_FIXTURE_DIR) / "chat" / "sft_masks.json"));
  for (const auto& setup : sft) {
    if (setup["name"] != "qwen2_5") continue;
    const fs::path qwen = dir_ / "qwen2_5.json", conversation = dir_ / "conversation.json";
    std::ofstream(qwen) << setup["tokenizer_config"].dump();
    const auto& c = setup["cases"][1];
    std::ofstream(conversation) << c["messages"].dump();
    const Outcome mask = run_forge("tokenizer chat --mask --template " + quote(qwen) + " --messages " +
                                       quote(conversation) + " --tokenizer " + quote(tokenizer),
                                   kStdoutOnly);
    ASSERT_EQ(mask.status, 0) << mask.output;
    EXPECT_EQ(mask.output, join_ids(c["ids"].get<std::vector<int32_t>>()) + "\n" +
                               join_ids(c["mask"].get<std::vector<int32_t>>()) + "\n");
  }
}

TEST_F(TokenizerCli, ChatErrorsAreOneLine) {
  const fs::path jinja = dir_ / "t.jinja", good = dir_ / "good.json", bad = dir_ / "bad.json";
  std::ofstream(jinja) << "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role "
                          "not supported') }}{% endif %}{{ m.content }}{% endfor %}";
  std::ofstream(good) << R"([{"role": "system", "content": "x"}])";
  std::ofstream(bad) << R"([{"role": "user", "content": )";
  expect_one_line_error("tokenizer chat --template " + quote(jinja) + " --messages " + quote(good),
                        "System role not supported");
  expect_one_line_error("tokenizer chat --template " + quote(jinja) + " --messages " + quote(bad),
                        "bad.json");
  expect_one_line_error("tokenizer chat --template " + quote(dir_ / "missing") + " --messages " + quote(good),
                        "missing");
  expect_one_line_error(
      "tokenizer chat --template " + quote(jinja) + " --messages " + quote(good) + " --var x", "--var 'x'");
  const fs::path broken = dir_ / "broken.jinja";
  std::ofstream(broken) << "line\n{% if %}";
  expect_one_line_error("tokenizer chat --template " + quote(broken) + " --messages " + quote(good),
                        "broken.jinja: line 2");
}

}  // namespace
}  // namespace forge::tokenizer_cli_test
