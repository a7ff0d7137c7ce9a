// Megatron indexed datasets: forge reads the reference fixtures written by an independent Python writer
// (tests/reference/megatron_indexed.py), writes byte-identical files from the same documents, round-trips
// every integer dtype, and rejects every kind of malformed pair with one line naming the file.
#include "forge/data/text/indexed_dataset.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "data/dataset_test_util.h"
#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::indexed_dataset_test {
using namespace forge::data;
namespace {

namespace fs = std::filesystem;
using testing::DatasetTempDir;
using testing::expect_error_containing;
using testing::read_bytes;
using testing::write_bytes;

const std::string kFixtures = std::string(FORGE_FIXTURE_DIR) + "/megatron";

struct ReferenceDataset {
  std::string name;
  IndexedDType dtype;
  std::vector<std::vector<std::vector<int64_t>>> documents;  // document -> sequences -> tokens
};

std::vector<ReferenceDataset> reference_datasets() {
  std::ifstream in(kFixtures + "/documents.json");
  EXPECT_TRUE(in.good()) << "missing " << kFixtures << "/documents.json";
  const nlohmann::json listing = nlohmann::json::parse(in);
  std::vector<ReferenceDataset> out;
  for (const auto& [name, spec] : listing.items()) {
    ReferenceDataset r;
    r.name = name;
    const std::string dtype = spec.at("dtype");
    r.dtype = dtype == "uint16" ? IndexedDType::u16 : IndexedDType::i32;
    EXPECT_TRUE(dtype == "uint16" || dtype == "int32") << dtype;
    r.documents = spec.at("documents").get<std::vector<std::vector<std::vector<int64_t>>>>();
    out.push_back(std::move(r));
  }
  EXPECT_EQ(out.size(), 2u);
  return out;
}

template <typename T>
std::vector<int64_t> widen(std::span<const T> tokens) {
  return {tokens.begin(), tokens.end()};
}

TEST(IndexedDataset, ReadsReferenceFixtures) {
  for (const auto& ref : reference_datasets()) {
    SCOPED_TRACE(ref.name);
    IndexedDataset data(kFixtures + "/" + ref.name);
    EXPECT_EQ(data.dtype(), ref.dtype);
    EXPECT_EQ(data.num_documents(), static_cast<int64_t>(ref.documents.size()));
    int64_t sequence = 0, tokens = 0;
    for (size_t d = 0; d < ref.documents.size(); ++d) {
      const auto [first, last] = data.document_sequences(static_cast<int64_t>(d));
      EXPECT_EQ(first, sequence);
      EXPECT_EQ(last - first, static_cast<int64_t>(ref.documents[d].size()));
      for (const auto& expected : ref.documents[d]) {
        const std::vector<int64_t> got = ref.dtype == IndexedDType::u16 ? widen(data.get<uint16_t>(sequence))
                                                                        : widen(data.get<int32_t>(sequence));
        EXPECT_EQ(got, expected) << "sequence " << sequence;
        std::vector<int32_t> converted(expected.size());
        data.read_tokens(sequence, 0, static_cast<int64_t>(expected.size()), converted.data());
        EXPECT_EQ(std::vector<int64_t>(converted.begin(), converted.end()), expected);
        tokens += static_cast<int64_t>(expected.size());
        ++sequence;
      }
    }
    EXPECT_EQ(data.num_sequences(), sequence);
    EXPECT_EQ(data.total_tokens(), tokens);
  }
}

TEST(IndexedDataset, WriterIsByteIdenticalToReference) {
  DatasetTempDir dir("indexed");
  for (const auto& ref : reference_datasets()) {
    SCOPED_TRACE(ref.name);
    const std::string prefix = dir / ref.name;
    IndexedDatasetWriter writer(prefix, ref.dtype);
    for (const auto& document : ref.documents) {
      for (const auto& sequence : document) {
        std::vector<int32_t> tokens(sequence.begin(), sequence.end());
        writer.add_item(tokens);
      }
      writer.end_document();
    }
    writer.finalize();
    EXPECT_EQ(read_bytes(prefix + ".bin"), read_bytes(kFixtures + "/" + ref.name + ".bin"));
    EXPECT_EQ(read_bytes(prefix + ".idx"), read_bytes(kFixtures + "/" + ref.name + ".idx"));
    EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
    EXPECT_FALSE(fs::exists(prefix + ".idx.tmp"));
  }
}

TEST(IndexedDataset, DtypeFollowsVocabularySize) {
  EXPECT_EQ(indexed_dtype_for_vocab(256), IndexedDType::u16);
  EXPECT_EQ(indexed_dtype_for_vocab(65499), IndexedDType::u16);
  EXPECT_EQ(indexed_dtype_for_vocab(65500), IndexedDType::i32);
  EXPECT_EQ(indexed_dtype_for_vocab(128256), IndexedDType::i32);
  expect_error_containing([] { indexed_dtype_for_vocab(0); }, {"vocabulary"});
}

TEST(IndexedDataset, RoundTripsEveryIntegerDtype) {
  DatasetTempDir dir("indexed");
  const std::map<IndexedDType, std::pair<int32_t, int32_t>> ranges = {
      {IndexedDType::u8, {0, 255}},         {IndexedDType::i8, {-128, 127}},
      {IndexedDType::i16, {-32768, 32767}}, {IndexedDType::u16, {0, 65535}},
      {IndexedDType::i32, {0, 2147483647}}, {IndexedDType::i64, {0, 2147483647}},
  };
  std::mt19937 gen(7);
  for (const auto& [dtype, range] : ranges) {
    SCOPED_TRACE(std::string(indexed_dtype_name(dtype)));
    std::uniform_int_distribution<int32_t> token(range.first, range.second);
    std::uniform_int_distribution<int> length(0, 40);
    std::vector<std::vector<std::vector<int32_t>>> documents(25);
    for (auto& document : documents) {
      document.resize(1 + gen() % 3);
      for (auto& sequence : document) {
        sequence.resize(static_cast<size_t>(length(gen)));
        for (auto& t : sequence) t = token(gen);
      }
    }
    documents[3][0].assign({range.first, range.second});  // the extremes
    const std::string prefix = dir / std::string(indexed_dtype_name(dtype));
    IndexedDatasetWriter writer(prefix, dtype);
    for (const auto& document : documents) {
      for (const auto& sequence : document) writer.add_item(sequence);
      writer.end_document();
    }
    writer.finalize();
    EXPECT_EQ(writer.num_documents(), 25);

    IndexedDataset data(prefix);
    EXPECT_EQ(data.dtype(), dtype);
    EXPECT_EQ(data.num_documents(), 25);
    int64_t sequence = 0;
    for (size_t d = 0; d < documents.size(); ++d) {
      EXPECT_EQ(data.document_sequences(static_cast<int64_t>(d)).first, sequence);
      for (size_t s = 0; s < documents[d].size(); ++s, ++sequence) {
        const auto& expected = documents[d][s];
        EXPECT_EQ(data.sequence_length(sequence), static_cast<int64_t>(expected.size()));
        if (dtype == IndexedDType::i8 || dtype == IndexedDType::i16) {
          // Signed small dtypes: compare the raw values (negative ids are refused by read_tokens).
          std::vector<int64_t> got = dtype == IndexedDType::i8 ? widen(data.get<int8_t>(sequence))
                                                               : widen(data.get<int16_t>(sequence));
          EXPECT_EQ(got, std::vector<int64_t>(expected.begin(), expected.end()));
        } else {
          std::vector<int32_t> got(expected.size());
          data.read_tokens(sequence, 0, static_cast<int64_t>(got.size()), got.data());
          EXPECT_EQ(got, expected);
        }
      }
    }
  }
}

TEST(IndexedDataset, ExtremeTokensOfEachDtype) {
  DatasetTempDir dir("indexed");
  testing::write_documents(dir / "u16", {{0, 65535}}, IndexedDType::u16);
  IndexedDataset u16(dir / "u16");
  EXPECT_EQ(widen(u16.get<uint16_t>(0)), (std::vector<int64_t>{0, 65535}));
  testing::write_documents(dir / "i32", {{0, 2147483647}}, IndexedDType::i32);
  IndexedDataset i32(dir / "i32");
  int32_t out[2];
  i32.read_tokens(0, 0, 2, out);
  EXPECT_EQ(out[1], 2147483647);
  // A negative id in a signed dtype is refused when read as token ids.
  testing::write_documents(dir / "neg", {{5, -3}}, IndexedDType::i32);
  IndexedDataset negative(dir / "neg");
  expect_error_containing([&] { negative.read_tokens(0, 0, 2, out); }, {"neg.bin", "-3", "sequence 0"});
  // Typed access with the wrong type and out-of-range reads are errors.
  expect_error_containing([&] { u16.get<int32_t>(0); }, {"uint16"});
  expect_error_containing([&] { u16.sequence_length(1); }, {"sequence 1", "out of range"});
  expect_error_containing([&] { u16.read_tokens(0, 1, 2, out); }, {"outside"});
}

TEST(IndexedDataset, WriterRejectsTokensThatDoNotFit) {
  DatasetTempDir dir("indexed");
  IndexedDatasetWriter writer(dir / "w", IndexedDType::u16);
  std::vector<int32_t> too_big = {1, 70000};
  expect_error_containing([&] { writer.add_item(too_big); }, {"70000", "uint16", "token 1"});
  std::vector<int32_t> negative = {-1};
  expect_error_containing([&] { writer.add_item(negative); }, {"-1", "uint16"});
  expect_error_containing([&] { IndexedDatasetWriter(dir / "f", IndexedDType::f32); }, {"integer"});
}

TEST(IndexedDataset, UnfinishedWriteLeavesNoPairAndKeepsTheOldOne) {
  DatasetTempDir dir("indexed");
  const std::string prefix = dir / "d";
  {
    IndexedDatasetWriter writer(prefix, IndexedDType::u16);
    std::vector<int32_t> tokens = {1, 2, 3};
    writer.add_document(tokens);
    EXPECT_FALSE(fs::exists(prefix + ".bin"));
    EXPECT_FALSE(fs::exists(prefix + ".idx"));
  }  // destroyed without finalize: an interrupted write
  EXPECT_FALSE(fs::exists(prefix + ".bin"));
  EXPECT_FALSE(fs::exists(prefix + ".idx"));
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));

  testing::write_documents(prefix, {{4, 5}});
  const auto old_bin = read_bytes(prefix + ".bin"), old_idx = read_bytes(prefix + ".idx");
  {
    IndexedDatasetWriter writer(prefix, IndexedDType::u16);
    std::vector<int32_t> tokens = {7, 8, 9, 10};
    writer.add_document(tokens);
  }
  EXPECT_EQ(read_bytes(prefix + ".bin"), old_bin);
  EXPECT_EQ(read_bytes(prefix + ".idx"), old_idx);

  testing::write_documents(prefix, {{7, 8, 9, 10}});  // a finished rewrite replaces both
  IndexedDataset data(prefix);
  EXPECT_EQ(data.total_tokens(), 4);
}

TEST(IndexedDataset, FinalizeRequiresEndedDocuments) {
  DatasetTempDir dir("indexed");
  IndexedDatasetWriter writer(dir / "d", IndexedDType::u16);
  std::vector<int32_t> tokens = {1};
  writer.add_item(tokens);
  expect_error_containing([&] { writer.finalize(); }, {"end_document"});
  EXPECT_FALSE(fs::exists(dir / "d.idx"));
}

TEST(IndexedDataset, AddIndexAppendsDatasets) {
  DatasetTempDir dir("indexed");
  testing::write_documents(dir / "a", {{1, 2}, {3}});
  {
    IndexedDatasetWriter writer(dir / "b", IndexedDType::u16);
    std::vector<int32_t> s1 = {4, 5}, s2 = {6};
    writer.add_item(s1);
    writer.add_item(s2);
    writer.end_document();
    writer.finalize();
  }
  IndexedDatasetWriter merged(dir / "m", IndexedDType::u16);
  merged.add_index(dir / "a");
  std::vector<int32_t> middle = {9, 9, 9};
  merged.add_document(middle);
  merged.add_index(dir / "b");
  merged.finalize();

  IndexedDataset data(dir / "m");
  EXPECT_EQ(data.num_documents(), 4);
  EXPECT_EQ(data.num_sequences(), 5);
  EXPECT_EQ(data.document_sequences(3), (std::pair<int64_t, int64_t>{3, 5}));
  std::vector<int64_t> all;
  for (int64_t s = 0; s < data.num_sequences(); ++s) {
    auto t = widen(data.get<uint16_t>(s));
    all.insert(all.end(), t.begin(), t.end());
  }
  EXPECT_EQ(all, (std::vector<int64_t>{1, 2, 3, 9, 9, 9, 4, 5, 6}));

  testing::write_documents(dir / "wide", {{1}}, IndexedDType::i32);
  IndexedDatasetWriter other(dir / "x", IndexedDType::u16);
  expect_error_containing([&] { other.add_index(dir / "wide"); }, {"wide", "int32", "uint16"});
}

// Malformed pairs, each made by damaging a copy of a valid pair.
class MalformedDataset : public ::testing::Test {
 protected:
  void SetUp() override {
    // Three documents (5 sequences, tokens uint16), one of two sequences.
    IndexedDatasetWriter writer(prefix(), IndexedDType::u16);
    std::vector<int32_t> a = {1, 2, 3}, b = {4}, c = {5, 6}, d = {7, 8, 9, 10}, e = {11};
    writer.add_document(a);
    writer.add_item(b);
    writer.add_item(c);
    writer.end_document();
    writer.add_document(d);
    writer.add_document(e);
    writer.finalize();
    idx_ = read_bytes(prefix() + ".idx");
    bin_ = read_bytes(prefix() + ".bin");
  }
  std::string prefix() const { return dir_ / "bad"; }
  void put_u64(size_t at, uint64_t v) { std::memcpy(idx_.data() + at, &v, 8); }
  void put_i64(size_t at, int64_t v) { std::memcpy(idx_.data() + at, &v, 8); }
  void put_i32(size_t at, int32_t v) { std::memcpy(idx_.data() + at, &v, 4); }
  // Offsets of the arrays for S = 5 sequences, D = 5 document indices.
  static constexpr size_t kLengths = 34, kOffsets = 34 + 5 * 4, kDocuments = 34 + 5 * 12;
  // Writes the damaged pair and expects one error line naming the file and every fragment.
  void expect_rejected(std::initializer_list<std::string_view> fragments, bool bin_file = false) {
    write_bytes(prefix() + ".idx", idx_);
    write_bytes(prefix() + ".bin", bin_);
    const std::string file = prefix() + (bin_file ? ".bin" : ".idx");
    try {
      IndexedDataset data(prefix());
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
      EXPECT_NE(message.find("'" + file + "'"), std::string::npos) << message;
      for (std::string_view f : fragments)
        EXPECT_NE(message.find(f), std::string::npos) << f << " not in: " << message;
    }
  }
  DatasetTempDir dir_{"indexed"};
  std::vector<unsigned char> idx_, bin_;
};

TEST_F(MalformedDataset, ValidPairOpens) {
  IndexedDataset data(prefix());
  EXPECT_EQ(data.num_documents(), 4);
  EXPECT_EQ(data.total_tokens(), 11);
}

TEST_F(MalformedDataset, MissingFiles) {
  fs::remove(prefix() + ".bin");
  expect_error_containing([&] { IndexedDataset data(prefix()); }, {prefix() + ".bin", "missing"});
  fs::remove(prefix() + ".idx");
  expect_error_containing([&] { IndexedDataset data(prefix()); }, {prefix() + ".idx", "missing"});
}

TEST_F(MalformedDataset, WrongMagic) {
  idx_[0] = 'X';
  expect_rejected({"magic"});
}

TEST_F(MalformedDataset, BadVersion) {
  put_u64(9, 2);
  expect_rejected({"version 2"});
}

TEST_F(MalformedDataset, UnknownDtype) {
  idx_[17] = 9;
  expect_rejected({"dtype code 9"});
  idx_[17] = 0;
  expect_rejected({"dtype code 0"});
}

TEST_F(MalformedDataset, TruncatedIndex) {
  idx_.resize(idx_.size() - 4);
  expect_rejected({"5 sequences", "truncated"});
  idx_.resize(20);
  expect_rejected({"truncated header"});
}

TEST_F(MalformedDataset, CountsDisagreeWithSize) {
  put_u64(18, 1000000);  // sequence count far beyond the file
  expect_rejected({"1000000 sequences"});
}

TEST_F(MalformedDataset, MultimodalModesAreRefused) {
  for (int i = 0; i < 5; ++i) idx_.push_back(0);
  expect_rejected({"multimodal"});
}

TEST_F(MalformedDataset, BinShorterThanIndexSays) {
  bin_.resize(bin_.size() - 2);
  expect_rejected({"20 bytes", "22 bytes"}, /*bin_file=*/true);
}

TEST_F(MalformedDataset, BinLongerThanIndexSays) {
  bin_.push_back(0);
  bin_.push_back(0);
  expect_rejected({"24 bytes"}, /*bin_file=*/true);
}

TEST_F(MalformedDataset, OffsetPastTheEnd) {
  put_i64(kOffsets + 4 * 8, 4096);
  expect_rejected({"sequence 4", "byte 4096"});
}

TEST_F(MalformedDataset, LengthDisagreesWithOffsets) {
  put_i32(kLengths + 1 * 4, 3);  // sequence 1 claims 3 tokens; sequence 2 still starts 1 token later
  expect_rejected({"sequence 2"});
}

TEST_F(MalformedDataset, NegativeLength) {
  put_i32(kLengths + 4 * 4, -1);
  expect_rejected({"sequence 4", "negative length"});
}

TEST_F(MalformedDataset, NonMonotoneDocumentIndex) {
  put_i64(kDocuments + 2 * 8, 4);
  put_i64(kDocuments + 3 * 8, 3);
  expect_rejected({"not monotone", "index 3"});
}

TEST_F(MalformedDataset, DocumentIndexMustStartAtZero) {
  put_i64(kDocuments, 1);
  expect_rejected({"first document index is 1"});
}

TEST_F(MalformedDataset, DocumentIndexMustEndAtSequenceCount) {
  put_i64(kDocuments + 4 * 8, 4);
  expect_rejected({"last document index is 4", "sequence count 5"});
}

}  // namespace
}  // namespace forge::indexed_dataset_test
