// GPT samples from indexed datasets: split strings, per-epoch document shuffles, packing with one-token
// overlap, the block shuffle of samples, sequential mode, determinism and the error paths.
#include "forge/data/text/gpt_dataset.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "data/dataset_test_util.h"
#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::gpt_dataset_test {
using namespace forge::data;
namespace {

using testing::DatasetTempDir;
using testing::expect_error_containing;
using testing::numbered_documents;

std::shared_ptr<const IndexedDataset> make_dataset(const DatasetTempDir& dir, const std::vector<int>& lengths,
                                                   const std::string& name = "corpus") {
  testing::write_documents(dir / name, numbered_documents(lengths));
  return std::make_shared<const IndexedDataset>(dir / name);
}

// The concatenation of the documents of `order` (sequence ids), as the stream of one epoch.
std::vector<int32_t> concat(const IndexedDataset& data, const std::vector<int64_t>& order) {
  std::vector<int32_t> out;
  for (int64_t s : order) {
    std::vector<int32_t> t(static_cast<size_t>(data.sequence_length(s)));
    data.read_tokens(s, 0, static_cast<int64_t>(t.size()), t.data());
    out.insert(out.end(), t.begin(), t.end());
  }
  return out;
}

const std::vector<int> kLengths = {7, 1, 12, 0, 5, 9, 3, 30, 2, 6, 11, 4, 1, 8};  // 99 tokens, one empty

TEST(SplitDocumentRanges, MegatronBookends) {
  auto r = split_document_ranges("969,30,1", 1000);
  EXPECT_EQ(r[0].begin, 0);
  EXPECT_EQ(r[0].end, 969);
  EXPECT_EQ(r[1].begin, 969);
  EXPECT_EQ(r[1].end, 999);
  EXPECT_EQ(r[2].begin, 999);
  EXPECT_EQ(r[2].end, 1000);
  r = split_document_ranges("99,1", 200);  // missing parts weigh zero
  EXPECT_EQ(r[0].end, 198);
  EXPECT_EQ(r[1].end, 200);
  EXPECT_EQ(r[2].size(), 0);
  r = split_document_ranges("1", 17);
  EXPECT_EQ(r[0].end, 17);
  EXPECT_EQ(r[1].size() + r[2].size(), 0);
  r = split_document_ranges("1,1", 5);  // 2.5 rounds to even, as Python's round()
  EXPECT_EQ(r[0].end, 2);
  EXPECT_EQ(r[1].begin, 2);
  EXPECT_EQ(r[1].end, 5);
  r = split_document_ranges("8/1/1", 10);  // Megatron also accepts '/'
  EXPECT_EQ(r[0].end, 8);
  EXPECT_EQ(r[1].end, 9);
}

TEST(SplitDocumentRanges, MalformedStrings) {
  expect_error_containing([] { split_document_ranges("a,b", 10); }, {"a,b", "'a'"});
  expect_error_containing([] { split_document_ranges("90,-1", 10); }, {"'-1'"});
  expect_error_containing([] { split_document_ranges("0,0,0", 10); }, {"sum to zero"});
  expect_error_containing([] { split_document_ranges("1,2,3,4", 10); }, {"at most three"});
  expect_error_containing([] { split_document_ranges("", 10); }, {"not a non-negative number"});
  expect_error_containing([] { split_document_ranges("9,,1", 10); }, {"not a non-negative number"});
}

TEST(SeededPermutation, IsAPermutationAndDependsOnTheKey) {
  const auto a = seeded_permutation(1000, 1), b = seeded_permutation(1000, 1),
             c = seeded_permutation(1000, 2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(sorted, identity);
  EXPECT_NE(a, identity);
  EXPECT_TRUE(seeded_permutation(0, 1).empty());
  EXPECT_EQ(seeded_permutation(1, 1), std::vector<int64_t>{0});
}

TEST(GptDataset, EpochsArePermutationsThatReshuffle) {
  DatasetTempDir dir("gpt");
  auto data = make_dataset(dir, kLengths);
  GptDataset ds(data, {2, 14}, {.seq_len = 4, .seed = 5});
  EXPECT_EQ(ds.tokens_per_epoch(), 99 - 7 - 1);
  std::set<std::vector<int64_t>> orders;
  for (int64_t e = 0; e < 6; ++e) {
    auto order = ds.epoch_documents(e);
    orders.insert(order);
    std::sort(order.begin(), order.end());
    std::vector<int64_t> expected(12);
    std::iota(expected.begin(), expected.end(), 2);
    EXPECT_EQ(order, expected) << "epoch " << e;
  }
  EXPECT_EQ(orders.size(), 6u) << "every epoch has its own order";
}

TEST(GptDataset, SamplesOverlapByOneTokenAndCoverTheStreamOnce) {
  DatasetTempDir dir("gpt");
  auto data = make_dataset(dir, kLengths);
  const int64_t T = 5;
  GptDataset ds(data, {0, 14}, {.seq_len = T, .seed = 11});
  const int64_t E = ds.tokens_per_epoch();
  EXPECT_EQ(E, 99);
  EXPECT_EQ(ds.samples_per_epoch(), (99 - 1) / T);

  // The stream is the epochs' document orders concatenated.
  std::vector<int32_t> stream;
  for (int64_t e = 0; e < 4; ++e) {
    auto epoch = concat(*data, ds.epoch_documents(e));
    ASSERT_EQ(static_cast<int64_t>(epoch.size()), E);
    std::vector<int32_t> sorted = epoch;
    std::sort(sorted.begin(), sorted.end());
    for (int32_t t = 1; t <= 99; ++t)
      EXPECT_EQ(sorted[static_cast<size_t>(t - 1)], t) << "every token once per epoch";
    stream.insert(stream.end(), epoch.begin(), epoch.end());
  }
  std::vector<int32_t> from_stream(static_cast<size_t>(3 * E));
  ds.read_stream(0, 3 * E, from_stream.data());
  EXPECT_TRUE(std::equal(from_stream.begin(), from_stream.end(), stream.begin()));

  // The samples of the first blocks read windows [0, n): each window once, inputs stream[w*T, w*T + T),
  // targets shifted by one; so targets cover stream positions 1..n*T exactly once.
  const int64_t n = 3 * ds.samples_per_epoch();
  std::vector<int> window_uses(static_cast<size_t>(n), 0);
  std::vector<int> position_uses(static_cast<size_t>(n * T + 1), 0);
  std::vector<int32_t> input(T), target(T);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t w = ds.window_of_sample(i);
    ASSERT_GE(w, 0);
    ASSERT_LT(w, n);
    ++window_uses[static_cast<size_t>(w)];
    // A block's samples are a permutation of the block's windows.
    EXPECT_EQ(w / ds.samples_per_epoch(), i / ds.samples_per_epoch());
    ds.sample(i, input.data(), target.data());
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(input[t], stream[static_cast<size_t>(w * T + t)]);
      EXPECT_EQ(target[t], stream[static_cast<size_t>(w * T + t + 1)]);
      ++position_uses[static_cast<size_t>(w * T + t + 1)];
    }
  }
  for (int64_t w = 0; w < n; ++w) EXPECT_EQ(window_uses[static_cast<size_t>(w)], 1) << "window " << w;
  for (int64_t p = 1; p <= n * T; ++p)
    EXPECT_EQ(position_uses[static_cast<size_t>(p)], 1) << "position " << p;
  EXPECT_EQ(ds.epochs_for_samples(n), (n * T + 1 + E - 1) / E);
}

TEST(GptDataset, SequentialModeReadsDocumentsInOrderAcrossEpochs) {
  DatasetTempDir dir("gpt");
  auto data = make_dataset(dir, kLengths);
  const int64_t T = 8;
  GptDataset ds(data, {0, 14}, {.seq_len = T, .seed = 3, .shuffle = false});
  std::vector<int64_t> in_order(14);
  std::iota(in_order.begin(), in_order.end(), 0);
  EXPECT_EQ(ds.epoch_documents(0), in_order);
  EXPECT_EQ(ds.epoch_documents(5), in_order);
  std::vector<int32_t> input(T), target(T);
  for (int64_t i = 0; i < 40; ++i) {  // 40 * 8 = 320 tokens: more than three epochs of 99
    EXPECT_EQ(ds.window_of_sample(i), i);
    ds.sample(i, input.data(), target.data());
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(input[t], (i * T + t) % 99 + 1);
      EXPECT_EQ(target[t], (i * T + t + 1) % 99 + 1);
    }
  }
}

TEST(GptDataset, WindowsLongerThanAnEpoch) {
  DatasetTempDir dir("gpt");
  auto data = make_dataset(dir, {2, 0, 3});  // 5 tokens an epoch
  GptDataset sequential(data, {0, 3}, {.seq_len = 12, .shuffle = false});
  EXPECT_EQ(sequential.samples_per_epoch(), 1);
  std::vector<int32_t> input(12), target(12);
  sequential.sample(1, input.data(), target.data());
  for (int t = 0; t < 12; ++t) {
    EXPECT_EQ(input[t], (12 + t) % 5 + 1);
    EXPECT_EQ(target[t], (13 + t) % 5 + 1);
  }
  GptDataset shuffled(data, {0, 3}, {.seq_len = 12, .seed = 9});
  for (int64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(shuffled.window_of_sample(i), i);  // blocks of one sample
    shuffled.sample(i, input.data(), target.data());
    std::vector<int32_t> stream(13);
    shuffled.read_stream(i * 12, 13, stream.data());
    EXPECT_TRUE(std::equal(input.begin(), input.end(), stream.begin()));
    EXPECT_TRUE(std::equal(target.begin(), target.end(), stream.begin() + 1));
  }
}

TEST(GptDataset, DeterministicInSeedAndIndexOnly) {
  DatasetTempDir dir("gpt");
  auto data = make_dataset(dir, kLengths);
  const GptDatasetConfig config{.seq_len = 6, .seed = 42};
  GptDataset a(data, {0, 14}, config), b(data, {0, 14}, config);
  GptDatasetConfig other_seed = config;
  other_seed.seed = 43;
  GptDataset c(data, {0, 14}, other_seed);

  const int64_t n = 60;
  std::vector<int32_t> in_a(n * 6), tg_a(n * 6), in_b(6), tg_b(6);
  a.batch(0, n, in_a.data(), tg_a.data());
  // b is read backwards and in random order: the caches must not change any sample.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  for (int64_t i : order) {
    b.sample(i, in_b.data(), tg_b.data());
    EXPECT_TRUE(std::equal(in_b.begin(), in_b.end(), in_a.begin() + i * 6)) << i;
    EXPECT_TRUE(std::equal(tg_b.begin(), tg_b.end(), tg_a.begin() + i * 6)) << i;
  }
  // A batch that starts elsewhere gives the same rows.
  std::vector<int32_t> in_mid(7 * 6), tg_mid(7 * 6);
  a.batch(23, 7, in_mid.data(), tg_mid.data());
  EXPECT_TRUE(std::equal(in_mid.begin(), in_mid.end(), in_a.begin() + 23 * 6));

  // Another seed changes the document order and the sample order.
  EXPECT_NE(a.epoch_documents(0), c.epoch_documents(0));
  std::vector<int32_t> in_c(n * 6), tg_c(n * 6);
  c.batch(0, n, in_c.data(), tg_c.data());
  EXPECT_NE(in_a, in_c);
  int moved = 0;
  for (int64_t i = 0; i < a.samples_per_epoch(); ++i) moved += a.window_of_sample(i) != c.window_of_sample(i);
  EXPECT_GT(moved, a.samples_per_epoch() / 2);
}

TEST(GptDataset, SplitsDoNotShareDocuments) {
  DatasetTempDir dir("gpt");
  std::vector<int> lengths(100, 3);
  auto data = make_dataset(dir, lengths);
  const auto ranges = split_document_ranges("90,8,2", data->num_sequences());
  std::set<int32_t> seen[3];
  for (int k = 0; k < 3; ++k) {
    GptDataset ds(data, ranges[k], {.seq_len = 4, .seed = 1});
    std::vector<int32_t> input(4), target(4);
    for (int64_t i = 0; i < 2 * ds.samples_per_epoch(); ++i) {
      ds.sample(i, input.data(), target.data());
      seen[k].insert(input.begin(), input.end());
      seen[k].insert(target.begin(), target.end());
    }
    for (int32_t t : seen[k]) {
      const int64_t document = (t - 1) / 3;
      EXPECT_GE(document, ranges[k].begin);
      EXPECT_LT(document, ranges[k].end);
    }
  }
  EXPECT_EQ(seen[0].size(), 270u);
  EXPECT_EQ(seen[1].size(), 24u);
  EXPECT_EQ(seen[2].size(), 6u);
}

TEST(GptDataset, Errors) {
  DatasetTempDir dir("gpt");
  auto data = make_dataset(dir, {3, 0, 0, 4});
  const std::string name = dir / "corpus";
  expect_error_containing([&] { GptDataset(data, {0, 4}, {.seq_len = 0}); }, {name, "seq_len"});
  expect_error_containing([&] { GptDataset(data, {0, 5}, {.seq_len = 4}); }, {name, "[0, 5)", "4 sequences"});
  expect_error_containing([&] { GptDataset(data, {3, 2}, {.seq_len = 4}); }, {name});
  expect_error_containing([&] { GptDataset(data, {1, 3}, {.seq_len = 4}); }, {name, "no tokens"});
  expect_error_containing([&] { GptDataset(nullptr, {0, 1}, {.seq_len = 4}); }, {"no indexed dataset"});
  GptDataset bounded(data, {0, 4}, {.seq_len = 2, .num_samples = 5});
  std::vector<int32_t> input(2), target(2);
  bounded.sample(4, input.data(), target.data());
  expect_error_containing([&] { bounded.sample(5, input.data(), target.data()); },
                          {name, "sample 5", "5 samples"});
  expect_error_containing([&] { bounded.sample(-1, input.data(), target.data()); }, {"negative"});
  expect_error_containing([&] { bounded.batch(0, 0, input.data(), target.data()); }, {"batch"});
}

// With a vocabulary bound, a token id outside it names the .bin file, the document, the position and the id.
TEST(GptDataset, TokensOutsideTheVocabularyNameTheFile) {
  DatasetTempDir dir("gpt");
  testing::write_documents(dir / "ids", {{1, 2, 3}, {4, 4464, 5}});
  auto data = std::make_shared<const IndexedDataset>(dir / "ids");
  std::vector<int32_t> input(6), target(6);
  GptDataset unbounded(data, {0, 2}, {.seq_len = 5, .shuffle = false});
  unbounded.sample(0, input.data(), target.data());  // no bound: ids are not checked
  EXPECT_EQ(input[4], 4464);
  GptDataset bounded(
      data, {0, 2},
      {.seq_len = 5, .shuffle = false, .vocab_size = 256, .vocab_name = "the model's vocabulary"});
  expect_error_containing([&] { bounded.sample(0, input.data(), target.data()); },
                          {dir / "ids.bin" + ": document 1, position 1: token id 4464 is outside the model's "
                                             "vocabulary [0, 256)"});
  GptDataset enough(data, {0, 2}, {.seq_len = 5, .shuffle = false, .vocab_size = 4465});
  EXPECT_NO_THROW(enough.sample(0, input.data(), target.data()));
}

}  // namespace
}  // namespace forge::gpt_dataset_test
