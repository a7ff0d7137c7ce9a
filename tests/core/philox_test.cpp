#include "forge/core/philox.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <set>

namespace forge::philox_test {
namespace {

// Known-answer vectors of Random123 (kat_vectors, the "philox4x32 10" lines: counter, key, expected).
// The expected words were also reproduced by an independent Python implementation of Philox4x32-10 run
// with python3 while writing this test (round: hi(M1*c2)^c1^k0, lo(M1*c2), hi(M0*c0)^c3^k1, lo(M0*c0);
// key bumped by the Weyl constants before rounds 2..10).
struct KnownAnswer {
  PhiloxCounter counter;
  PhiloxKey key;
  std::array<uint32_t, 4> expected;
};

TEST(Philox, Random123KnownAnswers) {
  const KnownAnswer cases[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const KnownAnswer& c : cases) EXPECT_EQ(philox4x32_10(c.counter, c.key), c.expected);
}

// Neighbouring counters and keys give unrelated outputs: about half of the 128 bits flip.
TEST(Philox, OneBitChangesFlipAboutHalfTheBits) {
  const PhiloxCounter base{12, 34, 56, 78};
  const PhiloxKey key{0xdead, 0xbeef};
  const auto reference = philox4x32_10(base, key);
  for (int word = 0; word < 4; ++word) {
    for (int bit : {0, 17, 31}) {
      PhiloxCounter c = base;
      c[word] ^= 1u << bit;
      const auto out = philox4x32_10(c, key);
      int flipped = 0;
      for (int i = 0; i < 4; ++i) flipped += std::popcount(out[i] ^ reference[i]);
      EXPECT_GT(flipped, 32) << "word " << word << " bit " << bit;
      EXPECT_LT(flipped, 96) << "word " << word << " bit " << bit;
    }
  }
  EXPECT_NE(philox4x32_10(base, {0xdead, 0xbeee}), reference);
}

TEST(Philox, UniformRangesAreExactAndHalfOpen) {
  EXPECT_EQ(uniform_open_closed(0), 0x1p-24f);
  EXPECT_EQ(uniform_open_closed(0xffffffffu), 1.0f);
  EXPECT_EQ(uniform_closed_open(0), 0.0f);
  EXPECT_EQ(uniform_closed_open(0xffffffffu), 1.0f - 0x1p-24f);
  EXPECT_EQ(uniform_closed_open(0x80000000u), 0.5f);
  // Mean and variance of a stream of uniforms, against 1/2 and 1/12 (5 sigma bounds for n = 1e5).
  const int n = 100000;
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < n / 4; ++i) {
    for (uint32_t w : philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0}, {1, 2})) {
      const double u = uniform_closed_open(w);
      ASSERT_GE(u, 0.0);
      ASSERT_LT(u, 1.0);
      sum += u;
      sum_sq += u * u;
    }
  }
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(1.0 / 12 / n));
  EXPECT_NEAR(var, 1.0 / 12, 5 * std::sqrt(1.0 / 180 / n));  // var of (u-1/2)^2 is 1/180
}

TEST(Philox, BoxMullerEndpointsAndMoments) {
  // a = 2^32 - 1 gives u1 = 1, radius 0; b = 0 gives angle 0.
  EXPECT_EQ(standard_normal_pair_double(0xffffffffu, 123)[0], 0.0);
  const auto z = standard_normal_pair_double(0, 0);  // u1 = 2^-32: radius sqrt(64 ln 2)
  EXPECT_DOUBLE_EQ(z[0], std::sqrt(64 * std::log(2.0)));
  EXPECT_EQ(z[1], 0.0);
  const auto quarter = standard_normal_pair_double(0, 0x40000000u);  // angle pi/2
  EXPECT_NEAR(quarter[0], 0.0, 1e-15);
  EXPECT_DOUBLE_EQ(quarter[1], std::sqrt(64 * std::log(2.0)));
  const auto pair_f = standard_normal_pair(0x12345678u, 0x9abcdef0u);
  const auto pair_d = standard_normal_pair_double(0x12345678u, 0x9abcdef0u);
  EXPECT_EQ(pair_f[0], static_cast<float>(pair_d[0]));
  EXPECT_EQ(pair_f[1], static_cast<float>(pair_d[1]));

  // Moments of 1e5 normals (both branches), 5 sigma bounds: mean 0, variance 1, excess kurtosis 0;
  // and the mass within one sigma (0.6827).
  const int n = 100000;
  double s1 = 0, s2 = 0, s4 = 0;
  int within_one = 0;
  for (int i = 0; i < n / 2; ++i) {
    const auto w = philox4x32_10({static_cast<uint32_t>(i), 7, 0, 0}, {3, 4});
    for (double x : standard_normal_pair_double(w[0], w[1])) {
      s1 += x, s2 += x * x, s4 += x * x * x * x;
      within_one += std::abs(x) < 1.0;
    }
  }
  EXPECT_NEAR(s1 / n, 0.0, 5 / std::sqrt(n));
  EXPECT_NEAR(s2 / n, 1.0, 5 * std::sqrt(2.0 / n));
  EXPECT_NEAR(s4 / n, 3.0, 5 * std::sqrt(96.0 / n));
  const double p = 0.682689492137;
  EXPECT_NEAR(double(within_one) / n, p, 5 * std::sqrt(p * (1 - p) / n));
}

}  // namespace
}  // namespace forge::philox_test
