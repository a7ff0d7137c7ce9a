// forge tokenizer train / encode / decode, run as the real binary.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
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

}  // namespace
}  // namespace forge::tokenizer_cli_test
