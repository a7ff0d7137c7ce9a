// The preprocessing library with a stand-in encoder (one id per byte, plus 1): document splitting of text
// and JSONL, end-of-document ids, worker-count independence, and errors naming file:line.
#include "forge/data/text/preprocess.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "data/dataset_test_util.h"
#include "forge/core/error.h"
#include "forge/data/text/indexed_dataset.h"
#include "op_harness.h"

namespace forge::preprocess_test {
using namespace forge::data;
namespace {

using testing::DatasetTempDir;
using testing::expect_error_containing;
using testing::read_bytes;

constexpr int32_t kEod = 0;

void byte_encoder(std::string_view text, std::vector<int32_t>& out) {
  for (unsigned char c : text) out.push_back(static_cast<int32_t>(c) + 1);
}

std::vector<int32_t> encoded(std::string_view text, bool eod = true) {
  std::vector<int32_t> out;
  byte_encoder(text, out);
  if (eod) out.push_back(kEod);
  return out;
}

std::vector<std::vector<int32_t>> all_documents(const std::string& prefix) {
  IndexedDataset data(prefix);
  std::vector<std::vector<int32_t>> out;
  for (int64_t d = 0; d < data.num_documents(); ++d) {
    const auto [first, last] = data.document_sequences(d);
    EXPECT_EQ(last - first, 1);
    std::vector<int32_t> t(static_cast<size_t>(data.sequence_length(first)));
    data.read_tokens(first, 0, static_cast<int64_t>(t.size()), t.data());
    out.push_back(t);
  }
  return out;
}

class Preprocess : public ::testing::Test {
 protected:
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
    return dir_ / name;
  }
  PreprocessOptions options(std::vector<std::string> inputs, const std::string& out) {
    PreprocessOptions o;
    o.inputs = std::move(inputs);
    o.output_prefix = dir_ / out;
    o.vocab_size = 257;
    o.eod_id = kEod;
    return o;
  }
  DatasetTempDir dir_{"preprocess"};
};

TEST_F(Preprocess, TextDocumentModes) {
  const std::string text = "alpha beta\n\n  \ngamma\ndelta\r\n\nlast";
  const std::string file = write("t.txt", text);
  auto o = options({file}, "file");
  const PreprocessStats stats = preprocess_to_indexed_dataset(o, byte_encoder);
  EXPECT_EQ(all_documents(o.output_prefix), (std::vector<std::vector<int32_t>>{encoded(text)}));
  EXPECT_EQ(stats.documents, 1);
  EXPECT_EQ(stats.tokens, static_cast<int64_t>(text.size()) + 1);
  EXPECT_EQ(stats.bytes, static_cast<int64_t>(text.size()));

  o = options({file}, "lines");
  o.split = TextDocuments::lines;
  preprocess_to_indexed_dataset(o, byte_encoder);
  EXPECT_EQ(all_documents(o.output_prefix),
            (std::vector<std::vector<int32_t>>{encoded("alpha beta"), encoded("gamma"), encoded("delta"),
                                               encoded("last")}));

  o = options({file}, "paragraphs");
  o.split = text_documents_from_name("blank-lines");
  o.append_eod = false;
  preprocess_to_indexed_dataset(o, byte_encoder);
  EXPECT_EQ(all_documents(o.output_prefix),
            (std::vector<std::vector<int32_t>>{encoded("alpha beta", false), encoded("gamma\ndelta", false),
                                               encoded("last", false)}));
  expect_error_containing([] { text_documents_from_name("words"); }, {"words", "blank-lines"});
}

TEST_F(Preprocess, JsonlInOrderForAnyWorkerCount) {
  std::string jsonl;
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < 9000; ++i) {  // more than one batch (8192 documents) of small documents
    const std::string text =
        std::string(static_cast<size_t>(i % 17), static_cast<char>('a' + i % 26)) + std::to_string(i);
    jsonl += "{\"meta\": " + std::to_string(i) + ", \"body\": \"" + text + "\"}\n";
    expected.push_back(encoded(text));
  }
  const std::string a = write("a.jsonl", jsonl), b = write("b.json", "\n{\"body\": \"tail\"}\n\n");
  expected.push_back(encoded("tail"));
  auto one = options({a, b}, "one");
  one.json_key = "body";
  preprocess_to_indexed_dataset(one, byte_encoder);
  auto four = options({a, b}, "four");
  four.json_key = "body";
  four.workers = 4;
  const PreprocessStats stats = preprocess_to_indexed_dataset(four, byte_encoder);
  EXPECT_EQ(stats.documents, 9001);
  EXPECT_EQ(all_documents(four.output_prefix), expected);
  EXPECT_EQ(read_bytes(one.output_prefix + ".bin"), read_bytes(four.output_prefix + ".bin"));
  EXPECT_EQ(read_bytes(one.output_prefix + ".idx"), read_bytes(four.output_prefix + ".idx"));
  EXPECT_EQ(IndexedDataset(four.output_prefix).dtype(), IndexedDType::u16);
}

TEST_F(Preprocess, EmptyDocumentsAreSkippedAndWideVocabulariesUseInt32) {
  const std::string f = write("e.jsonl", "{\"text\": \"\"}\n{\"text\": \"x\"}\n");
  auto o = options({f}, "e");
  o.vocab_size = 100000;
  const PreprocessStats stats = preprocess_to_indexed_dataset(o, byte_encoder);
  EXPECT_EQ(stats.documents, 1);
  EXPECT_EQ(stats.empty_documents, 1);
  EXPECT_EQ(IndexedDataset(o.output_prefix).dtype(), IndexedDType::i32);
  EXPECT_EQ(all_documents(o.output_prefix), (std::vector<std::vector<int32_t>>{encoded("x")}));
}

TEST_F(Preprocess, ErrorsNameFileAndLineAndLeaveNoDataset) {
  const std::string bad = write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": oops}\n");
  auto o = options({bad}, "bad");
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); },
                          {bad + ":2:", "malformed JSON"});
  EXPECT_FALSE(std::filesystem::exists(o.output_prefix + ".bin"));
  EXPECT_FALSE(std::filesystem::exists(o.output_prefix + ".idx"));
  EXPECT_FALSE(std::filesystem::exists(o.output_prefix + ".bin.tmp"));

  o = options({write("k.jsonl", "{\"txt\": \"a\"}\n")}, "k");
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); },
                          {"k.jsonl:1:", "\"text\""});
  o = options({write("s.jsonl", "\"just a string\"\n")}, "s");
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); }, {"s.jsonl:1:", "object"});

  // An id outside the vocabulary names the document.
  o = options({write("v.txt", "a\nb\n\xff\n")}, "v");
  o.split = TextDocuments::lines;
  o.vocab_size = 200;
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); },
                          {"v.txt:3", "256", "[0, 200)"});
  // An encoder failure names the document.
  o = options({write("w.txt", "fine\nboom\n")}, "w");
  o.split = TextDocuments::lines;
  o.workers = 2;
  auto throwing = [](std::string_view text, std::vector<int32_t>& out) {
    if (text == "boom") throw Error("cannot encode this");
    byte_encoder(text, out);
  };
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, throwing); },
                          {"w.txt:2", "cannot encode this"});

  o = options({dir_ / "missing.txt"}, "m");
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); },
                          {"missing.txt", "no such file"});
  o = options({write("z.txt", "z")}, "z");
  o.eod_id.reset();
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); }, {"end-of-document"});
  o.eod_id = 257;
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); }, {"257", "outside"});
  o = options({write("blank.jsonl", "\n\n")}, "blank");
  expect_error_containing([&] { preprocess_to_indexed_dataset(o, byte_encoder); }, {"no non-empty document"});
  EXPECT_FALSE(std::filesystem::exists(o.output_prefix + ".idx"));
}

}  // namespace
}  // namespace forge::preprocess_test
