// The CUDA backend's elementwise, norm, rotary, SwiGLU, embedding and optimizer ops against the CPU backend:
// the same random inputs (awkward sizes, never multiples of the block sizes) go through ops::cpu_table() on
// host vectors and ops::cuda_table() on device buffers, and the downloaded results must agree.
//
// Tolerances come from the arithmetic, not from trial runs (these tests are written on a machine without a
// GPU): copies and pure additions in the same order must be bitwise equal; element-wise formulas, which the
// CUDA kernels evaluate with the FMA pattern of the CPU build, within a few units of rounding of their
// operands' magnitudes; reductions whose order differs between backends within the worst-case rounding bound
// of that many sequential additions. Reductions must also be bitwise repeatable on the GPU.
#include "forge/kernels/ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/cuda/runtime.h"
#include "op_harness.h"

namespace forge {
namespace {

using cuda::DeviceBuffer;

// Unit roundoff of fp32.
constexpr double kU = 1.0 / (1 << 24);

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer buffer(host.size() * sizeof(T));
  if (!host.empty()) buffer.upload(host.data(), host.size() * sizeof(T));
  return buffer;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& buffer, size_t n) {
  std::vector<T> host(n);
  if (n > 0) buffer.download(host.data(), n * sizeof(T));
  return host;
}

std::vector<int32_t> random_ids(size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = dist(gen);
  return ids;
}

std::string show(float x) {
  std::ostringstream out;
  out << std::setprecision(9) << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
  return out.str();
}

// One EXPECT per array (not per element), naming the first offender.
template <typename Ok>
void expect_all(const std::vector<float>& cuda, const std::vector<float>& cpu, const std::string& what,
                Ok ok) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < cuda.size(); ++i)
    if (!ok(i) && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << cuda.size() << " elements differ; first at " << first
                     << ": cuda " << show(cuda[first]) << ", cpu " << show(cpu[first]);
}

void expect_bitwise_equal(const std::vector<float>& cuda, const std::vector<float>& cpu,
                          const std::string& what) {
  expect_all(cuda, cpu, what,
             [&](size_t i) { return std::bit_cast<uint32_t>(cuda[i]) == std::bit_cast<uint32_t>(cpu[i]); });
}

// |cuda - cpu| <= tolerance(i), a bound in absolute terms.
template <typename Tolerance>
void expect_close(const std::vector<float>& cuda, const std::vector<float>& cpu, const std::string& what,
                  Tolerance tolerance) {
  expect_all(cuda, cpu, what,
             [&](size_t i) { return std::abs(double{cuda[i]} - double{cpu[i]}) <= tolerance(i); });
}

// Relative error bound of a sum of `terms` addends (or fused multiply-adds) summed in a different order by
// each backend: neither adds more than terms / 4 + 64 values one after another (the CPU's SIMD lanes hold at
// least four partial sums; the GPU's tree is shallower), and each addition rounds once.
double reduction_tolerance(int64_t terms) { return (static_cast<double>(terms) / 4 + 64) * kU; }

struct RmsNormProblem {
  int64_t rows, dim;
  std::vector<float> x, weight, dy, dweight;
  RmsNormProblem(int64_t rows_, int64_t dim_, uint32_t seed) : rows(rows_), dim(dim_) {
    x = testing::random_floats(rows * dim, seed, -2, 2);
    weight = testing::random_floats(dim, seed + 1, 0.5f, 1.5f);
    dy = testing::random_floats(rows * dim, seed + 2);
    dweight = testing::random_floats(dim, seed + 3);  // backward_weight accumulates onto this
  }
};

struct RmsNormDevice {
  DeviceBuffer x, weight, dy, y, rstd, dx, dweight;
  explicit RmsNormDevice(const RmsNormProblem& pr)
      : x(to_device(pr.x)),
        weight(to_device(pr.weight)),
        dy(to_device(pr.dy)),
        y(pr.x.size() * sizeof(float)),
        rstd(pr.rows * sizeof(float)),
        dx(pr.x.size() * sizeof(float)),
        dweight(to_device(pr.dweight)) {}
  ops::RmsNormParams params(const RmsNormProblem& pr) const {
    ops::RmsNormParams p;
    p.rows = pr.rows, p.dim = pr.dim, p.eps = 1e-5f;
    p.x = x.as<float>(), p.weight = weight.as<float>(), p.y = y.as<float>(), p.rstd = rstd.as<float>();
    p.dy = dy.as<float>(), p.dx = dx.as<float>(), p.dweight = dweight.as<float>();
    return p;
  }
};

const std::vector<std::pair<int64_t, int64_t>> kRmsNormShapes = {
    {37, 200}, {300, 1031}, {4, 4096}, {5, 1}, {1, 33}};

// ---------------------------------------------------------------------------------------------------------------
// Element-wise helpers

TEST(CudaOps, AddInplaceIsExact) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (int64_t n : {1, 37, 1000, 16385, 300001}) {
    auto y = testing::random_floats(n, 1), x = testing::random_floats(n, 2, -3, 3);
    DeviceBuffer dy = to_device(y), dx = to_device(x);
    ops::cuda_table().add_inplace(dy.as<float>(), dx.as<float>(), n);
    ops::cpu_table().add_inplace(y.data(), x.data(), n);
    expect_bitwise_equal(to_host<float>(dy, n), y, "add_inplace n=" + std::to_string(n));
  }
  // y += y (the same array twice) is allowed.
  auto y = testing::random_floats(1001, 3);
  DeviceBuffer dy = to_device(y);
  ops::cuda_table().add_inplace(dy.as<float>(), dy.as<float>(), 1001);
  ops::cpu_table().add_inplace(y.data(), y.data(), 1001);
  expect_bitwise_equal(to_host<float>(dy, 1001), y, "add_inplace aliased");
}

// bf16 conversions are exact functions of the bits: round-to-nearest-even (ties included), overflow to inf,
// NaN kept quiet with its sign, and back by a shift. Bitwise against the CPU on random values plus specials.
TEST(CudaOps, Bf16ConversionsMatchCpuBitwise) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  auto x = testing::random_floats(100003, 7, -1e4, 1e4);
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0xffc00001u),
                            std::bit_cast<float>(0x7f800001u),  // signalling NaN
                            std::bit_cast<float>(0x3f808000u),  // a tie to even (down)
                            std::bit_cast<float>(0x3f818000u),  // a tie to even (up)
                            std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(), 1e-40f};
  std::copy(std::begin(specials), std::end(specials), x.begin());
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint16_t> cpu(x.size());
  ops::cpu_table().convert_to_bf16(x.data(), cpu.data(), n);
  DeviceBuffer dx = to_device(x), dy(x.size() * sizeof(uint16_t)), dback(x.size() * sizeof(float));
  ops::cuda_table().convert_to_bf16(dx.as<float>(), dy.as<uint16_t>(), n);
  const std::vector<uint16_t> gpu = to_host<uint16_t>(dy, x.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (gpu[i] != cpu[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << "convert_to_bf16: first difference at " << first << ": input " << show(x[first])
                     << ", cuda 0x" << std::hex << gpu[first] << ", cpu 0x" << cpu[first];
  std::vector<float> back(x.size());
  ops::cpu_table().convert_to_f32(cpu.data(), back.data(), n);
  ops::cuda_table().convert_to_f32(dy.as<uint16_t>(), dback.as<float>(), n);
  expect_bitwise_equal(to_host<float>(dback, x.size()), back, "convert_to_f32");
}

TEST(CudaOps, ScaleInplaceIsExact) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (int64_t n : {1, 255, 16385, 300001}) {
    for (float s : {0.37f, -3.0f, 0.0f}) {
      auto x = testing::random_floats(n, 4, -5, 5);
      DeviceBuffer dx = to_device(x);
      ops::cuda_table().scale_inplace(dx.as<float>(), s, n);
      ops::cpu_table().scale_inplace(x.data(), s, n);
      expect_bitwise_equal(to_host<float>(dx, n), x, "scale_inplace n=" + std::to_string(n));
    }
  }
}

TEST(CudaOps, SumSquaresMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (int64_t n : {1, 255, 16384, 16385, 1000003}) {
    const auto x = testing::random_floats(n, 5, -3, 3);
    DeviceBuffer dx = to_device(x);
    const double cuda = ops::cuda_table().sum_squares(dx.as<float>(), n);
    const double cpu = ops::cpu_table().sum_squares(x.data(), n);
    // Squares are exact in double; only the order of n double additions differs.
    EXPECT_LE(std::abs(cuda - cpu), static_cast<double>(n) * 0x1p-53 * cpu) << "n=" << n;
    if (n == 1) {
      EXPECT_EQ(cuda, cpu);
    }
  }
}

TEST(CudaOps, SumSquaresIsBitwiseRepeatable) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const int64_t n = 3000017;
  const auto x = testing::random_floats(n, 6, -10, 10);
  DeviceBuffer dx = to_device(x);
  const double first = ops::cuda_table().sum_squares(dx.as<float>(), n);
  for (int run = 0; run < 3; ++run)
    EXPECT_EQ(std::bit_cast<uint64_t>(ops::cuda_table().sum_squares(dx.as<float>(), n)),
              std::bit_cast<uint64_t>(first));
}

// The accumulating form adds each range's sum into a device double in stream order: the total is bitwise the
// host's additions of the returning form's sums, in the same order.
TEST(CudaOps, SumSquaresAccumulateIsTheHostSumOfRanges) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const int64_t n = 1000003, cut = 400001;
  const auto x = testing::random_floats(n, 7, -3, 3);
  DeviceBuffer dx = to_device(x);
  DeviceBuffer total = to_device(std::vector<double>{0.25});
  ops::cuda_table().sum_squares_accumulate(dx.as<float>(), cut, total.as<double>());
  ops::cuda_table().sum_squares_accumulate(dx.as<float>() + cut, n - cut, total.as<double>());
  ops::cuda_table().sum_squares_accumulate(dx.as<float>(), 0, total.as<double>());
  double want = 0.25;
  want += ops::cuda_table().sum_squares(dx.as<float>(), cut);
  want += ops::cuda_table().sum_squares(dx.as<float>() + cut, n - cut);
  EXPECT_EQ(std::bit_cast<uint64_t>(to_host<double>(total, 1)[0]), std::bit_cast<uint64_t>(want));
}

// ---------------------------------------------------------------------------------------------------------------
// RMSNorm

TEST(CudaOps, RmsNormForwardMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (auto [rows, dim] : kRmsNormShapes) {
    const std::string what = "rmsnorm_forward rows=" + std::to_string(rows) + " dim=" + std::to_string(dim);
    RmsNormProblem pr(rows, dim, 10);
    RmsNormDevice dev(pr);
    ops::cuda_table().rmsnorm_forward(dev.params(pr));
    std::vector<float> y(rows * dim), rstd(rows);
    auto p = dev.params(pr);
    p.x = pr.x.data(), p.weight = pr.weight.data(), p.y = y.data(), p.rstd = rstd.data();
    ops::cpu_table().rmsnorm_forward(p);
    // rstd = (sum/dim + eps)^-1/2: half the sum's relative error, plus a few roundings.
    const double rstd_tolerance = reduction_tolerance(dim) / 2 + 4 * kU;
    expect_close(to_host<float>(dev.rstd, rows), rstd, what + " rstd",
                 [&](size_t i) { return rstd_tolerance * std::abs(rstd[i]); });
    expect_close(to_host<float>(dev.y, rows * dim), y, what + " y",
                 [&](size_t i) { return (rstd_tolerance + 3 * kU) * std::abs(y[i]) + 1e-37; });
  }
}

TEST(CudaOps, RmsNormForwardWithoutRstd) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  RmsNormProblem pr(37, 200, 11);
  RmsNormDevice dev(pr);
  auto p = dev.params(pr);
  ops::cuda_table().rmsnorm_forward(p);
  const auto y_with = to_host<float>(dev.y, 37 * 200);
  dev.y.zero();
  p.rstd = nullptr;  // inference keeps no rstd
  ops::cuda_table().rmsnorm_forward(p);
  expect_bitwise_equal(to_host<float>(dev.y, 37 * 200), y_with, "rmsnorm_forward without rstd");
}

TEST(CudaOps, RmsNormBackwardInputMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (auto [rows, dim] : kRmsNormShapes) {
    const std::string what =
        "rmsnorm_backward_input rows=" + std::to_string(rows) + " dim=" + std::to_string(dim);
    RmsNormProblem pr(rows, dim, 20);
    // Both backends get the CPU's rstd, so only the row reduction's order differs.
    std::vector<float> y(rows * dim), rstd(rows), dx(rows * dim);
    ops::RmsNormParams p;
    p.rows = rows, p.dim = dim, p.eps = 1e-5f, p.x = pr.x.data(), p.weight = pr.weight.data(), p.y = y.data();
    p.rstd = rstd.data(), p.dy = pr.dy.data(), p.dx = dx.data();
    ops::cpu_table().rmsnorm_forward(p);
    ops::cpu_table().rmsnorm_backward_input(p);
    RmsNormDevice dev(pr);
    dev.rstd.upload(rstd.data(), rows * sizeof(float));
    const std::vector<float> garbage(rows * dim, std::nanf(""));
    dev.dx.upload(garbage.data(), rows * dim * sizeof(float));  // dx is overwritten, never read
    ops::cuda_table().rmsnorm_backward_input(dev.params(pr));
    // dx_j = r w_j dy_j - coef x_j with coef = r^3 / dim * sum_k dy_k w_k x_k: the sum's error is relative to
    // sum_k |dy_k w_k x_k|, then a few roundings of each term.
    std::vector<double> coef_abs(rows), coef(rows);
    for (int64_t r = 0; r < rows; ++r) {
      double dot = 0, dot_abs = 0;
      for (int64_t k = 0; k < dim; ++k) {
        const double t = double{pr.dy[r * dim + k]} * pr.weight[k] * pr.x[r * dim + k];
        dot += t, dot_abs += std::abs(t);
      }
      const double r3 = std::pow(double{rstd[r]}, 3) / dim;
      coef[r] = dot * r3, coef_abs[r] = dot_abs * r3;
    }
    const double dot_tolerance = reduction_tolerance(dim) + 6 * kU;
    expect_close(to_host<float>(dev.dx, rows * dim), dx, what, [&](size_t i) {
      const int64_t r = static_cast<int64_t>(i) / dim, j = static_cast<int64_t>(i) % dim;
      const double x = pr.x[i], first = std::abs(double{rstd[r]} * pr.weight[j] * pr.dy[i]);
      return dot_tolerance * coef_abs[r] * std::abs(x) + 4 * kU * (first + std::abs(coef[r] * x)) + 1e-37;
    });
  }
}

TEST(CudaOps, RmsNormBackwardWeightMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (auto [rows, dim] : kRmsNormShapes) {
    const std::string what =
        "rmsnorm_backward_weight rows=" + std::to_string(rows) + " dim=" + std::to_string(dim);
    RmsNormProblem pr(rows, dim, 30);
    std::vector<float> rstd = testing::random_floats(rows, 33, 0.5f, 2.0f);
    std::vector<float> dweight = pr.dweight;
    ops::RmsNormParams p;
    p.rows = rows, p.dim = dim, p.x = pr.x.data(), p.dy = pr.dy.data(), p.rstd = rstd.data();
    p.dweight = dweight.data();
    ops::cpu_table().rmsnorm_backward_weight(p);
    RmsNormDevice dev(pr);
    dev.rstd.upload(rstd.data(), rows * sizeof(float));
    ops::cuda_table().rmsnorm_backward_weight(dev.params(pr));
    // Both backends add 32-row partials in block order (the same order); the bound only allows for another
    // compiler's FMA contraction: every one of the rows / 32 + 32 sequential steps rounds once or twice.
    const int64_t steps = (rows + 31) / 32 + 32 + 2;
    std::vector<double> magnitude(dim);
    for (int64_t j = 0; j < dim; ++j) {
      double sum = std::abs(pr.dweight[j]);
      for (int64_t r = 0; r < rows; ++r)
        sum += std::abs(double{pr.dy[r * dim + j]} * pr.x[r * dim + j] * rstd[r]);
      magnitude[j] = sum;
    }
    expect_close(to_host<float>(dev.dweight, dim), dweight, what,
                 [&](size_t j) { return 2 * steps * kU * magnitude[j]; });
  }
}

TEST(CudaOps, RmsNormBackwardWeightIsBitwiseRepeatable) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  RmsNormProblem pr(1000, 1031, 40);
  const std::vector<float> rstd = testing::random_floats(1000, 41, 0.5f, 2.0f);
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    RmsNormDevice dev(pr);
    dev.rstd.upload(rstd.data(), rstd.size() * sizeof(float));
    ops::cuda_table().rmsnorm_backward_weight(dev.params(pr));
    const auto dweight = to_host<float>(dev.dweight, pr.dim);
    if (run == 0)
      first = dweight;
    else
      expect_bitwise_equal(dweight, first, "rmsnorm_backward_weight run " + std::to_string(run));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE

struct RopeCase {
  int64_t batch, seq, heads, head_dim, token_stride, position_offset;
  bool inverse;
};

// cos/sin tables of real rotations (Llama's frequencies) for positions [0, positions).
void rope_tables(int64_t positions, int64_t head_dim, std::vector<float>& cos, std::vector<float>& sin) {
  const int64_t half = head_dim / 2;
  cos.resize(positions * half), sin.resize(positions * half);
  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / head_dim);
      cos[t * half + i] = static_cast<float>(std::cos(angle));
      sin[t * half + i] = static_cast<float>(std::sin(angle));
    }
}

TEST(CudaOps, RopeMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const std::vector<RopeCase> cases = {
      {2, 13, 3, 64, 3 * 64, 0, false},
      {2, 13, 3, 64, 3 * 64, 5, true},
      {1, 37, 4, 6, 8 * 6, 3, false},          // q heads inside a fused q|k|v row: the rest stays untouched
      {3, 7, 5, 128, 5 * 128 + 64, 11, true},  // padding between tokens
      {1, 1, 1, 2, 2, 0, false},
  };
  for (const RopeCase& c : cases) {
    const std::string what = "rope batch=" + std::to_string(c.batch) + " seq=" + std::to_string(c.seq) +
                             " heads=" + std::to_string(c.heads) + " head_dim=" + std::to_string(c.head_dim) +
                             " stride=" + std::to_string(c.token_stride) +
                             " offset=" + std::to_string(c.position_offset) + (c.inverse ? " inverse" : "");
    std::vector<float> cos, sin;
    rope_tables(c.position_offset + c.seq, c.head_dim, cos, sin);
    const auto original = testing::random_floats(c.batch * c.seq * c.token_stride, 50, -3, 3);
    std::vector<float> x = original;
    ops::RopeParams p;
    p.batch = c.batch, p.seq = c.seq, p.heads = c.heads, p.head_dim = c.head_dim,
    p.token_stride = c.token_stride;
    p.position_offset = c.position_offset, p.inverse = c.inverse;
    p.x = x.data(), p.cos = cos.data(), p.sin = sin.data();
    ops::cpu_table().rope(p);
    DeviceBuffer dx = to_device(original), dcos = to_device(cos), dsin = to_device(sin);
    p.x = dx.as<float>(), p.cos = dcos.as<float>(), p.sin = dsin.as<float>();
    ops::cuda_table().rope(p);
    const auto cuda = to_host<float>(dx, x.size());
    // Each output is a c + or - b s of its pair (a, b), |c|, |s| <= 1: within a few roundings of |a| + |b|.
    // Elements outside the rotated heads must come back bitwise untouched.
    const int64_t half = c.head_dim / 2, rotated = c.heads * c.head_dim;
    expect_all(cuda, x, what, [&](size_t i) {
      const int64_t within = static_cast<int64_t>(i) % c.token_stride;
      if (within >= rotated) return std::bit_cast<uint32_t>(cuda[i]) == std::bit_cast<uint32_t>(original[i]);
      const size_t partner = within % c.head_dim < half ? i + half : i - half;
      return std::abs(double{cuda[i]} - double{x[i]}) <=
             4 * kU * (std::abs(original[i]) + std::abs(original[partner]));
    });
  }
}

TEST(CudaOps, RopeInverseUndoesForward) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const RopeCase c{2, 29, 3, 96, 3 * 96 + 32, 7, false};
  std::vector<float> cos, sin;
  rope_tables(c.position_offset + c.seq, c.head_dim, cos, sin);
  const auto original = testing::random_floats(c.batch * c.seq * c.token_stride, 51, -3, 3);
  DeviceBuffer dx = to_device(original), dcos = to_device(cos), dsin = to_device(sin);
  ops::RopeParams p;
  p.batch = c.batch, p.seq = c.seq, p.heads = c.heads, p.head_dim = c.head_dim,
  p.token_stride = c.token_stride;
  p.position_offset = c.position_offset, p.x = dx.as<float>(), p.cos = dcos.as<float>(),
  p.sin = dsin.as<float>();
  ops::cuda_table().rope(p);
  p.inverse = true;
  ops::cuda_table().rope(p);
  // cos^2 + sin^2 = 1 up to the tables' rounding; two rotations of a pair of magnitude <= 3 * sqrt(2).
  expect_close(to_host<float>(dx, original.size()), original, "rope then inverse",
               [](size_t) { return 3e-6; });
}

// ---------------------------------------------------------------------------------------------------------------
// SwiGLU

struct SwigluProblem {
  int64_t rows, ffn;
  std::vector<float> gate_up, dout;
  SwigluProblem(int64_t rows_, int64_t ffn_, uint32_t seed) : rows(rows_), ffn(ffn_) {
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
  size_t gate_index(size_t out_index) const { return out_index / ffn * 2 * ffn + out_index % ffn; }
};

const std::vector<std::pair<int64_t, int64_t>> kSwigluShapes = {{37, 200}, {129, 1000}, {1, 1}, {3, 11}};

TEST(CudaOps, SwigluForwardMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (auto [rows, ffn] : kSwigluShapes) {
    const std::string what = "swiglu_forward rows=" + std::to_string(rows) + " ffn=" + std::to_string(ffn);
    SwigluProblem pr(rows, ffn, 60);
    std::vector<float> out(rows * ffn);
    ops::SwigluParams p;
    p.rows = rows, p.ffn = ffn, p.gate_up = pr.gate_up.data(), p.out = out.data();
    ops::cpu_table().swiglu_forward(p);
    DeviceBuffer dgate_up = to_device(pr.gate_up), dout(out.size() * sizeof(float));
    p.gate_up = dgate_up.as<float>(), p.out = dout.as<float>();
    ops::cuda_table().swiglu_forward(p);
    // Same exponential and operation order; the bound allows another compiler's contraction of the
    // polynomial (a few ulp in exp, at most as much in sigmoid) and the two products.
    // The 1e-30 floor: gates near -100 give results of subnormal scale, which a CPU flushing subnormals
    // zeroes.
    expect_close(to_host<float>(dout, out.size()), out, what,
                 [&](size_t i) { return 16 * kU * std::abs(out[i]) + 1e-30; });
  }
}

TEST(CudaOps, SwigluBackwardMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (auto [rows, ffn] : kSwigluShapes) {
    const std::string what = "swiglu_backward rows=" + std::to_string(rows) + " ffn=" + std::to_string(ffn);
    SwigluProblem pr(rows, ffn, 70);
    std::vector<float> dgate_up(rows * 2 * ffn);
    ops::SwigluParams p;
    p.rows = rows, p.ffn = ffn, p.gate_up = pr.gate_up.data(), p.dout = pr.dout.data(),
    p.dgate_up = dgate_up.data();
    ops::cpu_table().swiglu_backward(p);
    DeviceBuffer dgu = to_device(pr.gate_up), ddout = to_device(pr.dout),
                 ddgu(dgate_up.size() * sizeof(float));
    const std::vector<float> garbage(dgate_up.size(), std::nanf(""));
    ddgu.upload(garbage.data(), garbage.size() * sizeof(float));  // overwritten, never read
    p.gate_up = dgu.as<float>(), p.dout = ddout.as<float>(), p.dgate_up = ddgu.as<float>();
    ops::cuda_table().swiglu_backward(p);
    // dgate = d u s (1 + g (1 - s)): 1 - s cancels as s -> 1, so its error is relative to |g|, not to the
    // (tiny) g (1 - s). dup = d g s: a few roundings.
    expect_close(to_host<float>(ddgu, dgate_up.size()), dgate_up, what, [&](size_t i) {
      const int64_t r = static_cast<int64_t>(i) / (2 * ffn), j = static_cast<int64_t>(i) % (2 * ffn);
      const size_t gate = r * 2 * ffn + (j % ffn);
      const double g = pr.gate_up[gate], u = pr.gate_up[gate + ffn], d = pr.dout[r * ffn + (j % ffn)];
      const double s = pr.sigmoid(gate);
      const double scale = j < ffn ? std::abs(d * u * s) * (1 + std::abs(g)) : std::abs(d * g * s);
      return 16 * kU * scale + 1e-30;
    });
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Embedding

struct EmbeddingCase {
  int64_t rows, dim, vocab;
  double skew;  // fraction of rows that take id vocab / 2 (a frequent token)
};

struct EmbeddingProblem {
  EmbeddingCase c;
  std::vector<int32_t> ids;
  std::vector<float> weight, dout, dweight;
  EmbeddingProblem(const EmbeddingCase& c_, uint32_t seed) : c(c_) {
    ids = random_ids(c.rows, seed, static_cast<int32_t>(c.vocab));
    std::mt19937 gen(seed + 1);
    std::uniform_real_distribution<double> coin(0, 1);
    for (auto& id : ids)
      if (coin(gen) < c.skew) id = static_cast<int32_t>(c.vocab / 2);
    weight = testing::random_floats(c.vocab * c.dim, seed + 2);
    dout = testing::random_floats(c.rows * c.dim, seed + 3);
    dweight = testing::random_floats(c.vocab * c.dim, seed + 4);  // accumulated onto
  }
  std::string name(const char* op) const {
    return std::string(op) + " rows=" + std::to_string(c.rows) + " dim=" + std::to_string(c.dim) +
           " vocab=" + std::to_string(c.vocab);
  }
};

const std::vector<EmbeddingCase> kEmbeddingCases = {
    {37, 200, 50, 0.0},   {1000, 129, 7, 0.0},      // many repeats of few ids
    {1000, 300, 97, 0.6},                           // one frequent id; most of the table untouched
    {5, 1, 1, 0.0},       {20000, 33, 70000, 0.1},  // a wide vocabulary: several radix passes
};

TEST(CudaOps, EmbeddingForwardMatchesCpuBitwise) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (const EmbeddingCase& c : kEmbeddingCases) {
    EmbeddingProblem pr(c, 80);
    std::vector<float> out(c.rows * c.dim);
    ops::EmbeddingParams p;
    p.rows = c.rows, p.dim = c.dim, p.vocab = c.vocab, p.ids = pr.ids.data(), p.weight = pr.weight.data();
    p.out = out.data();
    ops::cpu_table().embedding_forward(p);
    DeviceBuffer dids = to_device(pr.ids), dweight = to_device(pr.weight), dout(out.size() * sizeof(float));
    p.ids = dids.as<int32_t>(), p.weight = dweight.as<float>(), p.out = dout.as<float>();
    ops::cuda_table().embedding_forward(p);
    expect_bitwise_equal(to_host<float>(dout, out.size()), out, pr.name("embedding_forward"));
  }
}

// Both backends add each id's dout rows onto dweight[id] one after another in row order: bitwise equal.
TEST(CudaOps, EmbeddingBackwardWeightMatchesCpuBitwise) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (const EmbeddingCase& c : kEmbeddingCases) {
    EmbeddingProblem pr(c, 90);
    std::vector<float> dweight = pr.dweight;
    ops::EmbeddingParams p;
    p.rows = c.rows, p.dim = c.dim, p.vocab = c.vocab, p.ids = pr.ids.data(), p.dout = pr.dout.data();
    p.dweight = dweight.data();
    ops::cpu_table().embedding_backward_weight(p);
    DeviceBuffer dids = to_device(pr.ids), ddout = to_device(pr.dout), ddweight = to_device(pr.dweight);
    p.ids = dids.as<int32_t>(), p.dout = ddout.as<float>(), p.dweight = ddweight.as<float>();
    ops::cuda_table().embedding_backward_weight(p);
    expect_bitwise_equal(to_host<float>(ddweight, dweight.size()), dweight,
                         pr.name("embedding_backward_weight"));
  }
}

// Vocabulary-parallel: the table holds global rows [first, first + vocab); the ids of other ranks' ranges give
// zero rows and no gradient. A middle third of each case's vocabulary, both ops, against the CPU bitwise.
TEST(CudaOps, EmbeddingVocabularyParallelMatchesCpuBitwise) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  for (const EmbeddingCase& c : kEmbeddingCases) {
    EmbeddingProblem pr(c, 110);
    const int64_t first = c.vocab / 3, local = std::max<int64_t>(1, c.vocab / 3);
    std::vector<float> out(c.rows * c.dim), dweight(pr.dweight.begin(), pr.dweight.begin() + local * c.dim);
    ops::EmbeddingParams p;
    p.rows = c.rows, p.dim = c.dim, p.vocab = local, p.vocab_parallel = true, p.first = first;
    p.ids = pr.ids.data(), p.weight = pr.weight.data(), p.out = out.data(), p.dout = pr.dout.data();
    p.dweight = dweight.data();
    ops::cpu_table().embedding_forward(p);
    ops::cpu_table().embedding_backward_weight(p);
    const std::vector<float> initial(pr.dweight.begin(), pr.dweight.begin() + local * c.dim);
    DeviceBuffer dids = to_device(pr.ids), dweight_table = to_device(pr.weight), dout(out.size() * sizeof(float));
    DeviceBuffer ddout = to_device(pr.dout), ddweight = to_device(initial);
    p.ids = dids.as<int32_t>(), p.weight = dweight_table.as<float>(), p.out = dout.as<float>();
    p.dout = ddout.as<float>(), p.dweight = ddweight.as<float>();
    ops::cuda_table().embedding_forward(p);
    ops::cuda_table().embedding_backward_weight(p);
    expect_bitwise_equal(to_host<float>(dout, out.size()), out, pr.name("vocab-parallel embedding_forward"));
    expect_bitwise_equal(to_host<float>(ddweight, dweight.size()), dweight,
                         pr.name("vocab-parallel embedding_backward_weight"));
  }
}

TEST(CudaOps, EmbeddingBackwardWeightIsBitwiseRepeatable) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  EmbeddingProblem pr({4099, 257, 501, 0.3}, 100);
  DeviceBuffer dids = to_device(pr.ids), ddout = to_device(pr.dout);
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    DeviceBuffer ddweight = to_device(pr.dweight);
    ops::EmbeddingParams p;
    p.rows = pr.c.rows, p.dim = pr.c.dim, p.vocab = pr.c.vocab, p.ids = dids.as<int32_t>();
    p.dout = ddout.as<float>(), p.dweight = ddweight.as<float>();
    ops::cuda_table().embedding_backward_weight(p);
    const auto dweight = to_host<float>(ddweight, pr.dweight.size());
    if (run == 0)
      first = dweight;
    else
      expect_bitwise_equal(dweight, first, "embedding_backward_weight run " + std::to_string(run));
  }
}

TEST(CudaOps, EmbeddingRejectsIdsOutsideTheVocabulary) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  EmbeddingProblem pr({37, 200, 50, 0.0}, 110);
  for (auto [row, id] : {std::pair<int64_t, int32_t>{3, -1}, {36, 50}, {0, 1 << 30}}) {
    auto ids = pr.ids;
    ids[row] = id;
    if (row != 36) ids[36] = -7;  // a later bad row: the first one is reported
    DeviceBuffer dids = to_device(ids), dweight = to_device(pr.weight), dforward(37 * 200 * sizeof(float));
    DeviceBuffer ddout = to_device(pr.dout), ddweight = to_device(pr.dweight);
    ops::EmbeddingParams p;
    p.rows = 37, p.dim = 200, p.vocab = 50, p.ids = dids.as<int32_t>(), p.weight = dweight.as<float>();
    p.out = dforward.as<float>(), p.dout = ddout.as<float>(), p.dweight = ddweight.as<float>();
    const std::string token = "token id " + std::to_string(id), at = "at row " + std::to_string(row);
    testing::expect_error_containing([&] { ops::cuda_table().embedding_forward(p); },
                                     {"embedding_forward", token, at, "[0, 50)"});
    testing::expect_error_containing([&] { ops::cuda_table().embedding_backward_weight(p); },
                                     {"embedding_backward_weight", token, at, "[0, 50)"});
    // Nothing was written before the failure.
    expect_bitwise_equal(to_host<float>(ddweight, pr.dweight.size()), pr.dweight, "dweight after a bad id");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// AdamW

struct AdamWCase {
  int64_t n;
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  int64_t step;
  bool shadow;
};

TEST(CudaOps, AdamWMatchesCpu) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const std::vector<AdamWCase> cases = {
      {37, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1, true},
      {100003, 3e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, 0.25f, 7, true},
      {4099, 1e-2f, 0.8f, 0.95f, 1e-6f, 0.01f, 1.0f, 1000, false},
  };
  for (const AdamWCase& c : cases) {
    const std::string what = "adamw n=" + std::to_string(c.n) + " step=" + std::to_string(c.step);
    const auto param0 = testing::random_floats(c.n, 120, -1, 1);
    const auto grad = testing::random_floats(c.n, 121, -2, 2);
    const auto m0 = testing::random_floats(c.n, 122, -0.1f, 0.1f);
    const auto v0 = testing::random_floats(c.n, 123, 0.0f, 0.01f);
    std::vector<float> param = param0, m = m0, v = v0;
    std::vector<uint16_t> shadow(c.n);
    ops::AdamWParams p;
    p.n = c.n, p.lr = c.lr, p.beta1 = c.beta1, p.beta2 = c.beta2, p.eps = c.eps,
    p.weight_decay = c.weight_decay;
    p.grad_scale = c.grad_scale, p.step = c.step;
    p.param = param.data(), p.grad = grad.data(), p.exp_avg = m.data(), p.exp_avg_sq = v.data();
    p.param_bf16 = c.shadow ? shadow.data() : nullptr;
    ops::cpu_table().adamw(p);
    DeviceBuffer dparam = to_device(param0), dgrad = to_device(grad), dm = to_device(m0), dv = to_device(v0);
    DeviceBuffer dshadow(c.n * sizeof(uint16_t));
    p.param = dparam.as<float>(), p.grad = dgrad.as<float>(), p.exp_avg = dm.as<float>();
    p.exp_avg_sq = dv.as<float>(), p.param_bf16 = c.shadow ? dshadow.as<uint16_t>() : nullptr;
    ops::cuda_table().adamw(p);
    const auto cuda_param = to_host<float>(dparam, c.n), cuda_m = to_host<float>(dm, c.n);
    const auto cuda_v = to_host<float>(dv, c.n);
    // The kernels share the CPU's operation order and FMAs, so these are usually bitwise equal. The bounds
    // allow one rounding more or less per operation (another compiler's contraction), measured against the
    // operands: about 2 ulp of the larger term of each sum, propagated into the weight update.
    const double step_size = c.lr / (1.0 - std::pow(double{c.beta1}, double(c.step)));
    const double correction2 = std::sqrt(1.0 - std::pow(double{c.beta2}, double(c.step)));
    std::vector<double> m_error(c.n), v_error(c.n);
    for (int64_t i = 0; i < c.n; ++i) {
      const double g = double{grad[i]} * c.grad_scale;
      m_error[i] = 4 * kU * (std::abs(c.beta1 * m0[i]) + std::abs((1 - c.beta1) * g));
      v_error[i] = 4 * kU * (c.beta2 * v0[i] + (1 - c.beta2) * g * g);
    }
    expect_close(cuda_m, m, what + " exp_avg", [&](size_t i) { return m_error[i]; });
    expect_close(cuda_v, v, what + " exp_avg_sq", [&](size_t i) { return v_error[i]; });
    expect_close(cuda_param, param, what + " param", [&](size_t i) {
      const double root = std::sqrt(double{v[i]}) / correction2, denom = root + c.eps;
      const double update = step_size * std::abs(m[i]) / denom;
      const double root_error = v[i] > 0 ? root * v_error[i] / (2 * v[i]) : 0;
      return 4 * kU * (std::abs(double{param0[i]}) + update) + step_size * m_error[i] / denom +
             update * (root_error / denom + 4 * kU);
    });
    if (c.shadow) {
      const auto cuda_shadow = to_host<uint16_t>(dshadow, c.n);
      size_t bad = 0;
      for (int64_t i = 0; i < c.n; ++i) bad += cuda_shadow[i] != f32_to_bf16_bits(cuda_param[i]);
      EXPECT_EQ(bad, 0u) << what << ": bf16 shadow differs from the rounded fp32 weight";
    }
  }
}

// With lr = 0 the weights pass through unchanged, so the shadow shows the rounding of chosen values: ties to
// even, carries, overflow to inf, subnormals, signed zero, infinities and NaN.
TEST(CudaOps, AdamWShadowRoundsToNearestEven) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f808000u, 0x3f80u},                                                  // tie, even below: down
      {0x3f818000u, 0x3f82u},                                                  // tie, odd below: up
      {0x3f808001u, 0x3f81u}, {0x3f807fffu, 0x3f80u}, {0x7f7fffffu, 0x7f80u},  // FLT_MAX rounds to inf
      {0x00008000u, 0x0000u}, {0x00018000u, 0x0002u}, {0x00000001u, 0x0000u},  // subnormals
      {0x80000000u, 0x8000u}, {0x7f800000u, 0x7f80u}, {0xff800000u, 0xff80u},
      {0xbfffffffu, 0xc000u},  // carry into the exponent
  };
  const int64_t n = static_cast<int64_t>(cases.size()) + 1;
  std::vector<float> param(n);
  for (size_t i = 0; i < cases.size(); ++i) param[i] = std::bit_cast<float>(cases[i].first);
  param[n - 1] = std::nanf("");
  const std::vector<float> zeros(n, 0.0f);
  DeviceBuffer dparam = to_device(param), dgrad = to_device(zeros), dm = to_device(zeros),
               dv = to_device(zeros);
  DeviceBuffer dshadow(n * sizeof(uint16_t));
  ops::AdamWParams p;
  p.n = n, p.lr = 0, p.weight_decay = 0.1f, p.step = 3;
  p.param = dparam.as<float>(), p.grad = dgrad.as<float>(), p.exp_avg = dm.as<float>();
  p.exp_avg_sq = dv.as<float>(), p.param_bf16 = dshadow.as<uint16_t>();
  ops::cuda_table().adamw(p);
  const auto cuda_param = to_host<float>(dparam, n);
  const auto shadow = to_host<uint16_t>(dshadow, n);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(cuda_param[i]), cases[i].first) << "weight " << i << " changed";
    EXPECT_EQ(shadow[i], cases[i].second) << std::hex << "bf16 of 0x" << cases[i].first;
    EXPECT_EQ(shadow[i], f32_to_bf16_bits(param[i])) << std::hex << "core's bf16 of 0x" << cases[i].first;
  }
  EXPECT_TRUE(std::isnan(cuda_param[n - 1]));
  EXPECT_EQ(shadow[n - 1], f32_to_bf16_bits(cuda_param[n - 1])) << "NaN stays a quiet NaN";
  EXPECT_EQ(shadow[n - 1] & 0x7fc0u, 0x7fc0u);
}

// ---------------------------------------------------------------------------------------------------------------
// Edge cases shared by all ops

TEST(CudaOps, EmptyInputsAreNoOps) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const ops::OpTable& gpu = ops::cuda_table();
  // Null pointers are fine when there is nothing to touch.
  gpu.add_inplace(nullptr, nullptr, 0);
  gpu.scale_inplace(nullptr, 2.0f, 0);
  EXPECT_EQ(gpu.sum_squares(nullptr, 0), 0.0);
  ops::RmsNormParams norm;
  norm.rows = 0, norm.dim = 8;
  gpu.rmsnorm_forward(norm);
  gpu.rmsnorm_backward_input(norm);
  gpu.rmsnorm_backward_weight(norm);
  ops::RopeParams rope;
  rope.batch = 0, rope.seq = 4, rope.heads = 2, rope.head_dim = 8, rope.token_stride = 16;
  gpu.rope(rope);
  ops::SwigluParams swiglu;
  swiglu.rows = 0, swiglu.ffn = 5;
  gpu.swiglu_forward(swiglu);
  gpu.swiglu_backward(swiglu);
  ops::EmbeddingParams embedding;
  embedding.rows = 0, embedding.dim = 4, embedding.vocab = 3;
  gpu.embedding_forward(embedding);
  gpu.embedding_backward_weight(embedding);
  ops::AdamWParams adamw;
  adamw.n = 0;
  gpu.adamw(adamw);
  cuda::synchronize();
}

TEST(CudaOps, BadParametersFailNamingTheOp) {
  if (!forge::cuda::available()) GTEST_SKIP() << forge::cuda::describe_device();
  const ops::OpTable& gpu = ops::cuda_table();
  testing::expect_error_containing([&] { gpu.add_inplace(nullptr, nullptr, -1); }, {"add_inplace", "-1"});
  testing::expect_error_containing([&] { gpu.sum_squares(nullptr, 5); }, {"sum_squares", "x is null"});
  ops::RmsNormParams norm;
  norm.rows = 3, norm.dim = 0;
  testing::expect_error_containing([&] { gpu.rmsnorm_forward(norm); }, {"rmsnorm_forward", "dim=0"});
  DeviceBuffer scratch(1024);
  norm.dim = 4, norm.x = scratch.as<float>(), norm.weight = scratch.as<float>(), norm.y = scratch.as<float>();
  norm.dy = scratch.as<float>(), norm.dx = scratch.as<float>();
  testing::expect_error_containing([&] { gpu.rmsnorm_backward_input(norm); },
                                   {"rmsnorm_backward_input", "rstd is null"});
  ops::RopeParams rope;
  rope.batch = 1, rope.seq = 1, rope.heads = 1, rope.head_dim = 7, rope.token_stride = 7;
  testing::expect_error_containing([&] { gpu.rope(rope); }, {"rope", "head_dim", "7"});
  rope.head_dim = 8, rope.token_stride = 4;
  testing::expect_error_containing([&] { gpu.rope(rope); }, {"rope", "token_stride 4"});
  rope.token_stride = 8, rope.position_offset = -2;
  testing::expect_error_containing([&] { gpu.rope(rope); }, {"rope", "position_offset -2"});
  ops::SwigluParams swiglu;
  swiglu.rows = -1, swiglu.ffn = 3;
  testing::expect_error_containing([&] { gpu.swiglu_forward(swiglu); }, {"swiglu_forward", "rows=-1"});
  ops::EmbeddingParams embedding;
  embedding.rows = 2, embedding.dim = 4, embedding.vocab = 0;
  testing::expect_error_containing([&] { gpu.embedding_forward(embedding); },
                                   {"embedding_forward", "vocab=0"});
  ops::AdamWParams adamw;
  adamw.n = 4, adamw.step = 0;
  testing::expect_error_containing([&] { gpu.adamw(adamw); }, {"adamw", "1-based"});
  adamw.step = 1;
  testing::expect_error_containing([&] { gpu.adamw(adamw); }, {"adamw", "param is null"});
}

}  // namespace
}  // namespace forge
