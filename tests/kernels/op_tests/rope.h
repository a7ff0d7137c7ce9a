// Rotary position embedding (ops::rope), written once for every backend (op_harness.h): on the CPU against
// the double-precision reference (the inverse against finite differences: it is the gradient), elsewhere
// against the CPU kernel on the same inputs.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "forge/kernels/rope_tables.h"
#include "op_harness.h"

namespace forge::op_tests::rope {

using testing::DeviceArray;
using testing::kU;

// x is [batch, seq, heads, head_dim] inside token rows of token_stride floats (as q sits inside a fused qkv
// buffer): the rest of each row must come back untouched.
struct Case {
  int64_t batch, seq, heads, head_dim, token_stride, position_offset;
  bool inverse;
  bool interleaved = false;
  std::string name() const {
    return "b" + std::to_string(batch) + "_s" + std::to_string(seq) + "_h" + std::to_string(heads) + "_d" +
           std::to_string(head_dim) + "_stride" + std::to_string(token_stride) + "_offset" +
           std::to_string(position_offset) + (inverse ? "_inverse" : "") +
           (interleaved ? "_interleaved" : "");
  }
  int64_t elements() const { return batch * seq * token_stride; }
};

inline const std::vector<Case> kCases = {
    {2, 5, 3, 8, 3 * 8 + 10, 2, false},  // small enough for finite differences, both directions
    {2, 5, 3, 8, 3 * 8 + 10, 2, true},
    {2, 13, 3, 64, 3 * 64, 0, false},
    {2, 13, 3, 64, 3 * 64, 5, true},
    {1, 37, 4, 6, 8 * 6, 3, false},          // q heads inside a fused q|k|v row: the rest stays untouched
    {3, 7, 5, 128, 5 * 128 + 64, 11, true},  // padding between tokens
    {1, 1, 1, 2, 2, 0, false},
    {2, 29, 3, 96, 3 * 96 + 32, 7, false},
    // DeepSeek-V3's rope_interleave: pairs (2i, 2i + 1).
    {2, 5, 3, 8, 3 * 8 + 10, 2, false, true},
    {2, 5, 3, 8, 3 * 8 + 10, 2, true, true},
    {2, 13, 4, 64, 4 * 64 + 64, 3, false, true},
    {1, 9, 1, 6, 20, 0, true, true},
};

struct Problem {
  Case c;
  std::vector<float> x, cos, sin;
  Problem(const Case& c_, uint32_t seed) : c(c_) {
    x = testing::random_floats(c.elements(), seed, -3, 3);
    const int64_t positions = c.position_offset + c.seq;
    cos.resize(positions * c.head_dim / 2), sin.resize(positions * c.head_dim / 2);
    rope_tables(positions, c.head_dim, 10000.0, RopeScaling{}, cos.data(), sin.data());
  }
  // HF: out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1); interleaved,
  // the pair of frequency i is (x[2i], x[2i + 1]), rotated in place; the inverse rotates by -angle. Padding
  // between tokens passes through unchanged.
  std::vector<double> reference(const std::vector<double>& in, bool inverse) const {
    std::vector<double> out = in;
    const int64_t half = c.head_dim / 2;
    const double sign = inverse ? -1 : 1;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = 0; t < c.seq; ++t)
        for (int64_t h = 0; h < c.heads; ++h) {
          const int64_t base = (b * c.seq + t) * c.token_stride + h * c.head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const int64_t row = (c.position_offset + t) * half + i;
            const double cs = cos[row], sn = sign * sin[row];
            const int64_t first = base + (c.interleaved ? 2 * i : i),
                          second = first + (c.interleaved ? 1 : half);
            const double x1 = in[first], x2 = in[second];
            out[first] = x1 * cs - x2 * sn;
            out[second] = x2 * cs + x1 * sn;
          }
        }
    return out;
  }
};

class RopeOp : public testing::OpTest<Case> {
 protected:
  // x rotated on `on`, forward or inverse.
  static std::vector<float> rotate(Device on, const Problem& pr, const std::vector<float>& x, bool inverse) {
    DeviceArray<float> data(on, x), cos(on, pr.cos), sin(on, pr.sin);
    ops::RopeParams p;
    p.batch = pr.c.batch, p.seq = pr.c.seq, p.heads = pr.c.heads, p.head_dim = pr.c.head_dim;
    p.token_stride = pr.c.token_stride, p.position_offset = pr.c.position_offset, p.inverse = inverse;
    p.interleaved = pr.c.interleaved;
    p.x = data.data(), p.cos = cos.data(), p.sin = sin.data();
    FORGE_TEST_OP(rope, on, p);
    return data.download();
  }
};

TEST_P(RopeOp, Rotates) {
  const Case& c = test_case();
  const Problem pr(c, 50);
  const std::vector<float> cpu = rotate(Device::cpu, pr, pr.x, c.inverse);
  const int64_t half = c.head_dim / 2, rotated = c.heads * c.head_dim;
  if (on_cpu()) {
    EXPECT_LT(testing::relative_error(cpu, pr.reference(testing::to_double(pr.x), c.inverse)), 1e-6);
    // Padding columns are untouched bitwise.
    for (int64_t token = 0; token < c.batch * c.seq; ++token)
      for (int64_t j = rotated; j < c.token_stride; ++j)
        ASSERT_EQ(cpu[token * c.token_stride + j], pr.x[token * c.token_stride + j]);
    if (c.inverse && c.elements() <= 5000) {
      // For loss <w, rope(x)>, dL/dx = rope^T w: the inverse rotation applied to w (here the case's input).
      const std::vector<float> w = pr.x;
      const auto wd = testing::to_double(w);
      const auto fd = testing::finite_difference(
          [&](const std::vector<double>& x) { return testing::dot(wd, pr.reference(x, false)); },
          testing::to_double(testing::random_floats(c.elements(), 22)));
      EXPECT_LT(testing::relative_error(cpu, fd), 1e-6);
    }
    return;
  }
  const std::vector<float> got = rotate(device(), pr, pr.x, c.inverse);
  // Each output is a c + or - b s of its pair (a, b), |c|, |s| <= 1: within a few roundings of |a| + |b|.
  // Elements outside the rotated heads must come back bitwise untouched.
  testing::expect_all(got, cpu, "rope " + c.name(), [&](size_t i) {
    const int64_t within = static_cast<int64_t>(i) % c.token_stride;
    if (within >= rotated) return std::bit_cast<uint32_t>(got[i]) == std::bit_cast<uint32_t>(pr.x[i]);
    const int64_t in_head = within % c.head_dim;
    const size_t partner = c.interleaved    ? (in_head % 2 == 0 ? i + 1 : i - 1)
                           : in_head < half ? i + half
                                            : i - half;
    return std::abs(double{got[i]} - double{cpu[i]}) <=
           4 * kU * (std::abs(pr.x[i]) + std::abs(pr.x[partner]));
  });
}

TEST_P(RopeOp, InverseUndoesForward) {
  const Case& c = test_case();
  const Problem pr(c, 51);
  const std::vector<float> there = rotate(device(), pr, pr.x, c.inverse);
  const std::vector<float> back = rotate(device(), pr, there, !c.inverse);
  if (on_cpu()) {
    EXPECT_LT(testing::relative_error(back, testing::to_double(pr.x)), 1e-6);
    return;
  }
  // cos^2 + sin^2 = 1 up to the tables' rounding; two rotations of a pair of magnitude <= 3 * sqrt(2).
  testing::expect_close(back, pr.x, "rope " + c.name() + " and back", [](size_t) { return 3e-6; });
}

}  // namespace forge::op_tests::rope
