// RoPE: the cos/sin tables, and the op tests (op_tests/rope.h) on the CPU and the device emulation.
#include "kernels/op_tests/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "forge/kernels/rope_tables.h"
#include "op_harness.h"

namespace forge::op_tests::rope {
FORGE_INSTANTIATE_OP_TEST(RopeOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
}  // namespace forge::op_tests::rope

namespace forge::rope_test {

namespace {

struct TableValue {
  int64_t position, index;
  double cos, sin;
};

void expect_table_values(int64_t positions, int64_t head_dim, double theta, const RopeScaling& scaling,
                         std::initializer_list<TableValue> values) {
  const int64_t half = head_dim / 2;
  std::vector<float> cos(positions * half), sin(positions * half);
  rope_tables(positions, head_dim, theta, scaling, cos.data(), sin.data());
  for (const auto& v : values) {
    // Angles reach ~9000 rad, where a float ulp of the angle is ~1e-3; the tables are computed in double,
    // so only the final rounding to float remains.
    EXPECT_NEAR(cos[v.position * half + v.index], v.cos, 1e-7) << v.position << "," << v.index;
    EXPECT_NEAR(sin[v.position * half + v.index], v.sin, 1e-7) << v.position << "," << v.index;
  }
}

TEST(RopeTables, DefaultMatchesFormula) {
  const int64_t positions = 50, head_dim = 12;
  std::vector<float> cos(positions * head_dim / 2), sin(cos.size());
  rope_tables(positions, head_dim, 10000.0, RopeScaling{}, cos.data(), sin.data());
  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / head_dim);
      EXPECT_NEAR(cos[t * head_dim / 2 + i], std::cos(angle), 1e-7);
      EXPECT_NEAR(sin[t * head_dim / 2 + i], std::sin(angle), 1e-7);
    }
}

// Expected values come from an independent float64 PyTorch implementation of Hugging Face's
// _compute_llama3_parameters (torch.where over wavelengths, then cos/sin of arange(positions) x inv_freq),
// run with Debian's python3-torch. The chosen indices cover the high-frequency (kept), interpolated and
// low-frequency (divided by factor) bands.
// Expected values from an independent float64 Python implementation of Hugging Face's
// _compute_yarn_parameters (correction range floored / ceiled and clamped, linear ramp between extrapolated
// and interpolated frequencies, cos and sin times get_mscale(factor, mscale) / get_mscale(factor,
// mscale_all_dim)). The small case's ramp spans pairs 0..5 and its magnitude is 0.9643; DeepSeek-V3's (factor
// 40 over 4096 positions, mscale = mscale_all_dim = 1) has magnitude 1 and a ramp over pairs 10..23.
TEST(RopeTables, YarnMatchesHuggingFace) {
  RopeScaling small;
  small.kind = RopeScaling::Kind::yarn;
  small.factor = 4, small.original_max_position_embeddings = 64, small.beta_fast = 8, small.beta_slow = 1;
  small.mscale = 0.707, small.mscale_all_dim = 1.0;
  EXPECT_NEAR(small.attention_factor(), 0.964326914892074, 1e-12);
  expect_table_values(100, 16, 100.0, small,
                      {{1, 0, 5.210280557e-01, 8.114531188e-01},
                       {37, 1, 3.816241407e-01, -8.856011597e-01},
                       {99, 2, -9.615018022e-01, 7.376098705e-02},
                       {50, 3, 1.706307341e-01, -9.491109268e-01},
                       {99, 4, -6.590063593e-01, -7.040149268e-01},
                       {77, 5, 4.523809652e-01, 8.516324683e-01},
                       {99, 7, 8.724253778e-01, 4.108532085e-01}});
  RopeScaling deepseek;
  deepseek.kind = RopeScaling::Kind::yarn;
  deepseek.factor = 40, deepseek.original_max_position_embeddings = 4096, deepseek.beta_fast = 32;
  deepseek.beta_slow = 1, deepseek.mscale = 1.0, deepseek.mscale_all_dim = 1.0;
  EXPECT_EQ(deepseek.attention_factor(), 1.0);
  expect_table_values(5000, 64, 10000.0, deepseek,
                      {{1, 0, 5.403023059e-01, 8.414709848e-01},
                       {4095, 5, -9.475221249e-01, -3.196901981e-01},
                       {4999, 10, -5.808132831e-02, -9.983118547e-01},
                       {3000, 16, -7.023970575e-01, -7.117853424e-01},
                       {4999, 20, -6.891623966e-01, -7.246069218e-01},
                       {777, 25, 9.998939076e-01, 1.456617987e-02},
                       {4999, 31, 9.998611307e-01, 1.666491264e-02}});
  // Without mscale_all_dim the magnitude is get_mscale(factor) = 0.1 ln 4 + 1.
  small.mscale_all_dim = 0;
  EXPECT_NEAR(small.attention_factor(), 0.1 * std::log(4.0) + 1, 1e-15);
  RopeScaling bad = deepseek;
  bad.beta_fast = 0.5;
  EXPECT_THROW(expect_table_values(10, 64, 10000.0, bad, {}), Error);
}

TEST(RopeTables, Llama3MatchesPyTorch) {
  RopeScaling small;
  small.kind = RopeScaling::Kind::llama3;
  small.factor = 4, small.low_freq_factor = 2, small.high_freq_factor = 8;
  small.original_max_position_embeddings = 64;
  expect_table_values(100, 16, 10000.0, small,
                      {{1, 0, 5.403023059e-01, 8.414709848e-01},
                       {37, 2, 6.018345924e-01, 7.986207632e-01},
                       {99, 4, 9.695279031e-01, 2.449809076e-01},
                       {50, 6, 9.999218760e-01, 1.249967448e-02},
                       {99, 1, 9.992512145e-01, 3.869121848e-02},
                       {77, 5, 9.981477596e-01, 6.083625598e-02},
                       {99, 7, 9.999693720e-01, 7.826557304e-03}});
  // Llama 3.1's configuration.
  RopeScaling llama31;
  llama31.kind = RopeScaling::Kind::llama3;
  llama31.factor = 8, llama31.low_freq_factor = 1, llama31.high_freq_factor = 4;
  llama31.original_max_position_embeddings = 8192;
  expect_table_values(9000, 128, 500000.0, llama31,
                      {{1, 0, 5.403023059e-01, 8.414709848e-01},
                       {37, 2, 8.367390577e-01, -5.476018164e-01},
                       {8191, 4, 8.802174280e-01, 4.745706264e-01},
                       {5000, 6, -9.557701815e-01, -2.941145357e-01},
                       {8999, 29, 7.976459183e-01, 6.031260143e-01},
                       {8999, 31, 1.435777372e-01, 9.896390420e-01},
                       {4000, 34, 7.557280155e-01, 6.548856134e-01},
                       {777, 50, 9.999941252e-01, 3.427755730e-03},
                       {8999, 63, 9.999961864e-01, 2.761722987e-03}});
}

TEST(RopeTables, RejectsOddHeadDim) {
  std::vector<float> cos(10), sin(10);
  EXPECT_THROW(rope_tables(2, 7, 10000.0, RopeScaling{}, cos.data(), sin.data()), Error);
}

}  // namespace
}  // namespace forge::rope_test
