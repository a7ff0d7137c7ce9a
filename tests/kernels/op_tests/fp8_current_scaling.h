// Current scaling without a host round trip, written once for every backend (op_harness.h): amax_to writes
// max |x| into memory of the op's device; the per-tensor cast whose scale comes from an amax there
// (Fp8CastParams::amax_in, fp8::compute_scale's arithmetic) writes its codes and hands out scale and 1 /
// scale; the FP8 GEMM reading scale_inv through pointers (Fp8GemmParams::a_scale_inv_ptr / b_scale_inv_ptr)
// gives the bits of the GEMM given the values. Codes, amaxes and scales are exact functions of their inputs,
// so everything is compared bit for bit: on the CPU against the host-scale path these ops replace (ops::amax,
// compute_scale on the host, the cast with that scale), elsewhere against the CPU kernels on the same inputs.
// Device outputs sit between guard bytes (and at byte offsets that rule out vector stores): an element a
// backend fails to write or a write out of bounds both show up.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/fp8/recipe.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/ops.h"
#include "kernels/cuda/bitwise_compare.h"
#include "op_harness.h"

namespace forge::op_tests::fp8_current_scaling {

using testing::DeviceArray;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr uint8_t kSentinel = 0xa5;

inline uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

// Whether the GPU runs FP8 GEMMs (FP8 tensor cores: compute capability 8.9 or more). The CUDA test binary
// points this at its query; the other backends always do.
inline bool (*gpu_runs_fp8_gemms)() = [] { return true; };

// x [rows, cols]: +-(1 + m/64) * 2^e over e in [-12, 12] (many products land on FP8 rounding ties), a -0, and
// with `nan` a negative NaN with a payload.
inline std::vector<float> tie_input(int64_t rows, int64_t cols, uint64_t seed, bool nan = false) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& v : x) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    const auto r = static_cast<uint32_t>(state >> 16);
    const int exponent = static_cast<int>(r % 25) - 12;
    v = std::bit_cast<float>(((r >> 20) & 1u) << 31 | uint32_t(127 + exponent) << 23 | ((r >> 8) % 64) << 17);
  }
  if (!x.empty()) x[x.size() / 3] = -0.0f;
  if (nan && !x.empty()) x[x.size() / 2] = std::bit_cast<float>(0xffc00001u);
  return x;
}

// Uniform values over 23 binades with a -0, rows x cols.
inline std::vector<float> binade_input(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> x = testing::random_floats(static_cast<size_t>(rows * cols), seed);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(x[i], static_cast<int>(i % 23) - 11);
  if (!x.empty()) x[x.size() / 2] = -0.0f;
  return x;
}

// n bytes on a device at `offset` from an aligned address, with 64 sentinel bytes on each side that the ops
// must leave alone.
class Guarded {
 public:
  Guarded(Device on, size_t n, size_t offset = 0)
      : n_(n), offset_(offset), buffer_(on, std::vector<uint8_t>(n + 128 + offset, kSentinel)) {}
  uint8_t* bytes() { return buffer_.data() + 64 + offset_; }
  float* floats() { return reinterpret_cast<float*>(bytes()); }
  void upload_floats(const std::vector<float>& values) {
    std::vector<uint8_t> all(n_ + 128 + offset_, kSentinel);
    std::memcpy(all.data() + 64 + offset_, values.data(), values.size() * sizeof(float));
    buffer_.upload(all);
  }
  std::vector<uint8_t> download(const std::string& what) {
    const std::vector<uint8_t> all = buffer_.download();
    const size_t begin = 64 + offset_, end = begin + n_;
    size_t bad = 0;
    for (size_t i = 0; i < all.size(); ++i)
      if ((i < begin || i >= end) && all[i] != kSentinel) ++bad;
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " guard bytes written";
    return std::vector<uint8_t>(all.begin() + static_cast<std::ptrdiff_t>(begin),
                                all.begin() + static_cast<std::ptrdiff_t>(end));
  }
  std::vector<float> download_floats(const std::string& what) {
    const std::vector<uint8_t> raw = download(what);
    std::vector<float> out(n_ / sizeof(float));
    if (!out.empty()) std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
    return out;
  }

 private:
  size_t n_, offset_;
  DeviceArray<uint8_t> buffer_;
};

// ---------------------------------------------------------------------------------------------------------------
// The cast with a scale from an amax in memory

struct Cast {
  int64_t rows = 0, cols = 0;
  DType fp8 = DType::e4m3;
  bool q = true, q_t = true;
  int margin = 0;
  // The amax: x's own (amax_to where the cast runs), or this value placed in memory.
  bool own_amax = true;
  float amax = 0;
  size_t x_offset = 0, q_offset = 0, q_t_offset = 0;
  bool accumulate = false;  // also fold x's amax into an accumulator holding 0.25

  std::string name() const {
    std::ostringstream out;
    out << "[" << rows << ", " << cols << "] " << dtype_name(fp8) << (q ? " q" : "") << (q_t ? " q_t" : "")
        << " margin " << margin;
    if (own_amax)
      out << " own amax";
    else
      out << " amax " << amax << " (" << test::hex(bits(amax)) << ")";
    if (x_offset || q_offset || q_t_offset)
      out << " offsets " << x_offset << "/" << q_offset << "/" << q_t_offset;
    if (accumulate) out << " accumulate";
    return out.str();
  }
};

struct CastResult {
  std::vector<uint8_t> q, q_t;
  std::vector<float> scales;  // amax, scale, scale_inv
  float accumulator = 0;
};

// The cast with amax_in on `on`.
inline CastResult run_cast(Device on, const Cast& c, const std::vector<float>& x) {
  const size_t n = x.size();
  DeviceArray<float> dx(on, x, c.x_offset);
  Guarded q(on, c.q ? n : 0, c.q_offset), q_t(on, c.q_t ? n : 0, c.q_t_offset), scales(on, 3 * sizeof(float));
  Guarded accumulator(on, sizeof(float));
  accumulator.upload_floats({0.25f});
  float* amax = scales.floats();
  if (c.own_amax)
    FORGE_TEST_OP(amax_to, on, dx.data(), c.rows * c.cols, amax);
  else
    scales.upload_floats({c.amax});
  ops::Fp8CastParams p;
  p.rows = c.rows, p.cols = c.cols, p.x = dx.data(), p.fp8 = c.fp8;
  p.q = c.q ? q.bytes() : nullptr, p.q_t = c.q_t ? q_t.bytes() : nullptr;
  p.scale = 77.0f;  // ignored under amax_in
  p.amax_in = amax, p.margin = c.margin, p.scale_out = amax + 1, p.scale_inv_out = amax + 2;
  if (c.accumulate) p.amax_accumulate = accumulator.floats();
  FORGE_TEST_OP(fp8_cast_transpose, on, p);
  const std::string what = c.name();
  CastResult r;
  if (c.q) r.q = q.download(what + ": q");
  if (c.q_t) r.q_t = q_t.download(what + ": q_t");
  r.scales = scales.download_floats(what + ": scales");
  r.accumulator = accumulator.download_floats(what + ": accumulator")[0];
  return r;
}

// The host-scale path on the CPU: amax on the host (or the given one), compute_scale, the cast with that
// scale; that cast hands out its scale too.
inline CastResult host_scale_cast(const Cast& c, const std::vector<float>& x) {
  CastResult r;
  const float amax = c.own_amax ? ops::amax(x.data(), c.rows * c.cols) : c.amax;
  const float scale = fp8::compute_scale(amax, fp8::fp8_max(c.fp8), c.margin, 1.0f);
  if (c.q) r.q.assign(x.size(), 0xa5);
  if (c.q_t) r.q_t.assign(x.size(), 0x5a);
  float scale_out = 0, scale_inv_out = 0;
  ops::Fp8CastParams p;
  p.rows = c.rows, p.cols = c.cols, p.x = x.data(), p.fp8 = c.fp8, p.scale = scale;
  p.q = c.q ? r.q.data() : nullptr, p.q_t = c.q_t ? r.q_t.data() : nullptr;
  p.scale_out = &scale_out, p.scale_inv_out = &scale_inv_out;
  const float returned = ops::fp8_cast_transpose(p);
  const std::string what = c.name() + ", host scale";
  EXPECT_EQ(bits(scale_out), bits(scale)) << what;
  EXPECT_EQ(bits(scale_inv_out), bits(1.0f / scale)) << what;
  r.scales = {amax, scale, 1.0f / scale};
  // The delayed recipe's fold: max, NaN-propagating (x's own amax is what the cast returns).
  r.accumulator = std::isnan(returned) ? returned : std::max(0.25f, returned);
  return r;
}

// The case on this backend: on the CPU against the host-scale path, elsewhere against the CPU, bitwise.
inline void check_cast(Device on, const Cast& c, const std::vector<float>& x) {
  SCOPED_TRACE(c.name());
  const CastResult got = run_cast(on, c, x);
  const CastResult want = on == Device::cpu ? host_scale_cast(c, x) : run_cast(Device::cpu, c, x);
  const std::string what = c.name();
  test::expect_bitwise(got.q, want.q, what + ": q");
  test::expect_bitwise(got.q_t, want.q_t, what + ": q_t");
  test::expect_bitwise(got.scales, want.scales, what + ": amax, scale, scale_inv");
  if (c.accumulate)
    test::expect_bitwise(std::vector<float>{got.accumulator}, {want.accumulator}, what + ": accumulator");
}

inline const std::vector<std::pair<bool, bool>> kOutputs = {{true, false}, {false, true}, {true, true}};

// A tensor the cast runs on with its own amax.
struct Case {
  int64_t rows, cols;
  bool nan = false;      // a NaN in x: amax NaN, scale 1 (and NaN codes where the NaN sits)
  bool binades = false;  // binade_input instead of tie_input
  std::string name() const {
    return std::to_string(rows) + "x" + std::to_string(cols) + (nan ? "_nan" : "") +
           (binades ? "_binades" : "");
  }
  std::vector<float> input() const {
    return binades ? binade_input(rows, cols, 11)
                   : tie_input(rows, cols, static_cast<uint64_t>(rows * 7 + cols), nan);
  }
};

// Ragged shapes (partial tiles, sizes that rule out vector loads), one element, narrow tensors.
inline const std::vector<Case> kCases = {
    {1, 1},      {3, 130},         {129, 257},
    {300, 1000}, {67, 387},        {200, 3},
    {256, 384},  {129, 257, true}, {67, 130, false, true},
};

class Fp8CurrentScalingOp : public testing::OpTest<Case> {};

TEST_P(Fp8CurrentScalingOp, CastWithItsOwnAmax) {
  const Case& tc = test_case();
  const std::vector<float> x = tc.input();
  for (DType fp8 : {DType::e4m3, DType::e5m2})
    for (int margin : {0, 3, 156})
      for (auto [q, q_t] : kOutputs) {
        Cast c;
        c.rows = tc.rows, c.cols = tc.cols, c.fp8 = fp8, c.q = q, c.q_t = q_t, c.margin = margin;
        check_cast(device(), c, x);
      }
}

class Fp8CurrentScalingFixed : public testing::OpTest<testing::FixedCase> {};

// compute_scale's special cases, from an amax placed in memory: 0, inf, NaN (of either sign) and a negative
// value keep scale 1; a subnormal amax overflows the quotient to FLT_MAX; an amax smaller than the tensor's
// saturates products; a margin of 156 makes fp8_max / 2^margin a rounded fp32 subnormal (E4M3) or a small one
// (E5M2).
TEST_P(Fp8CurrentScalingFixed, CastWithSpecialAmaxes) {
  const float amaxes[] = {0.0f,
                          kInf,
                          kNaN,
                          std::bit_cast<float>(0xffc00001u),
                          -2.0f,
                          -0.0f,
                          std::numeric_limits<float>::denorm_min(),
                          0.37f,
                          3e38f};
  for (const auto& [rows, cols, x] : {std::tuple{int64_t{129}, int64_t{257}, tie_input(129, 257, 9)},
                                      std::tuple{int64_t{67}, int64_t{130}, binade_input(67, 130, 11)}})
    for (float amax : amaxes)
      for (DType fp8 : {DType::e4m3, DType::e5m2})
        for (int margin : {0, 3, 156})
          for (auto [q, q_t] : kOutputs) {
            Cast c;
            c.rows = rows, c.cols = cols, c.fp8 = fp8, c.q = q, c.q_t = q_t, c.margin = margin;
            c.own_amax = false, c.amax = amax;
            check_cast(device(), c, x);
          }
  EXPECT_EQ(fp8::compute_scale(std::numeric_limits<float>::denorm_min(), kE4m3Max, 0, 1.0f), FLT_MAX);
}

// Shapes that allow float4 loads and word stores, pointers that do not; more tiles than the CUDA tiled
// kernel's grid (1024 CTAs) and more elements than one round of its flat kernel, so every CTA of a looping
// grid computes the scale for itself; the delayed recipe's accumulator alongside the amax_in scale.
TEST_P(Fp8CurrentScalingFixed, CastPathsAndLargeInputs) {
  {
    const std::vector<float> x = tie_input(300, 1000, 13);
    for (auto [xo, qo, qto] : {std::tuple<size_t, size_t, size_t>{1, 0, 0}, {0, 1, 2}, {2, 3, 1}})
      for (auto [q, q_t] : kOutputs) {
        Cast c;
        c.rows = 300, c.cols = 1000, c.q = q, c.q_t = q_t, c.margin = 1;
        c.x_offset = xo, c.q_offset = qo, c.q_t_offset = qto;
        check_cast(device(), c, x);
      }
    for (auto [q, q_t] : kOutputs) {
      Cast c;
      c.rows = 300, c.cols = 1000, c.fp8 = DType::e5m2, c.q = q, c.q_t = q_t, c.accumulate = true;
      check_cast(device(), c, x);
    }
  }
  {
    const std::vector<float> x = binade_input(16, 16, 5);
    Cast c;
    c.rows = 16, c.cols = 16, c.q_t = false, c.accumulate = true;
    check_cast(device(), c, x);
  }
  const int64_t rows = 33 * 128 + 5, cols = 32 * 128;
  const std::vector<float> x = tie_input(rows, cols, 17);
  for (auto [q, q_t] : {std::pair{true, false}, std::pair{true, true}}) {
    Cast c;
    c.rows = rows, c.cols = cols, c.q = q, c.q_t = q_t, c.margin = 2;
    check_cast(device(), c, x);
  }
}

// What Linear did before: amax on the host, compute_scale, the host-scale cast (on the CPU). Now: amax_to
// into memory, the cast reading it. Same codes, scale and scale_inv, with a NaN and an all-zero input too.
TEST_P(Fp8CurrentScalingFixed, AmaxToThenCastIsTheHostCurrentRecipe) {
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<float> x = binade_input(64, 48, 21);
    if (variant == 1) x[5] = kNaN;
    if (variant == 2) x.assign(x.size(), 0.0f);
    for (int margin : {0, 2}) {
      Cast c;
      c.rows = 64, c.cols = 48, c.fp8 = DType::e5m2, c.margin = margin;
      const CastResult want = host_scale_cast(c, x);
      const CastResult got = run_cast(device(), c, x);
      EXPECT_EQ(got.q, want.q) << variant;
      EXPECT_EQ(got.q_t, want.q_t) << variant;
      EXPECT_EQ(bits(got.scales[2]), bits(want.scales[2])) << variant;
      if (variant > 0) {
        EXPECT_EQ(got.scales[1], 1.0f) << variant;  // NaN and 0 keep the initial scale
      }
    }
  }
}

// An empty tensor still writes the scale (no element); a host scale is handed out too, and the returned amax
// and the codes are the CPU's.
TEST_P(Fp8CurrentScalingFixed, ScaleOutputsForEmptyInputsAndHostScales) {
  Guarded scales(device(), 3 * sizeof(float));
  scales.upload_floats({2.0f});
  ops::Fp8CastParams p;
  p.rows = 0, p.cols = 64, p.fp8 = DType::e4m3;
  Guarded q(device(), 1);
  p.q = q.bytes();
  p.amax_in = scales.floats(), p.scale_out = scales.floats() + 1, p.scale_inv_out = scales.floats() + 2;
  FORGE_TEST_OP(fp8_cast_transpose, device(), p);
  test::expect_bitwise(scales.download_floats("empty: scales"),
                       std::vector<float>{2.0f, 224.0f, 1.0f / 224.0f}, "empty input");
  EXPECT_EQ(q.download("empty: q")[0], kSentinel);

  // Host scale (the delayed recipe's) with scale outputs.
  const std::vector<float> x = tie_input(48, 80, 19);
  DeviceArray<float> dx(device(), x);
  Guarded codes(device(), x.size()), outputs(device(), 2 * sizeof(float));
  ops::Fp8CastParams h;
  h.rows = 48, h.cols = 80, h.x = dx.data(), h.fp8 = DType::e5m2, h.scale = 0.7f, h.q = codes.bytes();
  h.scale_out = outputs.floats(), h.scale_inv_out = outputs.floats() + 1;
  const float returned = FORGE_TEST_OP(fp8_cast_transpose, device(), h);
  EXPECT_EQ(bits(returned), bits(ops::amax(x.data(), 48 * 80)));
  test::expect_bitwise(outputs.download_floats("host scale: outputs"), std::vector<float>{0.7f, 1.0f / 0.7f},
                       "host scale outputs");
  std::vector<uint8_t> want(x.size());
  ops::Fp8CastParams hc = h;
  hc.x = x.data(), hc.q = want.data(), hc.scale_out = hc.scale_inv_out = nullptr;
  ops::fp8_cast_transpose(hc);
  test::expect_bitwise(codes.download("host scale: q"), want, "host scale: q");
}

TEST_P(Fp8CurrentScalingFixed, NegativeMarginIsRefused) {
  DeviceArray<float> amax(device(), std::vector<float>{1.0f}), x(device(), std::vector<float>{1.0f});
  DeviceArray<uint8_t> q(device(), 1);
  ops::Fp8CastParams p;
  p.rows = 1, p.cols = 1, p.x = x.data(), p.q = q.data(), p.amax_in = amax.data(), p.margin = -1;
  testing::expect_error_containing([&] { ops::fp8_cast_transpose(p, device()); },
                                   {"fp8_cast_transpose", "margin -1"});
}

// ---------------------------------------------------------------------------------------------------------------
// amax_to

// amax_to writes what the CPU's amax returns (on the CPU) or the CPU's amax_to writes (elsewhere), bitwise:
// -inf, NaNs of either sign with payloads (in the tail too), signalling NaN, all zeros, near -FLT_MAX; sizes
// that take the CUDA flat kernel through several CTAs and a scalar tail, x off 16-byte alignment. A bf16 x
// (its values rounded to bf16) gives the amax of its fp32 copy.
TEST_P(Fp8CurrentScalingFixed, AmaxToWritesTheAmax) {
  auto check_one = [&](const std::vector<float>& x, auto dx, int64_t n, const std::string& what) {
    Guarded out(device(), sizeof(float));  // starts as sentinel bytes: the op must write it
    FORGE_TEST_OP(amax_to, device(), dx, n, out.floats());
    float want = 0;
    if (on_cpu())
      want = ops::amax(x.data(), n);
    else
      ops::amax_to(x.data(), n, &want);
    test::expect_bitwise(out.download_floats(what), std::vector<float>{want}, what);
  };
  auto check = [&](const std::vector<float>& x, size_t offset, const std::string& what) {
    const int64_t n = static_cast<int64_t>(x.size());
    DeviceArray<float> dx(device(), x, offset);
    check_one(x, dx.data(), n, what);
    std::vector<uint16_t> x16(x.size());
    std::vector<float> widened(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      x16[i] = f32_to_bf16_bits(x[i]), widened[i] = bf16_bits_to_f32(x16[i]);
    DeviceArray<uint16_t> dx16(device(), x16, offset);
    check_one(widened, dx16.data(), n, what + " bf16");
  };
  for (int64_t n :
       {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{1000}, int64_t{300001}, (int64_t{1} << 22) + 3}) {
    const std::vector<float> original = tie_input(1, n, 7);
    for (int variant = 0; variant < 6; ++variant) {
      if (n == 0 && variant > 0) break;
      std::vector<float> x = original;
      if (variant == 1) x[n / 2] = -kInf;
      if (variant == 2) x[n - 1] = std::bit_cast<float>(0xffc00001u);  // NaN in the tail, negative, payload
      if (variant == 3) x[0] = std::bit_cast<float>(0x7f800001u);      // signalling NaN
      if (variant == 4) std::fill(x.begin(), x.end(), 0.0f);
      if (variant == 5) x[n / 3] = -3e38f;
      check(x, variant % 2, "amax_to n=" + std::to_string(n) + " variant " + std::to_string(variant));
    }
  }
  for (int variant = 0; variant < 5; ++variant) {
    std::vector<float> x = binade_input(37, 41, 3);
    if (variant == 1) x[7] = -kInf;
    if (variant == 2) x[100] = std::bit_cast<float>(0xffc00001u);  // a negative NaN with a payload
    if (variant == 3) x.assign(x.size(), 0.0f);
    if (variant == 4) x[0] = std::bit_cast<float>(0x7f800001u);  // signalling NaN
    check(x, 0, "amax_to 37x41 variant " + std::to_string(variant));
  }
  // Nothing: 0. Null pointers are refused, naming the op.
  DeviceArray<float> out(device(), std::vector<float>{123.0f});
  FORGE_TEST_OP(amax_to, device(), nullptr, 0, out.data());
  EXPECT_EQ(bits(out.download()[0]), 0u);
  testing::expect_error_containing([&] { ops::amax_to(nullptr, 4, out.data(), device()); }, {"amax_to"});
  testing::expect_error_containing([&] { ops::amax_to(out.data(), 1, nullptr, device()); }, {"amax_to"});
}

// ---------------------------------------------------------------------------------------------------------------
// The GEMM with scale pointers

// A GEMM [64, 160] x [96, 160]^T of E4M3 by E5M2 codes over several binades: the products' rounding inside a
// GPU's tensor cores is whatever it is, the same for every run of one plan; what is compared is runs with the
// scales given as values and through pointers.
struct Gemm {
  static constexpr int64_t m = 64, n = 96, k = 160;
  Device on;
  std::vector<uint8_t> ha, hb;
  DeviceArray<uint8_t> a, b;
  DeviceArray<float> c;

  static std::vector<uint8_t> codes(size_t count, DType dtype, uint64_t& state) {
    std::vector<uint8_t> v(count);
    auto next = [&] {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      return static_cast<uint32_t>(state >> 16);
    };
    for (auto& x : v) {
      const float value = std::ldexp(static_cast<float>(next() % 15) - 7.0f, int(next() % 7) - 3);
      x = dtype == DType::e4m3 ? f32_to_e4m3(value) : f32_to_e5m2(value);
    }
    return v;
  }
  explicit Gemm(Device device) : Gemm(device, 99) {}
  Gemm(Device device, uint64_t state)
      : on(device),
        ha(codes(m * k, DType::e4m3, state)),
        hb(codes(n * k, DType::e5m2, state)),
        a(device, ha),
        b(device, hb),
        c(device, static_cast<size_t>(m * n)) {}
  ops::Fp8GemmParams params() {
    ops::Fp8GemmParams p;
    p.m = m, p.n = n, p.k = k;
    p.a = a.data(), p.lda = k, p.a_dtype = DType::e4m3;
    p.b = b.data(), p.ldb = k, p.trans_b = true, p.b_dtype = DType::e5m2;
    p.c = c.data(), p.ldc = n;
    return p;
  }
  std::vector<float> run(const ops::Fp8GemmParams& p) {
    c.upload(std::vector<float>(m * n, 0.0f));
    FORGE_TEST_OP(fp8_gemm, on, p);
    return c.download();
  }
};

// The GEMM reading scale_inv through pointers gives the bits of the GEMM given the values, for either
// operand and both (the value beside a pointer set wrong, and not finite, on purpose); a cached plan goes
// back to the values afterwards, and pointers that change from call to call are followed.
TEST_P(Fp8CurrentScalingFixed, GemmScalePointersGiveTheValuesBits) {
  if (backend() == testing::Backend::gpu && !gpu_runs_fp8_gemms()) GTEST_SKIP() << "no FP8 tensor cores";
  Gemm g(device());
  const float a_inv = 0.0123f, b_inv = 3.71f;  // not powers of two: applying them rounds
  DeviceArray<float> scales(device(), std::vector<float>{a_inv, b_inv, 0.5f, 2.0f});
  ops::Fp8GemmParams host = g.params();
  host.a_scale_inv = a_inv, host.b_scale_inv = b_inv;
  const std::vector<float> want = g.run(host);
  ops::Fp8GemmParams other = g.params();
  other.a_scale_inv = 0.5f, other.b_scale_inv = 2.0f;
  const std::vector<float> want_other = g.run(other);
  for (auto [ap, bp] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
    ops::Fp8GemmParams p = host;
    if (ap) p.a_scale_inv_ptr = scales.data(), p.a_scale_inv = kInf;
    if (bp) p.b_scale_inv_ptr = scales.data() + 1, p.b_scale_inv = kNaN;
    const std::string what = std::string("pointers ") + (ap ? "a" : "") + (bp ? "b" : "");
    test::expect_bitwise(g.run(p), want, what);
    test::expect_bitwise(g.run(other), want_other, what + ", then host values");
  }
  ops::Fp8GemmParams moved = host;
  moved.a_scale_inv_ptr = scales.data() + 2, moved.b_scale_inv_ptr = scales.data() + 3;
  test::expect_bitwise(g.run(moved), want_other, "pointers to other floats");
}

}  // namespace forge::op_tests::fp8_current_scaling
