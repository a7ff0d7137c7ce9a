// forge data preprocess / info, run as the real binary: JSONL and text inputs become an indexed dataset
// whose documents are exactly the tokenizer's encoding plus the end-of-document id, independent of the
// worker count; malformed input is one "forge: error:" line naming file:line and leaves no dataset.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/data/text/indexed_dataset.h"
#include "forge/data/tokenizer/chat_template.h"
#include "forge/data/tokenizer/tokenizer.h"
#include "tools/cli_harness.h"

namespace forge::data_cli_test {
using namespace forge::data;
namespace {
namespace fs = std::filesystem;
using testing::cli::expect_one_line_error;
using testing::cli::Outcome;
using testing::cli::read_file;
using testing::cli::run_forge;

std::vector<int32_t> document_tokens(const IndexedDataset& data, int64_t document) {
  const auto [first, last] = data.document_sequences(document);
  std::vector<int32_t> out;
  for (int64_t s = first; s < last; ++s) {
    std::vector<int32_t> t(static_cast<size_t>(data.sequence_length(s)));
    data.read_tokens(s, 0, static_cast<int64_t>(t.size()), t.data());
    out.insert(out.end(), t.begin(), t.end());
  }
  return out;
}

class DataCli : public testing::cli::ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    // A small byte-level BPE tokenizer with <|endoftext|>, trained by forge itself.
    write(
        "train.txt",
        "In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void.\n"
        "And God said, Let there be light: and there was light.\n");
    Outcome o = run_forge("tokenizer train --input " + path("train.txt") +
                          " --vocab-size 300 --special-token "
                          "'<|endoftext|>' --output " +
                          path("tok.json"));
    ASSERT_EQ(o.status, 0) << o.output;
  }
};

TEST_F(DataCli, PreprocessJsonlAndTextDeterministically) {
  const std::vector<std::string> texts = {"And God saw the light, that it was good.", "",
                                          "caf\xc3\xa9 \xe2\x80\x94 na\xc3\xafve \"quoted\"\nsecond line",
                                          "the earth"};
  std::string jsonl;
  for (size_t i = 0; i < texts.size(); ++i) {
    jsonl += nlohmann::json{{"id", i}, {"text", texts[i]}}.dump() + "\n";
    if (i == 1) jsonl += "   \n";  // blank lines are skipped
  }
  write("a.jsonl", jsonl);
  write("b.txt", "First paragraph,\nstill first.\n\n\nSecond paragraph.\n");

  Outcome o = run_forge("data preprocess --input " + path("a.jsonl") + " " + path("b.txt") +
                        " --split-documents blank-lines --workers 3 --output-prefix " + path("out/corpus") +
                        " --tokenizer " + path("tok.json"));
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("5 documents (1 more skipped: no tokens)"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("tokens/s"), std::string::npos) << o.output;

  const Tokenizer tokenizer = Tokenizer::from_file(path("tok.json"));
  const int32_t eos = *tokenizer.eos_id();
  const std::vector<std::string> documents = {texts[0], texts[2], texts[3], "First paragraph,\nstill first.",
                                              "Second paragraph."};
  IndexedDataset data(path("out/corpus"));
  EXPECT_EQ(data.dtype(), IndexedDType::u16);
  ASSERT_EQ(data.num_documents(), 5);
  EXPECT_EQ(data.num_sequences(), 5);
  int64_t total = 0;
  for (size_t d = 0; d < documents.size(); ++d) {
    std::vector<int32_t> expected = tokenizer.encode(documents[d]);
    expected.push_back(eos);
    EXPECT_EQ(document_tokens(data, static_cast<int64_t>(d)), expected) << "document " << d;
    total += static_cast<int64_t>(expected.size());
  }
  EXPECT_EQ(data.total_tokens(), total);

  // One worker writes the same bytes.
  Outcome serial = run_forge("data preprocess --input " + path("a.jsonl") + " " + path("b.txt") +
                             " --split-documents blank-lines --output-prefix " + path("serial") +
                             " --tokenizer " + path("tok.json"));
  ASSERT_EQ(serial.status, 0) << serial.output;
  EXPECT_EQ(read_file(path("serial.bin")), read_file(path("out/corpus.bin")));
  EXPECT_EQ(read_file(path("serial.idx")), read_file(path("out/corpus.idx")));

  Outcome info = run_forge("data info --json --data " + path("out/corpus"));
  ASSERT_EQ(info.status, 0) << info.output;
  const auto summary = nlohmann::json::parse(info.output);
  EXPECT_EQ(summary["documents"], 5);
  EXPECT_EQ(summary["tokens"], total);
  EXPECT_EQ(summary["dtype"], "uint16");
}

TEST_F(DataCli, TextSplitsJsonKeyAndNoEod) {
  write("c.txt", "line one\n\nline two\r\nline three");
  write("d.jsonl", "{\"content\": \"alpha\"}\n{\"content\": \"beta\"}\n");
  Outcome o = run_forge("data preprocess --input " + path("c.txt") + " " + path("d.jsonl") +
                        " --split-documents lines --json-key content --no-append-eod --output-prefix " +
                        path("lines") + " --tokenizer " + path("tok.json"));
  ASSERT_EQ(o.status, 0) << o.output;
  const Tokenizer tokenizer = Tokenizer::from_file(path("tok.json"));
  IndexedDataset data(path("lines"));
  const std::vector<std::string> documents = {"line one", "line two", "line three", "alpha", "beta"};
  ASSERT_EQ(data.num_documents(), 5);
  for (size_t d = 0; d < documents.size(); ++d)
    EXPECT_EQ(document_tokens(data, static_cast<int64_t>(d)), tokenizer.encode(documents[d])) << d;

  // The default for text is one document per file.
  Outcome whole = run_forge("data preprocess --input " + path("c.txt") + " --output-prefix " + path("whole") +
                            " --tokenizer " + path("tok.json"));
  ASSERT_EQ(whole.status, 0) << whole.output;
  IndexedDataset one(path("whole"));
  ASSERT_EQ(one.num_documents(), 1);
  std::vector<int32_t> expected = tokenizer.encode(read_file(path("c.txt")));
  expected.push_back(*tokenizer.eos_id());
  EXPECT_EQ(document_tokens(one, 0), expected);
}

TEST_F(DataCli, MalformedJsonlNamesFileAndLine) {
  write("bad.jsonl", "{\"text\": \"fine\"}\n\n{\"text\": \"broken\n{\"text\": \"after\"}\n");
  expect_one_line_error("data preprocess --input " + path("bad.jsonl") + " --output-prefix " + path("bad") +
                            " --tokenizer " + path("tok.json"),
                        path("bad.jsonl") + ":3: malformed JSON");
  EXPECT_FALSE(fs::exists(path("bad.bin")));
  EXPECT_FALSE(fs::exists(path("bad.idx")));
  EXPECT_FALSE(fs::exists(path("bad.bin.tmp")));

  write("nokey.jsonl", "{\"text\": \"fine\"}\n{\"body\": \"x\"}\n");
  expect_one_line_error("data preprocess --input " + path("nokey.jsonl") + " --output-prefix " +
                            path("nokey") + " --tokenizer " + path("tok.json"),
                        path("nokey.jsonl") + ":2: the object has no \"text\" field");
  write("number.jsonl", "{\"text\": 5}\n");
  expect_one_line_error("data preprocess --input " + path("number.jsonl") + " --output-prefix " + path("n") +
                            " --tokenizer " + path("tok.json"),
                        "number.jsonl:1: field \"text\" is number, not a string");
  write("array.jsonl", "[1, 2]\n");
  expect_one_line_error("data preprocess --input " + path("array.jsonl") + " --output-prefix " + path("n") +
                            " --tokenizer " + path("tok.json"),
                        "array.jsonl:1: expected a JSON object");
  EXPECT_FALSE(fs::exists(path("n.idx")));
}

TEST_F(DataCli, BadArguments) {
  write("ok.txt", "text\n");
  expect_one_line_error("data preprocess --input " + path("missing.txt") + " --output-prefix " + path("x") +
                            " --tokenizer " + path("tok.json"),
                        "missing.txt");
  expect_one_line_error("data preprocess --input " + path("ok.txt") + " --output-prefix " + path("x") +
                            " --tokenizer " + path("tok.json") + " --split-documents words",
                        "words");
  expect_one_line_error("data preprocess --input " + path("ok.txt") + " --tokenizer " + path("tok.json"),
                        "--output-prefix");
  expect_one_line_error("data preprocess --input " + path("ok.txt") + " --output-prefix " + path("x") +
                            " --tokenizer " + path("tok.json") + " --workers 0",
                        "workers");
  // A tokenizer without an end-of-sequence token cannot append one.
  Outcome o = run_forge("tokenizer train --input " + path("ok.txt") + " --vocab-size 260 --output " +
                        path("noeos.json"));
  ASSERT_EQ(o.status, 0) << o.output;
  expect_one_line_error("data preprocess --input " + path("ok.txt") + " --output-prefix " + path("x") +
                            " --tokenizer " + path("noeos.json"),
                        "--no-append-eod");
  Outcome without = run_forge("data preprocess --input " + path("ok.txt") + " --output-prefix " + path("x") +
                              " --tokenizer " + path("noeos.json") + " --no-append-eod");
  EXPECT_EQ(without.status, 0) << without.output;

  // data info validates the dataset.
  std::ofstream(path("x.idx"), std::ios::binary | std::ios::app) << "junk";
  expect_one_line_error("data info --data " + path("x"), path("x.idx"));
}

// forge data synth-qa: every KJV verse as a question naming its book, 5% held out from every book, and a
// chat template that renders them (with the tokenizer's <|endoftext|> ending each answer).
TEST_F(DataCli, SynthQaWritesTheVersesAsQuestions) {
  const Outcome o = run_forge("data synth-qa --out " + path("qa"));
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("(31102 verses, 66 books)"), std::string::npos) << o.output;
  auto lines = [&](const std::string& name) {
    std::vector<nlohmann::ordered_json> rows;
    std::ifstream in(dir_ / "qa" / name);
    for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::ordered_json::parse(line));
    return rows;
  };
  const auto train = lines("train.jsonl"), heldout = lines("heldout.jsonl");
  EXPECT_EQ(train.size() + heldout.size(), 31102u);
  EXPECT_NEAR(static_cast<double>(heldout.size()) / 31102, 0.05, 0.005);
  EXPECT_EQ(train.front()["id"], "Genesis 1:1");
  EXPECT_EQ(train.front()["messages"][1]["content"], "Genesis");
  EXPECT_EQ(train.back()["messages"][1]["content"], "Revelation");
  const ChatTemplate chat = ChatTemplate::from_folder(dir_ / "qa");
  EXPECT_EQ(
      chat.render(train.front()["messages"]).text,
      "Question: Which book of the Bible has this verse? In the beginning God created the heaven and the "
      "earth.\nAnswer: Genesis<|endoftext|>\n");
  // The same seed, the same split.
  ASSERT_EQ(run_forge("data synth-qa --out " + path("again")).status, 0);
  EXPECT_EQ(read_file(dir_ / "qa" / "heldout.jsonl"), read_file(dir_ / "again" / "heldout.jsonl"));
  expect_one_line_error("data synth-qa --out " + path("bad") + " --heldout 1.5", "--heldout");
}

}  // namespace
}  // namespace forge::data_cli_test
