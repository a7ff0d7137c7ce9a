#include "forge/data/text/byte_sampler.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "forge/core/error.h"

namespace forge::byte_sampler_test {
using namespace forge::data;
namespace {

// tokens[i] = i, so the first input id of a window is its offset.
std::vector<uint8_t> ramp(int64_t n) {
  std::vector<uint8_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), 0);
  return tokens;
}

struct Batch {
  std::vector<int32_t> input, target;
};

Batch draw(const std::vector<uint8_t>& tokens, uint64_t seed, int64_t first, int64_t batch, int64_t seq_len) {
  Batch out{std::vector<int32_t>(batch * seq_len), std::vector<int32_t>(batch * seq_len)};
  sample_batch(tokens.data(), static_cast<int64_t>(tokens.size()), seed, first, batch, seq_len,
               out.input.data(), out.target.data());
  return out;
}

template <typename F>
void expect_error_containing(F&& f, std::string_view fragment) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(ByteSampler, Splitmix64MatchesReferenceVectors) {
  // Vigna's splitmix64.c: the first outputs of the generator seeded with 0 and with 1234567.
  EXPECT_EQ(splitmix64(0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(splitmix64(1234567), 6457827717110365317ull);
  EXPECT_EQ(splitmix64(1234567 + 0x9E3779B97F4A7C15ull), 3203168211198807973ull);
}

TEST(ByteSampler, WindowsAreContiguousAndTargetsShiftedByOne) {
  const auto tokens = ramp(200);
  const int64_t batch = 6, seq_len = 17;
  const Batch b = draw(tokens, 42, 0, batch, seq_len);
  for (int64_t s = 0; s < batch; ++s) {
    const int32_t offset = b.input[s * seq_len];
    EXPECT_EQ(offset, sample_offset(42, s, 200, seq_len));
    for (int64_t t = 0; t < seq_len; ++t) {
      EXPECT_EQ(b.input[s * seq_len + t], offset + t);
      EXPECT_EQ(b.target[s * seq_len + t], offset + t + 1);
    }
  }
}

TEST(ByteSampler, OrderDependsOnlyOnSeedAndGlobalIndex) {
  const auto tokens = ramp(250);
  const int64_t seq_len = 8;
  const Batch whole = draw(tokens, 7, 0, 4, seq_len);
  const Batch first = draw(tokens, 7, 0, 2, seq_len);
  const Batch second = draw(tokens, 7, 2, 2, seq_len);
  std::vector<int32_t> joined_input = first.input, joined_target = first.target;
  joined_input.insert(joined_input.end(), second.input.begin(), second.input.end());
  joined_target.insert(joined_target.end(), second.target.begin(), second.target.end());
  EXPECT_EQ(whole.input, joined_input);
  EXPECT_EQ(whole.target, joined_target);
  // Same call, same batch; another seed, another order.
  EXPECT_EQ(draw(tokens, 7, 0, 4, seq_len).input, whole.input);
  EXPECT_NE(draw(tokens, 8, 0, 4, seq_len).input, whole.input);
}

TEST(ByteSampler, OffsetsCoverTheRangeUniformly) {
  const int64_t n = 20, seq_len = 5, range = n - seq_len;  // offsets 0..14
  const int64_t draws = 30000;
  std::vector<int64_t> counts(range, 0);
  for (int64_t i = 0; i < draws; ++i) {
    const int64_t offset = sample_offset(3, i, n, seq_len);
    ASSERT_GE(offset, 0);
    ASSERT_LT(offset, range);
    ++counts[offset];
  }
  // Chi-square with 14 degrees of freedom: 36 is beyond the 0.999 quantile (~36.1 for p=0.001).
  const double expected = static_cast<double>(draws) / range;
  double chi_square = 0;
  for (int64_t c : counts) chi_square += (c - expected) * (c - expected) / expected;
  EXPECT_LT(chi_square, 36.0);
  // The last valid offset reads the last token as a target.
  EXPECT_GT(counts[range - 1], 0);
}

TEST(ByteSampler, ShortestTextHasOneWindow) {
  const auto tokens = ramp(9);
  const Batch b = draw(tokens, 11, 1000, 3, 8);
  for (int64_t s = 0; s < 3; ++s) {
    EXPECT_EQ(b.input[s * 8], 0);
    EXPECT_EQ(b.target[s * 8 + 7], 8);
  }
}

TEST(ByteSampler, Errors) {
  const auto tokens = ramp(8);
  expect_error_containing([&] { draw(tokens, 1, 0, 1, 8); }, "fewer than seq_len + 1 = 9");
  expect_error_containing([&] { draw(tokens, 1, 0, 0, 4); }, "batch must be positive");
  expect_error_containing([&] { draw(tokens, 1, 0, 1, 0); }, "seq_len must be positive");
  expect_error_containing([&] { draw(tokens, 1, -1, 1, 4); }, "first_sample_index");
  std::vector<int32_t> in(8), tg(8);
  expect_error_containing([&] { sequential_batch(tokens.data(), 8, 0, 1, 8, in.data(), tg.data()); },
                          "sequential_batch");
}

TEST(ByteSampler, SequentialWindowsTileTheTextAndWrap) {
  const auto tokens = ramp(23);  // (23 - 1) / 5 = 4 windows
  const int64_t seq_len = 5;
  EXPECT_EQ(num_sequential_windows(23, seq_len), 4);
  EXPECT_EQ(num_sequential_windows(21, seq_len), 4);
  EXPECT_EQ(num_sequential_windows(20, seq_len), 3);
  std::vector<int32_t> in(6 * seq_len), tg(6 * seq_len);
  sequential_batch(tokens.data(), 23, 1, 6, seq_len, in.data(), tg.data());
  const int expected_window[6] = {1, 2, 3, 0, 1, 2};
  for (int b = 0; b < 6; ++b)
    for (int t = 0; t < seq_len; ++t) {
      EXPECT_EQ(in[b * seq_len + t], expected_window[b] * seq_len + t);
      EXPECT_EQ(tg[b * seq_len + t], expected_window[b] * seq_len + t + 1);
    }
}

}  // namespace
}  // namespace forge::byte_sampler_test
