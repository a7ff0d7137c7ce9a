// The element-wise ops (ops::add_inplace, scale_inplace, sum_squares, sum_squares_accumulate,
// convert_to_bf16, convert_to_f32, amax, amax_to), written once for every backend (op_harness.h): on the CPU
// against the exact or double-precision result, elsewhere against the CPU kernel on the same inputs. Copies,
// additions and products in the same order are bitwise equal; sum_squares, whose order differs between
// backends, within the rounding bound of n double additions (each square is exact in double) and bitwise
// repeatable; the conversions and amax are exact functions of the bits.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::elementwise {

using testing::DeviceArray;

struct Case {
  int64_t n;
  std::string name() const { return std::string("n").append(std::to_string(n)); }
};

// Empty; one element; sizes around the CPU's and the GPU's block sizes (16384) with ragged tails; large
// enough for the parallel paths and many reduction blocks; and past 2^24 for the flat GPU kernels'
// grid-stride loops.
inline const std::vector<Case> kCases = {{0},
                                         {1},
                                         {5},
                                         {37},
                                         {255},
                                         {1000},
                                         {16384},
                                         {16385},
                                         {100003},
                                         {300001},
                                         {1000003},
                                         {3000017},
                                         {(int64_t{1} << 24) + 4099}};

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A cheap deterministic generator (inputs reach 17M elements; mt19937 would dominate the test time).
struct Random {
  uint64_t state;
  explicit Random(uint64_t seed) : state(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint32_t next() {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return static_cast<uint32_t>(state >> 16);
  }
};

// +-(1 + m/64) * 2^e with six fraction bits, e in [-6, 6] shifted by up to +-8 per 128 elements: one row of
// the FP8 casts' test inputs (kernels/cuda/fp8_cast_test.cpp), without their specials.
inline std::vector<float> spread_values(int64_t n, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(n));
  Random random(seed);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = random.next();
    const int block_shift = static_cast<int>((i / 128 * 13) % 17) - 8;
    const int exponent = static_cast<int>(bits % 13) - 6 + block_shift;
    x[i] = std::bit_cast<float>(((bits >> 20) & 1u) << 31 | uint32_t(127 + exponent) << 23 |
                                ((bits >> 8) % 64) << 17);
  }
  return x;
}

// Uniform values below 17M elements (mt19937, as elsewhere), the cheap generator's above.
inline std::vector<float> inputs(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  return n <= 4000000 ? testing::random_floats(n, seed, lo, hi) : spread_values(n, seed);
}

class ElementwiseOp : public testing::OpTest<Case> {};

TEST_P(ElementwiseOp, AddInplace) {
  const int64_t n = test_case().n;
  const std::vector<float> y0 = inputs(n, 81), x = inputs(n, 82, -3, 3);
  DeviceArray<float> y(device(), y0), dx(device(), x);
  FORGE_TEST_OP(add_inplace, device(), y.data(), dx.data(), n);
  std::vector<float> want = y0;
  if (on_cpu()) {
    for (int64_t i = 0; i < n; ++i) want[i] += x[i];
  } else {
    FORGE_TEST_OP(add_inplace, Device::cpu, want.data(), x.data(), n);
  }
  testing::expect_bitwise_equal(y.download(), want, "add_inplace n=" + std::to_string(n));
  // y += y (the same array twice) is allowed.
  DeviceArray<float> aliased(device(), y0);
  FORGE_TEST_OP(add_inplace, device(), aliased.data(), aliased.data(), n);
  want = y0;
  for (float& v : want) v += v;
  testing::expect_bitwise_equal(aliased.download(), want, "add_inplace aliased n=" + std::to_string(n));
}

TEST_P(ElementwiseOp, ScaleInplace) {
  const int64_t n = test_case().n;
  for (float s : {0.37f, -3.0f, 0.0f}) {
    const std::vector<float> x0 = inputs(n, 83, -5, 5);
    DeviceArray<float> x(device(), x0);
    FORGE_TEST_OP(scale_inplace, device(), x.data(), s, n);
    std::vector<float> want = x0;
    if (on_cpu()) {
      for (float& w : want) w *= s;
    } else {
      FORGE_TEST_OP(scale_inplace, Device::cpu, want.data(), s, n);
    }
    testing::expect_bitwise_equal(x.download(), want,
                                  "scale_inplace n=" + std::to_string(n) + " s=" + std::to_string(s));
  }
}

TEST_P(ElementwiseOp, SumSquares) {
  const int64_t n = test_case().n;
  const std::vector<float> x = inputs(n, 84, -100, 100);
  DeviceArray<float> dx(device(), x);
  const double got = FORGE_TEST_OP(sum_squares, device(), dx.data(), n);
  if (on_cpu()) {
    // Each square is exact in double; the sum in long double with compensation is exact to far below the
    // bound.
    long double want = 0, compensation = 0;
    for (float v : x) {
      const long double term = static_cast<long double>(double{v} * v) - compensation, sum = want + term;
      compensation = (sum - want) - term;
      want = sum;
    }
    EXPECT_NEAR(got, static_cast<double>(want), 1e-13 * static_cast<double>(want));
  } else {
    // Squares are exact in double; only the order of n double additions differs.
    const double cpu = FORGE_TEST_OP(sum_squares, Device::cpu, x.data(), n);
    EXPECT_LE(std::abs(got - cpu), static_cast<double>(n) * 0x1p-53 * cpu) << "n=" << n;
  }
  if (n == 0) {
    EXPECT_EQ(got, 0.0);
  }
  if (n == 1) {
    EXPECT_EQ(got, double{x[0]} * x[0]);
  }
}

// The order of every reduction is a function of n: the same bits on every run.
TEST_P(ElementwiseOp, SumSquaresIsBitwiseRepeatable) {
  const int64_t n = test_case().n;
  DeviceArray<float> x(device(), inputs(n, 85, -10, 10));
  const double first = FORGE_TEST_OP(sum_squares, device(), x.data(), n);
  for (int run = 0; run < 3; ++run)
    EXPECT_EQ(std::bit_cast<uint64_t>(FORGE_TEST_OP(sum_squares, device(), x.data(), n)),
              std::bit_cast<uint64_t>(first));
}

// Accumulating over ranges adds each range's sum into the total, where the op runs, in call order: bitwise
// the host's additions of the returning form's sums (on the same backend), in the same order.
TEST_P(ElementwiseOp, SumSquaresAccumulateAddsEachRangeInOrder) {
  const int64_t n = test_case().n, cut = n / 3;
  DeviceArray<float> x(device(), inputs(n, 86, -100, 100));
  DeviceArray<double> total(device(), std::vector<double>{1.5});
  FORGE_TEST_OP(sum_squares_accumulate, device(), x.data(), cut, total.data());
  FORGE_TEST_OP(sum_squares_accumulate, device(), x.data() + cut, n - cut, total.data());
  FORGE_TEST_OP(sum_squares_accumulate, device(), x.data(), 0, total.data());
  double want = 1.5;
  want += FORGE_TEST_OP(sum_squares, device(), x.data(), cut);
  want += FORGE_TEST_OP(sum_squares, device(), x.data() + cut, n - cut);
  EXPECT_EQ(std::bit_cast<uint64_t>(total.download()[0]), std::bit_cast<uint64_t>(want));
  EXPECT_FALSE(ops::supports_sum_squares_accumulate(x.data(), n, nullptr, device()));
  testing::expect_error_containing([&] { ops::sum_squares_accumulate(x.data(), n, nullptr, device()); },
                                   {"sum_squares_accumulate: total is null"});
}

// bf16 conversions are exact functions of the bits: round-to-nearest-even (ties included), overflow to inf,
// NaN kept quiet with its sign, and back by a shift.
TEST_P(ElementwiseOp, Bf16Conversions) {
  const int64_t n = test_case().n;
  std::vector<float> x = inputs(n, 7, -1e4, 1e4);
  const float specials[] = {0.0f,
                            -0.0f,
                            kInf,
                            -kInf,
                            kNaN,
                            std::bit_cast<float>(0xffc00001u),
                            std::bit_cast<float>(0x7f800001u),  // signalling NaN
                            std::bit_cast<float>(0x3f808000u),  // a tie to even (down)
                            std::bit_cast<float>(0x3f818000u),  // a tie to even (up)
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            1e-40f};
  std::copy_n(std::begin(specials), std::min<int64_t>(n, std::size(specials)), x.begin());
  DeviceArray<float> dx(device(), x), back(device(), x.size());
  DeviceArray<uint16_t> dy(device(), x.size());
  FORGE_TEST_OP(convert_to_bf16, device(), dx.data(), dy.data(), n);
  FORGE_TEST_OP(convert_to_f32, device(), dy.data(), back.data(), n);
  const std::vector<uint16_t> bf16 = dy.download();
  std::vector<uint16_t> want(x.size());
  std::vector<float> want_back(x.size());
  if (on_cpu()) {
    for (int64_t i = 0; i < n; ++i)
      want[i] = f32_to_bf16_bits(x[i]), want_back[i] = bf16_bits_to_f32(want[i]);
  } else {
    FORGE_TEST_OP(convert_to_bf16, Device::cpu, x.data(), want.data(), n);
    FORGE_TEST_OP(convert_to_f32, Device::cpu, want.data(), want_back.data(), n);
  }
  size_t bad = 0, first = 0;
  for (int64_t i = 0; i < n; ++i)
    if (bf16[i] != want[i] && bad++ == 0) first = static_cast<size_t>(i);
  EXPECT_EQ(bad, 0u) << "convert_to_bf16: first difference at " << first << ": input "
                     << testing::show(x[first]) << ", got 0x" << std::hex << bf16[first] << ", want 0x"
                     << want[first];
  testing::expect_bitwise_equal(back.download(), want_back, "convert_to_f32");
}

// max |x| on the host and into device memory (amax_to): NaN when any element is NaN (the canonical quiet NaN,
// whatever the NaN's bits), 0 for n = 0. Variants put -inf, NaNs (in the vector tail, negative; at the front)
// or a unique maximum in each float4 lane; odd variants start one element past an aligned address (the scalar
// path).
TEST_P(ElementwiseOp, Amax) {
  const int64_t n = test_case().n;
  const std::vector<float> original = spread_values(n, 11);
  for (int variant = 0; variant < 8; ++variant) {
    if (n == 0 && variant > 1) break;
    std::vector<float> x = original;
    if (n > 0) {
      if (variant == 1) x[n / 2] = -kInf;
      if (variant == 2) x[n - 1] = std::bit_cast<float>(0xffc00001u);
      if (variant == 3) x[0] = kNaN;
      if (variant >= 4) x[std::min(n - 1, n / 2 + variant - 4)] = -1e30f;
    }
    const std::string what = "amax n=" + std::to_string(n) + " variant " + std::to_string(variant);
    DeviceArray<float> dx(device(), x, variant % 2);
    DeviceArray<float> out(device(), std::vector<float>{-1.0f});
    const float got = FORGE_TEST_OP(amax, device(), dx.data(), n);
    FORGE_TEST_OP(amax_to, device(), dx.data(), n, out.data());
    float want = 0.0f;
    if (on_cpu()) {
      for (float v : x) want = std::isnan(v) || std::isnan(want) ? kNaN : std::max(want, std::abs(v));
    } else {
      want = FORGE_TEST_OP(amax, Device::cpu, x.data(), n);
    }
    EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
        << what << ": got " << testing::show(got) << ", want " << testing::show(want);
    EXPECT_EQ(std::bit_cast<uint32_t>(out.download()[0]), std::bit_cast<uint32_t>(got))
        << what << " (amax_to)";
  }
}

}  // namespace forge::op_tests::elementwise
