// The current-scaling ops of the CPU table against the host-scale path they replace, bitwise: amax_to writes
// what amax returns; a per-tensor cast whose scale comes from an amax in memory (Fp8CastParams::amax_in)
// writes the codes of the same cast with the host scale fp8::compute_scale(amax, fp8_max, margin, 1) and
// hands out that scale and 1 / scale; the FP8 GEMM reading scale_inv through pointers gives the bits of the
// GEMM given the values. The CUDA backend runs the same contracts (tests/kernels/cuda/
// fp8_current_scaling_test.cpp compares it with these CPU entries).
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/fp8/recipe.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

// Values over many binades with a few specials, rows x cols.
std::vector<float> make_input(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> x = testing::random_floats(static_cast<size_t>(rows * cols), seed);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(x[i], static_cast<int>(i % 23) - 11);
  if (!x.empty()) x[x.size() / 2] = -0.0f;
  return x;
}

TEST(Fp8CurrentScaling, AmaxToWritesTheAmax) {
  for (int variant = 0; variant < 5; ++variant) {
    std::vector<float> x = make_input(37, 41, 3);
    if (variant == 1) x[7] = -kInf;
    if (variant == 2) x[100] = std::bit_cast<float>(0xffc00001u);  // a negative NaN with a payload
    if (variant == 3) x.assign(x.size(), 0.0f);
    if (variant == 4) x[0] = std::bit_cast<float>(0x7f800001u);  // signalling NaN
    float out = 123.0f;
    ops::amax_to(x.data(), static_cast<int64_t>(x.size()), &out);
    EXPECT_EQ(bits(out), bits(ops::amax(x.data(), static_cast<int64_t>(x.size())))) << "variant " << variant;
  }
  float out = 123.0f;
  ops::amax_to(nullptr, 0, &out);
  EXPECT_EQ(bits(out), 0u);
  testing::expect_error_containing([&] { ops::amax_to(nullptr, 4, &out); }, {"amax_to"});
  testing::expect_error_containing([&] { ops::amax_to(&out, 1, nullptr); }, {"amax_to"});
}

struct CastOut {
  std::vector<uint8_t> q, q_t;
  float scale = 0, scale_inv = 0, returned_amax = 0;
};

// The cast with the host scale (today's path) or with amax_in (the device-side one), both outputs or one.
CastOut cast(const std::vector<float>& x, int64_t rows, int64_t cols, DType fp8, bool q, bool q_t,
             const float* amax_in, int margin, float host_scale) {
  CastOut r;
  if (q) r.q.assign(x.size(), 0xa5);
  if (q_t) r.q_t.assign(x.size(), 0x5a);
  ops::Fp8CastParams p;
  p.rows = rows, p.cols = cols, p.x = x.data(), p.fp8 = fp8;
  p.q = q ? r.q.data() : nullptr, p.q_t = q_t ? r.q_t.data() : nullptr;
  if (amax_in) {
    p.amax_in = amax_in, p.margin = margin;
    p.scale = 77.0f;  // ignored
  } else {
    p.scale = host_scale;
  }
  p.scale_out = &r.scale, p.scale_inv_out = &r.scale_inv;
  r.returned_amax = ops::fp8_cast_transpose(p);
  return r;
}

TEST(Fp8CurrentScaling, DeviceScaleCastIsTheHostScaleCastBitwise) {
  const int64_t rows = 67, cols = 130;
  const float tiny = std::numeric_limits<float>::denorm_min();
  // The amax the scale comes from: the tensor's own, and every special case of compute_scale (0, inf and NaN
  // keep scale 1, a negative one too; a subnormal one overflows the quotient to FLT_MAX).
  for (int amax_case = 0; amax_case < 7; ++amax_case) {
    std::vector<float> x = make_input(rows, cols, 11);
    float amax = ops::amax(x.data(), rows * cols);
    if (amax_case == 1) amax = 0.0f;
    if (amax_case == 2) amax = kInf;
    if (amax_case == 3) amax = kNaN;
    if (amax_case == 4) amax = tiny;
    if (amax_case == 5) amax = -2.0f;
    if (amax_case == 6) amax = 0.37f;  // smaller than the tensor's: products saturate
    // Margin 156 leaves fp8_max / 2^margin a rounded fp32 subnormal (E4M3) or a small one (E5M2).
    for (int margin : {0, 3, 156})
      for (DType fp8 : {DType::e4m3, DType::e5m2})
        for (auto [q, q_t] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
          const std::string what = "amax case " + std::to_string(amax_case) + " margin " +
                                   std::to_string(margin) + " " + std::string(dtype_name(fp8)) +
                                   (q ? " q" : "") + (q_t ? " q_t" : "");
          const float scale = fp8::compute_scale(amax, fp8::fp8_max(fp8), margin, 1.0f);
          const CastOut want = cast(x, rows, cols, fp8, q, q_t, nullptr, 0, scale);
          const CastOut got = cast(x, rows, cols, fp8, q, q_t, &amax, margin, 0.0f);
          EXPECT_EQ(got.q, want.q) << what;
          EXPECT_EQ(got.q_t, want.q_t) << what;
          EXPECT_EQ(bits(got.scale), bits(scale)) << what;
          EXPECT_EQ(bits(got.scale_inv), bits(1.0f / scale)) << what;
          // The host path hands out its scale too.
          EXPECT_EQ(bits(want.scale), bits(scale)) << what;
          EXPECT_EQ(bits(want.scale_inv), bits(1.0f / scale)) << what;
        }
    if (amax_case == 4) {
      EXPECT_EQ(fp8::compute_scale(amax, kE4m3Max, 0, 1.0f), FLT_MAX);
    }
  }
}

TEST(Fp8CurrentScaling, AmaxToThenCastIsTodaysCurrentRecipe) {
  // What Linear did before: amax on the host, compute_scale, the host-scale cast. Now: amax_to into memory,
  // the cast reading it. Same codes, scale and scale_inv, with a NaN and an all-zero input too.
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<float> x = make_input(64, 48, 21);
    if (variant == 1) x[5] = kNaN;
    if (variant == 2) x.assign(x.size(), 0.0f);
    for (int margin : {0, 2}) {
      const float old_amax = ops::amax(x.data(), 64 * 48);
      const float old_scale = fp8::compute_scale(old_amax, kE5m2Max, margin, 1.0f);
      const CastOut want = cast(x, 64, 48, DType::e5m2, true, true, nullptr, 0, old_scale);
      float amax = -1.0f;
      ops::amax_to(x.data(), 64 * 48, &amax);
      const CastOut got = cast(x, 64, 48, DType::e5m2, true, true, &amax, margin, 0.0f);
      EXPECT_EQ(got.q, want.q) << variant;
      EXPECT_EQ(got.q_t, want.q_t) << variant;
      EXPECT_EQ(bits(got.scale_inv), bits(1.0f / old_scale)) << variant;
      if (variant > 0) {
        EXPECT_EQ(got.scale, 1.0f) << variant;  // NaN and 0 keep the initial scale
      }
    }
  }
}

TEST(Fp8CurrentScaling, DeviceScaleCastStillFoldsIntoAnAccumulator) {
  const std::vector<float> x = make_input(16, 16, 5);
  const float amax = ops::amax(x.data(), 256);
  float accumulator = 0.25f;
  std::vector<uint8_t> q(256);
  ops::Fp8CastParams p;
  p.rows = 16, p.cols = 16, p.x = x.data(), p.q = q.data(), p.amax_in = &amax,
  p.amax_accumulate = &accumulator;
  ops::fp8_cast_transpose(p);
  EXPECT_EQ(accumulator, std::max(0.25f, amax));
}

TEST(Fp8CurrentScaling, EmptyInputStillWritesTheScale) {
  const float amax = 2.0f;
  float scale = 0, scale_inv = 0;
  uint8_t q = 0;
  ops::Fp8CastParams p;
  p.rows = 0, p.cols = 16, p.q = &q, p.amax_in = &amax, p.scale_out = &scale, p.scale_inv_out = &scale_inv;
  ops::fp8_cast_transpose(p);
  EXPECT_EQ(scale, 224.0f);
  EXPECT_EQ(scale_inv, 1.0f / 224.0f);
}

TEST(Fp8CurrentScaling, NegativeMarginIsRefused) {
  const float amax = 1.0f, x = 1.0f;
  uint8_t q = 0;
  ops::Fp8CastParams p;
  p.rows = 1, p.cols = 1, p.x = &x, p.q = &q, p.amax_in = &amax, p.margin = -1;
  testing::expect_error_containing([&] { ops::fp8_cast_transpose(p); }, {"fp8_cast_transpose", "margin -1"});
}

// The GEMM reading scale_inv through pointers is the GEMM given the values, bit for bit, in every
// combination.
TEST(Fp8CurrentScaling, GemmScalePointersAreTheValues) {
  const int64_t m = 24, n = 40, k = 72;
  std::vector<uint8_t> a(m * k), b(n * k);
  const std::vector<float> av = testing::random_floats(a.size(), 1, -400.0f, 400.0f);
  const std::vector<float> bv = testing::random_floats(b.size(), 2, -4e4f, 4e4f);
  for (size_t i = 0; i < a.size(); ++i) a[i] = f32_to_e4m3(av[i]);
  for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_e5m2(bv[i]);
  const float a_scale_inv = 0.0123f, b_scale_inv = 3.71f;
  auto run = [&](bool a_pointer, bool b_pointer, int accumulator_bits) {
    std::vector<float> c = testing::random_floats(m * n, 3);
    ops::Fp8GemmParams p;
    p.m = m, p.n = n, p.k = k;
    p.a = a.data(), p.lda = k, p.a_dtype = DType::e4m3;
    p.b = b.data(), p.ldb = k, p.trans_b = true, p.b_dtype = DType::e5m2;
    p.c = c.data(), p.ldc = n, p.beta = 0.5f;
    p.accumulator_bits = accumulator_bits, p.promote_every = 32;
    p.a_scale_inv = a_scale_inv, p.b_scale_inv = b_scale_inv;
    // A pointer replaces the value, which is then wrong (and not finite) on purpose.
    if (a_pointer) p.a_scale_inv_ptr = &a_scale_inv, p.a_scale_inv = kInf;
    if (b_pointer) p.b_scale_inv_ptr = &b_scale_inv, p.b_scale_inv = kNaN;
    ops::fp8_gemm(p);
    return c;
  };
  for (int accumulator_bits : {0, 12}) {
    const std::vector<float> want = run(false, false, accumulator_bits);
    for (auto [ap, bp] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
      const std::vector<float> got = run(ap, bp, accumulator_bits);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(bits(got[i]), bits(want[i]))
            << "element " << i << " pointers " << ap << bp << " bits " << accumulator_bits;
    }
  }
  // A non-finite scale_inv behind a pointer is refused where it can be read without waiting: here.
  const float inf = kInf;
  std::vector<float> c(m * n);
  ops::Fp8GemmParams p;
  p.m = m, p.n = n, p.k = k, p.a = a.data(), p.lda = k, p.b = b.data(), p.ldb = k, p.trans_b = true;
  p.b_dtype = DType::e5m2, p.c = c.data(), p.ldc = n, p.a_scale_inv_ptr = &inf;
  testing::expect_error_containing([&] { ops::fp8_gemm(p); }, {"fp8_gemm", "scale_inv must be finite"});
}

}  // namespace
}  // namespace forge
