// The quantisation kernels against references written here from the scalar conversions of core/dtype.h
// (exhaustively tested in tests/core/dtype_test.cpp): per element, per tile, naive loops.
#include "forge/fp8/quantize.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "forge/core/error.h"
#include "forge/fp8/scaling.h"

namespace forge::fp8::quantize_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr DType kFormats[] = {DType::e4m3, DType::e5m2};

uint8_t ref_encode(float v, DType fp8) { return fp8 == DType::e4m3 ? f32_to_e4m3(v) : f32_to_e5m2(v); }
float ref_decode(uint8_t q, DType fp8) { return fp8 == DType::e4m3 ? e4m3_to_f32(q) : e5m2_to_f32(q); }

// Normal-ish values over many binades, with zeros, signed zeros and values far beyond the FP8 range.
std::vector<float> random_values(int64_t n, uint32_t seed, float spread = 8.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-spread, spread);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = normal(rng) * std::exp2(exponent(rng));
  return x;
}

// Independent amax: NaN if any NaN, else max |x|.
float ref_amax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return kNaN;
    m = std::max(m, std::fabs(x[i]));
  }
  return m;
}

// The block scale rule, written out: fp8_max / amax, FLT_MAX on overflow, 1 for 0/inf/NaN, power of two
// by frexp.
float ref_block_scale(float amax, DType fp8, bool power_of_two) {
  if (amax == 0.0f || !std::isfinite(amax)) return 1.0f;
  float s = (fp8 == DType::e4m3 ? 448.0f : 57344.0f) / amax;
  if (std::isinf(s)) s = FLT_MAX;
  if (power_of_two) {
    int e;
    std::frexp(s, &e);
    s = std::ldexp(1.0f, e - 1);
  }
  return s;
}

void expect_same_float(float a, float b, const char* what, int64_t i) {
  if (std::isnan(b)) {
    EXPECT_TRUE(std::isnan(a)) << what << " " << i;
  } else {
    EXPECT_EQ(a, b) << what << " " << i;
  }
}

TEST(Fp8Quantize, EqualsScalarConversionWithSaturationAndNaN) {
  const int64_t n = 100003;  // parallel path, partial last chunk
  std::vector<float> x = random_values(n, 1, 12.0f);
  x[0] = kNaN, x[1] = -kNaN, x[2] = kInf, x[3] = -kInf, x[4] = 1e30f, x[5] = -1e30f, x[6] = 0.0f,
  x[7] = -0.0f;
  x[8] = std::numeric_limits<float>::denorm_min();
  for (DType fp8 : kFormats) {
    for (float scale : {1.0f, 3.7f, 0.015625f, 1e4f}) {
      std::vector<uint8_t> q(n);
      const float amax = quantize(x.data(), n, scale, fp8, q.data());
      EXPECT_TRUE(std::isnan(amax));
      int mismatches = 0;
      for (int64_t i = 0; i < n; ++i) mismatches += q[i] != ref_encode(x[i] * scale, fp8);
      EXPECT_EQ(mismatches, 0) << dtype_name(fp8) << " scale " << scale;
      const float max = fp8_max(fp8);
      EXPECT_EQ(ref_decode(q[2], fp8), max);  // inf saturates
      EXPECT_EQ(ref_decode(q[3], fp8), -max);
      EXPECT_EQ(ref_decode(q[4], fp8), max);  // finite overflow saturates
      EXPECT_TRUE(std::isnan(ref_decode(q[0], fp8)));
      EXPECT_TRUE(std::isnan(ref_decode(q[1], fp8)));
    }
  }
}

TEST(Fp8Quantize, Amax) {
  for (int64_t n : {0, 1, 17, 8192, 8193, 70001}) {
    std::vector<float> x = random_values(n, 2 + n);
    std::vector<uint8_t> q(n);
    EXPECT_EQ(quantize(x.data(), n, 1.0f, DType::e4m3, q.data()), ref_amax(x.data(), n)) << n;
    EXPECT_EQ(compute_amax(x.data(), n), ref_amax(x.data(), n)) << n;
    if (n > 1) {
      x[n / 2] = -kInf;  // a negative inf is amax inf
      EXPECT_EQ(quantize(x.data(), n, 1.0f, DType::e5m2, q.data()), kInf);
      EXPECT_EQ(compute_amax(x.data(), n), kInf);
      x[n - 1] = -kNaN;
      EXPECT_TRUE(std::isnan(quantize(x.data(), n, 1.0f, DType::e5m2, q.data())));
      EXPECT_TRUE(std::isnan(compute_amax(x.data(), n)));
    }
  }
  // The negative element with the largest magnitude sets the amax.
  const float y[4] = {1.0f, -5.5f, 5.25f, -0.0f};
  EXPECT_EQ(compute_amax(y, 4), 5.5f);
}

TEST(Fp8Quantize, DequantizeIsDecodeTimesScaleInv) {
  const int64_t n = 70001;
  std::vector<float> x = random_values(n, 3);
  for (DType fp8 : kFormats) {
    std::vector<uint8_t> q(n);
    quantize(x.data(), n, 2.5f, fp8, q.data());
    std::vector<float> y(n);
    dequantize(q.data(), n, 0.4f, fp8, y.data());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], ref_decode(q[i], fp8) * 0.4f) << i;
  }
}

// |dequantize(quantize(x)) - x| is at most half an FP8 ulp of x * scale, divided by the scale: relative
// 2^-(mantissa bits + 1) in the normal range, half the subnormal step below it. The scale is the current-
// scaling one (amax maps to the format's max), a power of two so that scaling itself is exact.
TEST(Fp8Quantize, RoundTripWithinHalfUlp) {
  const int64_t n = 50000;
  std::vector<float> x = random_values(n, 4, 10.0f);
  for (DType fp8 : kFormats) {
    const int mantissa_bits = fp8 == DType::e4m3 ? 3 : 2;
    const float half_subnormal_step = fp8 == DType::e4m3 ? 0x1p-10f : 0x1p-17f;
    const float scale = compute_scale(compute_amax(x.data(), n), fp8_max(fp8), 0, 1.0f, true);
    std::vector<uint8_t> q(n);
    std::vector<float> y(n);
    quantize(x.data(), n, scale, fp8, q.data());
    dequantize(q.data(), n, 1.0f / scale, fp8, y.data());
    for (int64_t i = 0; i < n; ++i) {
      const float bound =
          std::max(std::ldexp(std::fabs(x[i]), -(mantissa_bits + 1)), half_subnormal_step / scale);
      ASSERT_LE(std::fabs(y[i] - x[i]), bound) << dtype_name(fp8) << " x=" << x[i] << " y=" << y[i];
    }
  }
}

TEST(Fp8Quantize, CastTransposeEqualsQuantizeThenTranspose) {
  const int64_t shapes[][2] = {{130, 257}, {1, 1},   {64, 64},   {1, 300},
                               {300, 1},   {65, 63}, {300, 257}, {0, 5}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1], n = rows * cols;
    std::vector<float> x = random_values(n, 5 + static_cast<uint32_t>(n));
    if (n > 10) x[7] = kNaN, x[n - 2] = -kInf;
    for (DType fp8 : kFormats) {
      std::vector<uint8_t> expected(n), rowwise(n, 0xaa), colwise(n, 0xaa);
      const float expected_amax = quantize(x.data(), n, 11.0f, fp8, expected.data());
      const float amax = cast_transpose(x.data(), rows, cols, 11.0f, fp8, rowwise.data(), colwise.data());
      expect_same_float(amax, expected_amax, "amax", n);
      EXPECT_EQ(rowwise, expected) << rows << "x" << cols;
      int mismatches = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) mismatches += colwise[c * rows + r] != expected[r * cols + c];
      EXPECT_EQ(mismatches, 0) << rows << "x" << cols;
    }
  }
}

// Naive 1x128 reference: q [rows, cols], scale_inv [rows][ceil(cols/128)].
void ref_1x128(const std::vector<float>& x, int64_t rows, int64_t cols, DType fp8, bool power_of_two,
               std::vector<uint8_t>& q, std::vector<float>& scale_inv) {
  const int64_t kb_count = (cols + 127) / 128;
  q.assign(rows * cols, 0);
  scale_inv.assign(rows * kb_count, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const int64_t c0 = kb * 128, c1 = std::min(cols, c0 + 128);
      const float scale = ref_block_scale(ref_amax(&x[r * cols + c0], c1 - c0), fp8, power_of_two);
      scale_inv[r * kb_count + kb] = 1.0f / scale;
      for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = ref_encode(x[r * cols + c] * scale, fp8);
    }
  }
}

// Naive 128x128 reference: scale_inv [ceil(rows/128)][ceil(cols/128)].
void ref_128x128(const std::vector<float>& x, int64_t rows, int64_t cols, DType fp8, bool power_of_two,
                 std::vector<uint8_t>& q, std::vector<float>& scale_inv) {
  const int64_t rb_count = (rows + 127) / 128, kb_count = (cols + 127) / 128;
  q.assign(rows * cols, 0);
  scale_inv.assign(rb_count * kb_count, 0.0f);
  for (int64_t rb = 0; rb < rb_count; ++rb) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const int64_t r0 = rb * 128, r1 = std::min(rows, r0 + 128), c0 = kb * 128,
                    c1 = std::min(cols, c0 + 128);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        const float a = ref_amax(&x[r * cols + c0], c1 - c0);
        amax = std::isnan(amax) || std::isnan(a) ? kNaN : std::max(amax, a);
      }
      const float scale = ref_block_scale(amax, fp8, power_of_two);
      scale_inv[rb * kb_count + kb] = 1.0f / scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = ref_encode(x[r * cols + c] * scale, fp8);
    }
  }
}

std::vector<float> transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = x[r * cols + c];
  return t;
}

// Inputs whose tiles have very different ranges, with special tiles: all zero, holding a NaN, holding an
// inf, and so tiny that fp8_max / amax overflows.
std::vector<float> block_input(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> x = random_values(rows * cols, seed, 3.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& v = x[r * cols + c];
      v *= std::exp2(static_cast<float>((r / 128 * 7 + c / 128 * 3) % 13) - 6.0f);  // per-block range
      if (r < 128 && c < 128) v = 0.0f;                                             // zero block
      if (r >= 128 && r < 256 && c < 128) v *= 1e-40f;                              // subnormal block
    }
  if (rows > 129 && cols > 129) {
    x[129 * cols + 130] = kNaN;
    x[130 * cols + 131] = -kInf;
  }
  return x;
}

TEST(Fp8BlockQuantize, OneByOneTwentyEightMatchesReference) {
  const int64_t shapes[][2] = {{130, 257}, {1, 128}, {3, 1}, {257, 129}, {300, 260}, {0, 7}, {3, 8492}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1];
    const std::vector<float> x = block_input(rows, cols, 6);
    for (DType fp8 : kFormats) {
      for (bool power_of_two : {false, true}) {
        std::vector<uint8_t> expected_q, q(rows * cols);
        std::vector<float> expected_s, s(rows * num_blocks(cols));
        ref_1x128(x, rows, cols, fp8, power_of_two, expected_q, expected_s);
        quantize_1x128(x.data(), rows, cols, fp8, power_of_two, q.data(), s.data());
        EXPECT_EQ(q, expected_q) << rows << "x" << cols;
        EXPECT_EQ(s, expected_s) << rows << "x" << cols;

        // Exact dequantisation: decode * the tile's scale_inv.
        std::vector<float> y(rows * cols);
        dequantize_1x128(q.data(), rows, cols, s.data(), fp8, y.data());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            expect_same_float(y[r * cols + c],
                              ref_decode(q[r * cols + c], fp8) * s[r * num_blocks(cols) + c / 128],
                              "dequantize", r * cols + c);
      }
    }
  }
}

TEST(Fp8BlockQuantize, OneByOneTwentyEightTransposedIsTheTransposeQuantized) {
  const int64_t shapes[][2] = {{257, 130}, {128, 1}, {1, 3}, {300, 260}, {129, 40}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1];
    const std::vector<float> x = block_input(rows, cols, 7);
    for (DType fp8 : kFormats) {
      for (bool power_of_two : {false, true}) {
        std::vector<uint8_t> expected_q, q(rows * cols);
        std::vector<float> expected_s, s(cols * num_blocks(rows));
        ref_1x128(transposed(x, rows, cols), cols, rows, fp8, power_of_two, expected_q, expected_s);
        quantize_1x128_transposed(x.data(), rows, cols, fp8, power_of_two, q.data(), s.data());
        EXPECT_EQ(q, expected_q) << rows << "x" << cols;
        EXPECT_EQ(s, expected_s) << rows << "x" << cols;
      }
    }
  }
}

TEST(Fp8BlockQuantize, WithTransposeEqualsBothSeparatePasses) {
  // Shapes with partial tiles on both edges, one tile, many tiles (the parallel path), NaN and inf inside.
  const int64_t shapes[][2] = {{257, 130}, {128, 1}, {1, 3}, {300, 260}, {129, 40}, {512, 384}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1];
    std::vector<float> x = block_input(rows, cols, 11);
    x[static_cast<size_t>(rows * cols / 2)] = kNaN;
    x[0] = -kInf;
    for (DType fp8 : kFormats) {
      for (bool power_of_two : {false, true}) {
        std::vector<uint8_t> q1(rows * cols), qt1(rows * cols), q2(rows * cols), qt2(rows * cols);
        std::vector<float> s1(rows * num_blocks(cols)), st1(cols * num_blocks(rows)), s2(s1.size()),
            st2(st1.size());
        quantize_1x128(x.data(), rows, cols, fp8, power_of_two, q1.data(), s1.data());
        quantize_1x128_transposed(x.data(), rows, cols, fp8, power_of_two, qt1.data(), st1.data());
        quantize_1x128_with_transpose(x.data(), rows, cols, fp8, power_of_two, q2.data(), s2.data(),
                                      qt2.data(), st2.data());
        EXPECT_EQ(q2, q1) << rows << "x" << cols;
        EXPECT_EQ(qt2, qt1) << rows << "x" << cols;
        EXPECT_EQ(0, std::memcmp(s2.data(), s1.data(), s1.size() * sizeof(float))) << rows << "x" << cols;
        EXPECT_EQ(0, std::memcmp(st2.data(), st1.data(), st1.size() * sizeof(float))) << rows << "x" << cols;
      }
    }
  }
}

TEST(Fp8BlockQuantize, OneTwentyEightSquareMatchesReferenceAndTranspose) {
  const int64_t shapes[][2] = {{130, 257}, {128, 128}, {1, 1}, {257, 129}, {300, 260}, {5, 0}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1];
    const int64_t rb_count = num_blocks(rows), kb_count = num_blocks(cols);
    const std::vector<float> x = block_input(rows, cols, 8);
    for (DType fp8 : kFormats) {
      for (bool power_of_two : {false, true}) {
        std::vector<uint8_t> expected_q, q(rows * cols), qt(rows * cols);
        std::vector<float> expected_s, s(rb_count * kb_count), st(rb_count * kb_count);
        ref_128x128(x, rows, cols, fp8, power_of_two, expected_q, expected_s);
        quantize_128x128(x.data(), rows, cols, fp8, power_of_two, q.data(), s.data());
        EXPECT_EQ(q, expected_q) << rows << "x" << cols;
        EXPECT_EQ(s, expected_s) << rows << "x" << cols;

        quantize_128x128(x.data(), rows, cols, fp8, power_of_two, q.data(), s.data(), qt.data(), st.data());
        EXPECT_EQ(q, expected_q);
        int mismatches = 0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) mismatches += qt[c * rows + r] != q[r * cols + c];
        EXPECT_EQ(mismatches, 0) << rows << "x" << cols;
        for (int64_t rb = 0; rb < rb_count; ++rb)
          for (int64_t kb = 0; kb < kb_count; ++kb) EXPECT_EQ(st[kb * rb_count + rb], s[rb * kb_count + kb]);

        std::vector<float> y(rows * cols);
        dequantize_128x128(q.data(), rows, cols, s.data(), fp8, y.data());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            expect_same_float(y[r * cols + c],
                              ref_decode(q[r * cols + c], fp8) * s[(r / 128) * kb_count + c / 128],
                              "dequantize", r * cols + c);
      }
    }
  }
}

// Block scaling keeps every finite tile within half an FP8 ulp, whatever the tiles' ranges (a per-tensor
// scale would flush the small tiles of block_input to zero).
TEST(Fp8BlockQuantize, RoundTripWithinHalfUlpPerTile) {
  const int64_t rows = 260, cols = 300;
  std::vector<float> x = random_values(rows * cols, 9, 3.0f);
  for (int64_t i = 0; i < rows * cols; ++i)
    x[i] *= std::exp2(static_cast<float>((i / cols / 128 * 5 + i % cols / 128 * 9) % 40) - 20.0f);
  for (DType fp8 : kFormats) {
    const int mantissa_bits = fp8 == DType::e4m3 ? 3 : 2;
    const float half_subnormal_step = fp8 == DType::e4m3 ? 0x1p-10f : 0x1p-17f;
    std::vector<uint8_t> q(rows * cols);
    std::vector<float> s(rows * num_blocks(cols)), y(rows * cols);
    quantize_1x128(x.data(), rows, cols, fp8, true, q.data(), s.data());
    dequantize_1x128(q.data(), rows, cols, s.data(), fp8, y.data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = x[r * cols + c], scale_inv = s[r * num_blocks(cols) + c / 128];
        const float bound =
            std::max(std::ldexp(std::fabs(v), -(mantissa_bits + 1)), half_subnormal_step * scale_inv);
        ASSERT_LE(std::fabs(y[r * cols + c] - v), bound) << r << "," << c;
      }
  }
}

TEST(Fp8BlockQuantize, RejectsNonFp8Dtype) {
  float x[1] = {1.0f};
  uint8_t q[1];
  float s[1];
  EXPECT_THROW(quantize(x, 1, 1.0f, DType::bf16, q), Error);
  EXPECT_THROW(quantize_1x128(x, 1, 1, DType::f32, true, q, s), Error);
}

}  // namespace
}  // namespace forge::fp8::quantize_test
