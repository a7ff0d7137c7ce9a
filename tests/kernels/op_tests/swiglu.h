// SwiGLU (ops::swiglu_*), written once for every backend (op_harness.h): on the CPU against the
// double-precision reference and finite differences, elsewhere against the CPU kernel on the same inputs.
//
// The CUDA kernels use the CPU's exponential and operation order; the bounds against the CPU allow another
// compiler's contraction of the polynomial (a few ulp in exp, at most as much in sigmoid) and of the
// products.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::swiglu {

using testing::DeviceArray;
using testing::kU;

struct Case {
  int64_t rows, ffn;
  std::string name() const { return "rows" + std::to_string(rows) + "_ffn" + std::to_string(ffn); }
  bool finite_differences() const { return rows * ffn <= 300; }
};

// Odd widths for the vector tails, small ones for finite differences, awkward sizes for the device kernels
// and a single element.
inline const std::vector<Case> kCases = {{6, 29}, {4, 19}, {37, 200}, {129, 1000}, {1, 1}, {3, 11}};

// out[r, j] = silu(g) * u with g = gate_up[r, j], u = gate_up[r, ffn + j], in double.
inline std::vector<double> reference_forward(const std::vector<double>& gate_up, int64_t rows, int64_t ffn) {
  std::vector<double> out(rows * ffn);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < ffn; ++j) {
      const double g = gate_up[r * 2 * ffn + j], u = gate_up[r * 2 * ffn + ffn + j];
      out[r * ffn + j] = g / (1 + std::exp(-g)) * u;
    }
  return out;
}

struct Problem {
  int64_t rows, ffn;
  std::vector<float> gate_up, dout;
  Problem(const Case& c, uint32_t seed) : rows(c.rows), ffn(c.ffn) {
    gate_up = testing::random_floats(rows * 2 * ffn, seed, -6, 6);
    dout = testing::random_floats(rows * ffn, seed + 1);
    // Gates at and around the exponential's clamps (simd_exp returns 0 below -87 and clamps above 88), zeros,
    // a tiny value and the zero of silu's derivative, where dgate cancels.
    const float special[] = {0.0f, -0.0f, 87.5f, 86.9f, -88.5f, -87.9f, 100.0f, -100.0f, 1e-30f, -1.2784645f};
    for (size_t k = 0; k < std::size(special); ++k) {
      const int64_t r = static_cast<int64_t>(k) % rows, j = (static_cast<int64_t>(k) * 7) % ffn;
      gate_up[r * 2 * ffn + j] = special[k];
    }
  }
  double sigmoid(size_t gate_index) const { return 1.0 / (1.0 + std::exp(-double{gate_up[gate_index]})); }
  std::string what(const char* op) const {
    return std::string(op) + " rows=" + std::to_string(rows) + " ffn=" + std::to_string(ffn);
  }
};

class SwigluOp : public testing::OpTest<Case> {
 protected:
  // out (forward) or dgate_up (backward) of the op on `device`; dgate_up starts as NaN (overwritten, never
  // read).
  std::vector<float> run(Device on, const Problem& pr, bool backward) {
    return run_as<float>(on, pr, pr.gate_up, pr.dout, std::nanf(""), backward);
  }
  // The same on T elements (float, or bf16 bits in uint16_t).
  template <typename T>
  std::vector<T> run_as(Device on, const Problem& pr, const std::vector<T>& gate_up_values,
                        const std::vector<T>& dout_values, T nan, bool backward) {
    DeviceArray<T> gate_up(on, gate_up_values), dout(on, dout_values), out(on, dout_values.size());
    DeviceArray<T> dgate_up(on, std::vector<T>(gate_up_values.size(), nan));
    ops::SwigluParams p;
    p.rows = pr.rows, p.ffn = pr.ffn, p.gate_up = gate_up.data();
    p.dtype = std::is_same_v<T, float> ? DType::f32 : DType::bf16;
    if (!backward) {
      p.out = out.data();
      FORGE_TEST_OP(swiglu_forward, on, p);
      return out.download();
    }
    p.dout = dout.data(), p.dgate_up = dgate_up.data();
    FORGE_TEST_OP(swiglu_backward, on, p);
    return dgate_up.download();
  }
};

TEST_P(SwigluOp, Forward) {
  const Problem pr(test_case(), 60);
  const std::vector<float> out = run(Device::cpu, pr, false);
  if (on_cpu()) {
    EXPECT_LT(
        testing::relative_error(out, reference_forward(testing::to_double(pr.gate_up), pr.rows, pr.ffn)),
        1e-6);
    return;
  }
  // The 1e-30 floor: gates near -100 give results of subnormal scale, which a CPU flushing subnormals zeroes.
  testing::expect_close(run(device(), pr, false), out, pr.what("swiglu_forward"),
                        [&](size_t i) { return 16 * kU * std::abs(out[i]) + 1e-30; });
}

TEST_P(SwigluOp, Backward) {
  const Problem pr(test_case(), 70);
  const int64_t ffn = pr.ffn;
  const std::vector<float> dgate_up = run(Device::cpu, pr, true);
  if (on_cpu()) {
    if (!test_case().finite_differences()) return;
    const auto doutd = testing::to_double(pr.dout);
    const auto fd = testing::finite_difference(
        [&](const std::vector<double>& x) { return testing::dot(doutd, reference_forward(x, pr.rows, ffn)); },
        testing::to_double(pr.gate_up));
    EXPECT_LT(testing::relative_error(dgate_up, fd), 1e-6);
    return;
  }
  // dgate = d u s (1 + g (1 - s)): 1 - s cancels as s -> 1, so its error is relative to |g|, not to the
  // (tiny) g (1 - s). dup = d g s: a few roundings.
  testing::expect_close(run(device(), pr, true), dgate_up, pr.what("swiglu_backward"), [&](size_t i) {
    const int64_t r = static_cast<int64_t>(i) / (2 * ffn), j = static_cast<int64_t>(i) % (2 * ffn);
    const size_t gate = r * 2 * ffn + (j % ffn);
    const double g = pr.gate_up[gate], u = pr.gate_up[gate + ffn], d = pr.dout[r * ffn + (j % ffn)];
    const double s = pr.sigmoid(gate);
    const double scale = j < ffn ? std::abs(d * u * s) * (1 + std::abs(g)) : std::abs(d * g * s);
    return 16 * kU * scale + 1e-30;
  });
}

// bf16 tensors (a bf16 run's activations, SwigluParams::dtype): on inputs that bf16 holds exactly, the op's
// math is the fp32 kernel's and only its loads and stores differ, so the CPU must write the fp32 kernel's
// results rounded once to bf16, bit for bit. A device's fp32 results may differ from the CPU's by a few fp32
// ulp (see the bounds above), which can move one rounding: within one bf16 ulp, 2^-7 relative.
TEST_P(SwigluOp, Bf16TensorsHoldTheFp32ResultRoundedOnce) {
  Problem pr(test_case(), 90);
  for (float& v : pr.gate_up) v = bf16_to_float(float_to_bf16(v));
  for (float& v : pr.dout) v = bf16_to_float(float_to_bf16(v));
  const auto to_bits = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
    return out;
  };
  const auto run_bf16 = [&](Device on, bool backward) {
    return run_as<uint16_t>(on, pr, to_bits(pr.gate_up), to_bits(pr.dout), uint16_t{0x7fc0}, backward);
  };
  for (bool backward : {false, true}) {
    const std::vector<uint16_t> cpu = run_bf16(Device::cpu, backward);
    const char* op = backward ? "swiglu_backward bf16" : "swiglu_forward bf16";
    if (on_cpu()) {
      EXPECT_EQ(cpu, to_bits(run(Device::cpu, pr, backward))) << pr.what(op);
      continue;
    }
    const std::vector<uint16_t> got = run_bf16(device(), backward);
    std::vector<float> got_f(got.size()), cpu_f(cpu.size());
    for (size_t i = 0; i < got.size(); ++i)
      got_f[i] = bf16_to_float(got[i]), cpu_f[i] = bf16_to_float(cpu[i]);
    testing::expect_close(got_f, cpu_f, pr.what(op),
                          [&](size_t i) { return 0x1p-7 * std::abs(cpu_f[i]) + 1e-30; });
  }
}

// silu(g) -> 0 for g << 0 and -> g for g >> 0; the exponential must not overflow to inf/NaN. One fixed row of
// gates against the exact limits.
class SwigluSaturation : public testing::OpTest<testing::FixedCase> {};

TEST_P(SwigluSaturation, SaturatesCleanlyForLargeGates) {
  const std::vector<float> gate_up_values = {-200.0f, -90.0f, 90.0f, 200.0f, 1.0f, 2.0f, 3.0f, 4.0f};
  DeviceArray<float> gate_up(device(), gate_up_values), dout(device(), std::vector<float>{1, 1, 1, 1});
  DeviceArray<float> out_array(device(), 4), dgate_up_array(device(), 8);
  ops::SwigluParams p;
  p.rows = 1, p.ffn = 4, p.gate_up = gate_up.data(), p.out = out_array.data(), p.dout = dout.data();
  p.dgate_up = dgate_up_array.data();
  FORGE_TEST_OP(swiglu_forward, device(), p);
  FORGE_TEST_OP(swiglu_backward, device(), p);
  const std::vector<float> out = out_array.download(), dgate_up = dgate_up_array.download();
  const std::vector<float> want_out = {0.0f, 0.0f, 270.0f, 800.0f}, want_dgate = {0, 0, 3, 4};
  for (int j = 0; j < 4; ++j) {
    EXPECT_NEAR(out[j], want_out[j], 1e-30f + 1e-6f * std::abs(want_out[j])) << j;
    EXPECT_NEAR(dgate_up[j], want_dgate[j], 1e-6f) << j;
    EXPECT_NEAR(dgate_up[4 + j], want_out[j] / gate_up_values[4 + j], 1e-30f + 1e-6f * std::abs(want_out[j]))
        << j;
  }
}

}  // namespace forge::op_tests::swiglu
