// Dropout (ops::dropout), written once for every backend (op_harness.h). On the CPU the op is checked against
// its definition worked out here from the host Philox (core/philox.h): which elements drop is a function of
// (seed, site, sample, position, column) alone, and kept elements are x / (1 - rate) in one fp32 multiply; on
// a device its output must be the CPU's bit for bit (the same mask functions, the same multiply).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "forge/core/philox.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::dropout {

using testing::DeviceArray;

struct Case {
  int64_t rows, cols, seq, row_begin;
  float rate;
  bool permuted;  // positions: a context-parallel-like slice of a longer sequence (else the identity)
  std::string name() const {
    return "rows" + std::to_string(rows) + "_cols" + std::to_string(cols) + "_seq" + std::to_string(seq) +
           "_begin" + std::to_string(row_begin) + "_p" + std::to_string(static_cast<int>(rate * 100)) +
           (permuted ? "_positions" : "");
  }
};

// Column counts that are and are not multiples of the four a Philox block covers, a sequence-parallel rank's
// offset, a context-parallel slice, a single element and a heavy rate.
inline const std::vector<Case> kCases = {{12, 16, 4, 0, 0.1f, false},   {10, 13, 5, 7, 0.3f, false},
                                         {64, 130, 16, 32, 0.1f, true}, {1, 1, 1, 0, 0.5f, false},
                                         {9, 7, 3, 2, 0.9f, true},      {40, 64, 8, 0, 0.0f, false}};

constexpr uint64_t kSeed = 0x0123456789ABCDEFull;
constexpr uint32_t kStream = 5;
constexpr int64_t kFirstSample = (int64_t{3} << 32) + 17;  // beyond 32 bits: the high word enters the key

// Positions of a slice: every other position of a sequence twice as long, from the end (a permutation, so
// that a wrong index shows).
inline std::vector<int32_t> slice_positions(int64_t seq) {
  std::vector<int32_t> p(seq);
  for (int64_t i = 0; i < seq; ++i) p[i] = static_cast<int32_t>(2 * (seq - 1 - i) + 1);
  return p;
}

// The definition: kept iff the column's Philox word under (seed, the sample's high word) at counter
// (column / 4, position, sample's low word, stream), as a uniform in [0, 1), is at least the rate.
inline bool kept(const Case& c, const std::vector<int32_t>& positions, int64_t r, int64_t j) {
  const int64_t local = c.row_begin + r, at = local % c.seq;
  const auto sample = static_cast<uint64_t>(kFirstSample + local / c.seq);
  const uint32_t position = static_cast<uint32_t>(positions.empty() ? at : positions[at]);
  const std::array<uint32_t, 4> words =
      philox4x32_10({static_cast<uint32_t>(j / 4), position, static_cast<uint32_t>(sample), kStream},
                    {static_cast<uint32_t>(kSeed),
                     static_cast<uint32_t>(kSeed >> 32) ^ static_cast<uint32_t>(sample >> 32)});
  return uniform_closed_open(words[j % 4]) >= c.rate;
}

class DropoutOp : public testing::OpTest<Case> {
 protected:
  template <typename T>
  std::vector<T> run(Device on, const Case& c, const std::vector<T>& x_values, bool in_place) {
    const std::vector<int32_t> pos = c.permuted ? slice_positions(c.seq) : std::vector<int32_t>{};
    DeviceArray<T> x(on, x_values), y(on, x_values.size());
    DeviceArray<int32_t> positions(on, pos.empty() ? std::vector<int32_t>{0} : pos);
    ops::DropoutParams p;
    p.rows = c.rows, p.cols = c.cols, p.dtype = std::is_same_v<T, float> ? DType::f32 : DType::bf16;
    p.x = x.data(), p.y = in_place ? x.data() : y.data();
    p.rate = c.rate, p.seed = kSeed, p.stream = kStream;
    p.first_sample = kFirstSample, p.seq = c.seq, p.row_begin = c.row_begin;
    p.positions = pos.empty() ? nullptr : positions.data();
    FORGE_TEST_OP(dropout, on, p);
    return in_place ? x.download() : y.download();
  }
};

TEST_P(DropoutOp, KeepsWhatTheMaskKeepsScaledOnce) {
  const Case& c = test_case();
  const std::vector<float> x = testing::random_floats(c.rows * c.cols, 31);
  const std::vector<float> cpu = run<float>(Device::cpu, c, x, false);
  if (!on_cpu()) {
    EXPECT_EQ(run<float>(device(), c, x, false), cpu) << c.name();
    EXPECT_EQ(run<float>(device(), c, x, true), cpu) << c.name() << " in place";
    return;
  }
  const std::vector<int32_t> pos = c.permuted ? slice_positions(c.seq) : std::vector<int32_t>{};
  const float scale = 1.0f / (1.0f - c.rate);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < c.cols; ++j) {
      const int64_t i = r * c.cols + j;
      ASSERT_EQ(cpu[i], kept(c, pos, r, j) ? x[i] * scale : 0.0f) << c.name() << " row " << r << " col " << j;
    }
  EXPECT_EQ(run<float>(Device::cpu, c, x, true), cpu) << "in place";
}

// bf16 tensors: the fp32 result rounded once, bit for bit, on every backend.
TEST_P(DropoutOp, Bf16HoldsTheFp32ResultRoundedOnce) {
  const Case& c = test_case();
  std::vector<float> x = testing::random_floats(c.rows * c.cols, 32);
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = float_to_bf16(x[i]), x[i] = bf16_to_float(bits[i]);
  const std::vector<float> f32 = run<float>(Device::cpu, c, x, false);
  std::vector<uint16_t> want(f32.size());
  for (size_t i = 0; i < f32.size(); ++i) want[i] = float_to_bf16(f32[i]);
  EXPECT_EQ(run<uint16_t>(device(), c, bits, false), want) << c.name();
}

// A micro-batch's rows split between two calls (sequence parallelism's shards) drop what one call over all
// of them drops.
TEST_P(DropoutOp, RowsSplitAnywhereDropTheSame) {
  Case c = test_case();
  const std::vector<float> x = testing::random_floats(c.rows * c.cols, 33);
  const std::vector<float> whole = run<float>(device(), c, x, false);
  const int64_t first = c.rows / 2;
  Case head = c, tail = c;
  head.rows = first, tail.rows = c.rows - first, tail.row_begin = c.row_begin + first;
  std::vector<float> split = run<float>(device(), head, {x.begin(), x.begin() + first * c.cols}, false);
  if (tail.rows > 0) {
    const std::vector<float> rest = run<float>(device(), tail, {x.begin() + first * c.cols, x.end()}, false);
    split.insert(split.end(), rest.begin(), rest.end());
  }
  EXPECT_EQ(split, whole) << c.name();
}

// Over many elements the dropped fraction is the rate, within five standard deviations of a binomial.
class DropoutRate : public testing::OpTest<testing::FixedCase> {};

TEST_P(DropoutRate, DropsTheRateOfElements) {
  for (float rate : {0.05f, 0.1f, 0.5f}) {
    const Case c{256, 512, 64, 0, rate, false};
    const std::vector<float> x(c.rows * c.cols, 1.0f);
    DeviceArray<float> xs(device(), x);
    ops::DropoutParams p;
    p.rows = c.rows, p.cols = c.cols, p.x = xs.data(), p.y = xs.data(), p.rate = rate, p.seed = 7;
    p.first_sample = 0, p.seq = c.seq;
    FORGE_TEST_OP(dropout, device(), p);
    const std::vector<float> y = xs.download();
    const double n = static_cast<double>(y.size());
    const double dropped = static_cast<double>(std::count(y.begin(), y.end(), 0.0f));
    EXPECT_NEAR(dropped / n, rate, 5 * std::sqrt(rate * (1 - rate) / n)) << "rate " << rate;
    // Another site drops other elements: the two masks agree on about rate^2 + (1 - rate)^2 of them.
    DeviceArray<float> other(device(), x);
    p.x = other.data(), p.y = other.data(), p.stream = 1;
    FORGE_TEST_OP(dropout, device(), p);
    const std::vector<float> z = other.download();
    double same = 0;
    for (size_t i = 0; i < y.size(); ++i) same += (y[i] == 0.0f) == (z[i] == 0.0f);
    const double agree = rate * rate + (1 - rate) * (1 - rate);
    EXPECT_NEAR(same / n, agree, 5 * std::sqrt(agree * (1 - agree) / n)) << "rate " << rate;
  }
}

}  // namespace forge::op_tests::dropout
