// Blended GPT datasets: blend strings, the greedy assignment (proportions within one sample, independent
// of how it is queried), sample routing, and opening a blend of prefixes with a split.
#include "forge/data/text/blended_dataset.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "data/dataset_test_util.h"
#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::blended_dataset_test {
using namespace forge::data;
namespace {

using testing::DatasetTempDir;
using testing::expect_error_containing;
using testing::numbered_documents;

TEST(ParseBlend, WeightsAndPrefixes) {
  auto b = parse_blend("0.3 data/a_text_document 0.7 data/b_text_document");
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].prefix, "data/a_text_document");
  EXPECT_DOUBLE_EQ(b[0].weight, 0.3);
  EXPECT_DOUBLE_EQ(b[1].weight, 0.7);
  b = parse_blend("  2 x\n 6 y  ");  // normalised; any whitespace
  EXPECT_DOUBLE_EQ(b[0].weight, 0.25);
  EXPECT_DOUBLE_EQ(b[1].weight, 0.75);
  b = parse_blend("only/prefix");
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].prefix, "only/prefix");
  EXPECT_DOUBLE_EQ(b[0].weight, 1.0);
}

TEST(ParseBlend, Malformed) {
  expect_error_containing([] { parse_blend("  "); }, {"empty"});
  expect_error_containing([] { parse_blend("0.3 a 0.7"); }, {"0.3 a 0.7", "3 words"});
  expect_error_containing([] { parse_blend("a b"); }, {"'a'", "positive weight"});
  expect_error_containing([] { parse_blend("-1 a 2 b"); }, {"'-1'"});
  expect_error_containing([] { parse_blend("0 a 2 b"); }, {"'0'"});
  expect_error_containing([] { parse_blend("0.5x a 2 b"); }, {"'0.5x'"});
  expect_error_containing([] { parse_blend("inf a 2 b"); }, {"'inf'"});
}

class Blend : public ::testing::Test {
 protected:
  std::shared_ptr<const GptDataset> dataset(const std::string& name, int documents, int64_t seq_len = 4) {
    std::vector<int> lengths(static_cast<size_t>(documents), 5);
    testing::write_documents(dir_ / name,
                             numbered_documents(lengths, 1000 * (1 + static_cast<int32_t>(names_++))));
    auto data = std::make_shared<const IndexedDataset>(dir_ / name);
    return std::make_shared<const GptDataset>(data, DocumentRange{0, documents},
                                              GptDatasetConfig{.seq_len = seq_len, .seed = 7});
  }
  DatasetTempDir dir_{"blend"};
  int names_ = 0;
};

TEST_F(Blend, ProportionsFollowTheWeights) {
  auto a = dataset("a", 10), b = dataset("b", 10), c = dataset("c", 10), d = dataset("d", 10),
       e = dataset("e", 10);
  std::mt19937 gen(3);
  std::uniform_real_distribution<double> uniform(0.01, 1.0);
  const std::vector<std::vector<double>> weight_sets = {
      {0.3, 0.7},        {0.2, 0.5, 0.3},
      {1, 1, 1},         {0.001, 0.999},
      {0.05, 0.05, 0.9}, {uniform(gen), uniform(gen), uniform(gen), uniform(gen), uniform(gen)},
      {1, 2, 4, 8, 16}};
  const std::vector<std::shared_ptr<const GptDataset>> all = {a, b, c, d, e};
  for (const auto& weights : weight_sets) {
    std::vector<std::shared_ptr<const GptDataset>> parts(all.begin(),
                                                         all.begin() + static_cast<long>(weights.size()));
    BlendedDataset blend(parts, weights);
    double total = 0;
    for (double w : weights) total += w;
    std::vector<int64_t> counts(weights.size(), 0);
    double ahead = 0, behind = 0;
    for (int64_t i = 0; i < 20000; ++i) {
      const auto [k, within] = blend.locate(i);
      EXPECT_EQ(within, counts[k]) << "each dataset's samples are used in order";
      ++counts[k];
      for (size_t j = 0; j < weights.size(); ++j) {
        const double deviation =
            static_cast<double>(counts[j]) - weights[j] / total * static_cast<double>(i + 1);
        ahead = std::max(ahead, deviation);
        behind = std::max(behind, -deviation);
      }
    }
    SCOPED_TRACE(::testing::Message() << weights.size() << " datasets, weights " << weights[0] << ", ...");
    EXPECT_LT(ahead, 1.0);  // never a whole sample ahead of its share (provable)
    if (weights.size() <= 3) {
      EXPECT_LT(behind, 1.0);  // within one sample of the target, both ways
    } else {
      EXPECT_LT(behind, 1.5);  // measured bound for a handful of datasets
    }
  }
}

TEST_F(Blend, AssignmentDoesNotDependOnQueryOrder) {
  BlendedDataset blend({dataset("a", 10), dataset("b", 10), dataset("c", 10)}, {0.5, 0.3, 0.2});
  BlendedDataset fresh({dataset("d", 10), dataset("e", 10), dataset("f", 10)}, {0.5, 0.3, 0.2});
  std::vector<std::pair<size_t, int64_t>> sequential;
  for (int64_t i = 0; i < 13000; ++i) sequential.push_back(blend.locate(i));
  // Random indices (across the 4096-sample chunks) on a dataset that has computed nothing yet.
  std::mt19937 gen(5);
  for (int r = 0; r < 300; ++r) {
    const int64_t i = gen() % 13000;
    EXPECT_EQ(fresh.locate(i), sequential[static_cast<size_t>(i)]) << i;
  }
}

TEST_F(Blend, SamplesComeFromTheAssignedDataset) {
  auto a = dataset("a", 20), b = dataset("b", 20);
  BlendedDataset blend({a, b}, {1, 3});
  EXPECT_DOUBLE_EQ(blend.weights()[1], 0.75);
  const int64_t T = blend.seq_len(), first = 4090, n = 12;  // crosses a chunk boundary
  std::vector<int32_t> inputs(n * T), targets(n * T), input(T), target(T);
  blend.batch(first, n, inputs.data(), targets.data());
  for (int64_t r = 0; r < n; ++r) {
    const auto [k, within] = blend.locate(first + r);
    blend.dataset(k).sample(within, input.data(), target.data());
    EXPECT_TRUE(std::equal(input.begin(), input.end(), inputs.begin() + r * T));
    EXPECT_TRUE(std::equal(target.begin(), target.end(), targets.begin() + r * T));
    // Tokens of dataset k are numbered from 1000 * (k + 1).
    EXPECT_EQ(input[0] / 1000, static_cast<int32_t>(k) + 1);
    blend.sample(first + r, input.data(), target.data());
    EXPECT_TRUE(std::equal(input.begin(), input.end(), inputs.begin() + r * T));
  }
}

TEST_F(Blend, Errors) {
  auto a = dataset("a", 5), b = dataset("b", 5, /*seq_len=*/8);
  expect_error_containing([&] { BlendedDataset({a, b}, {1, 1}); }, {"seq_len 8", "seq_len"});
  expect_error_containing([&] { BlendedDataset({a}, {1, 1}); }, {"1 datasets but 2 weights"});
  expect_error_containing([&] { BlendedDataset({a}, {0}); }, {"weight", "positive"});
  expect_error_containing([&] { BlendedDataset({}, {}); }, {"no datasets"});
  BlendedDataset bounded({a}, {1}, 3);
  std::vector<int32_t> input(4), target(4);
  bounded.sample(2, input.data(), target.data());
  expect_error_containing([&] { bounded.sample(3, input.data(), target.data()); }, {"built for 3"});
}

TEST_F(Blend, OpensPrefixesWithASplit) {
  testing::write_documents(dir_ / "x", numbered_documents(std::vector<int>(100, 3), 1));
  testing::write_documents(dir_ / "y", numbered_documents(std::vector<int>(10, 3), 5000));
  const std::string blend_string = "0.25 " + (dir_ / "x") + " 0.75 " + (dir_ / "y");
  auto train = open_blended_gpt_dataset(blend_string, "80,20", DataSplit::train, {.seq_len = 4, .seed = 1});
  ASSERT_EQ(train->num_datasets(), 2u);
  EXPECT_EQ(train->dataset(0).documents().end, 80);
  EXPECT_EQ(train->dataset(1).documents().end, 8);
  auto valid = open_blended_gpt_dataset(blend_string, "80,20", DataSplit::valid, {.seq_len = 4, .seed = 1});
  EXPECT_EQ(valid->dataset(0).documents().begin, 80);
  EXPECT_EQ(valid->dataset(1).documents().begin, 8);
  std::vector<int32_t> input(4), target(4);
  int from_y = 0;
  for (int64_t i = 0; i < 400; ++i) {
    valid->sample(i, input.data(), target.data());
    from_y += input[0] >= 5000;
    if (input[0] >= 5000) {
      EXPECT_GE(input[0], 5000 + 8 * 3);  // valid part of y: documents 8 and 9
    } else {
      EXPECT_GE(input[0], 1 + 80 * 3);
    }
  }
  EXPECT_EQ(from_y, 300);

  auto single = open_blended_gpt_dataset(dir_ / "x", "1", DataSplit::train, {.seq_len = 4, .seed = 1});
  EXPECT_EQ(single->num_datasets(), 1u);
  expect_error_containing(
      [&] { open_blended_gpt_dataset(blend_string, "100,0,0", DataSplit::valid, {.seq_len = 4}); },
      {dir_ / "x", "valid", "no tokens"});
  expect_error_containing(
      [&] {
        open_blended_gpt_dataset("1 " + (dir_ / "missing") + " 1 " + (dir_ / "x"), "1", DataSplit::train,
                                 {.seq_len = 4});
      },
      {"missing.idx"});
}

}  // namespace
}  // namespace forge::blended_dataset_test
