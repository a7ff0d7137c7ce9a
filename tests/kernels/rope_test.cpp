#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "forge/kernels/rope_tables.h"
#include "op_harness.h"

namespace forge {
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

// A [batch, seq, heads, head_dim] tensor inside a wider token row (as q sits inside a fused qkv buffer).
struct Problem {
  int64_t batch = 2, seq = 5, heads = 3, head_dim = 8, token_stride = 3 * 8 + 10, offset = 2;
  int64_t positions = 7;
  std::vector<float> x, cos, sin;
  Problem() {
    x = testing::random_floats(batch * seq * token_stride, 21);
    cos.resize(positions * head_dim / 2), sin.resize(positions * head_dim / 2);
    rope_tables(positions, head_dim, 10000.0, RopeScaling{}, cos.data(), sin.data());
  }
  ops::RopeParams params(float* data, bool inverse) const {
    ops::RopeParams p;
    p.batch = batch, p.seq = seq, p.heads = heads, p.head_dim = head_dim, p.token_stride = token_stride;
    p.x = data, p.cos = cos.data(), p.sin = sin.data(), p.position_offset = offset, p.inverse = inverse;
    return p;
  }
  // HF: out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1). Padding
  // between tokens passes through unchanged.
  std::vector<double> reference(const std::vector<double>& in) const {
    std::vector<double> out = in;
    const int64_t half = head_dim / 2;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < seq; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t base = (b * seq + t) * token_stride + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const double c = cos[(offset + t) * half + i], s = sin[(offset + t) * half + i];
            const double x1 = in[base + i], x2 = in[base + half + i];
            out[base + i] = x1 * c - x2 * s;
            out[base + half + i] = x2 * c + x1 * s;
          }
        }
    return out;
  }
};

TEST(Rope, ForwardMatchesDoubleReference) {
  Problem pr;
  auto want = pr.reference(testing::to_double(pr.x));
  auto got = pr.x;
  ops::rope(pr.params(got.data(), false));
  EXPECT_LT(testing::relative_error(got, want), 1e-6);
  // Padding columns are untouched bitwise.
  for (int64_t token = 0; token < pr.batch * pr.seq; ++token)
    for (int64_t j = pr.heads * pr.head_dim; j < pr.token_stride; ++j)
      ASSERT_EQ(got[token * pr.token_stride + j], pr.x[token * pr.token_stride + j]);
}

TEST(Rope, InverseUndoesForward) {
  Problem pr;
  auto got = pr.x;
  ops::rope(pr.params(got.data(), false));
  ops::rope(pr.params(got.data(), true));
  EXPECT_LT(testing::relative_error(got, testing::to_double(pr.x)), 1e-6);
}

TEST(Rope, InverseIsTheGradient) {
  // For loss <w, rope(x)>, dL/dx = rope^T w: the inverse rotation applied to w.
  Problem pr;
  const auto w = testing::random_floats(pr.x.size(), 22);
  const auto wd = testing::to_double(w);
  auto fd = testing::finite_difference(
      [&](const std::vector<double>& x) { return testing::dot(wd, pr.reference(x)); },
      testing::to_double(pr.x));
  auto grad = w;
  ops::rope(pr.params(grad.data(), true));
  EXPECT_LT(testing::relative_error(grad, fd), 1e-6);
}

}  // namespace
}  // namespace forge
