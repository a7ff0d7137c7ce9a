// Exhaustive tests of the narrow float formats against an independent reference written here: a decoder
// from the bit fields in double, and an encoder that picks the nearest finite value from the sorted table
// of all decoded values (ties to the even code), so neither shares code with src/forge/core/dtype.cpp.
#include "forge/core/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "forge/core/error.h"

namespace forge::dtype_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Format {
  const char* name;
  int total_bits, exponent_bits, mantissa_bits, bias;
  bool ieee_specials;  // all-ones exponent is inf/NaN (bf16, fp16, E5M2); otherwise only S.1111.111 is NaN
  uint32_t (*encode)(float x, Fp8Saturation saturation);
  float (*decode)(uint32_t code);
};

uint32_t encode_bf16(float x, Fp8Saturation) { return f32_to_bf16_bits(x); }
float decode_bf16(uint32_t c) { return bf16_bits_to_f32(static_cast<uint16_t>(c)); }
uint32_t encode_f16(float x, Fp8Saturation) { return f32_to_f16_bits(x); }
float decode_f16(uint32_t c) { return f16_bits_to_f32(static_cast<uint16_t>(c)); }
uint32_t encode_e4m3(float x, Fp8Saturation s) { return f32_to_e4m3(x, s); }
float decode_e4m3(uint32_t c) { return e4m3_to_f32(static_cast<uint8_t>(c)); }
uint32_t encode_e5m2(float x, Fp8Saturation s) { return f32_to_e5m2(x, s); }
float decode_e5m2(uint32_t c) { return e5m2_to_f32(static_cast<uint8_t>(c)); }

const Format kBf16{"bf16", 16, 8, 7, 127, true, encode_bf16, decode_bf16};
const Format kF16{"fp16", 16, 5, 10, 15, true, encode_f16, decode_f16};
const Format kE4m3{"e4m3", 8, 4, 3, 7, false, encode_e4m3, decode_e4m3};
const Format kE5m2{"e5m2", 8, 5, 2, 15, true, encode_e5m2, decode_e5m2};

bool is_fp8(const Format& f) { return f.total_bits == 8; }
uint32_t sign_bit(const Format& f) { return 1u << (f.total_bits - 1); }

// Independent decoder: value from the sign, exponent and mantissa fields, in double.
double reference_decode(const Format& f, uint32_t code) {
  const bool negative = code & sign_bit(f);
  const uint32_t exponent = (code >> f.mantissa_bits) & ((1u << f.exponent_bits) - 1);
  const uint32_t mantissa = code & ((1u << f.mantissa_bits) - 1);
  const uint32_t exponent_all_ones = (1u << f.exponent_bits) - 1;
  double value;
  if (f.ieee_specials && exponent == exponent_all_ones) {
    value =
        mantissa == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (!f.ieee_specials && exponent == exponent_all_ones && mantissa == (1u << f.mantissa_bits) - 1) {
    value = std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<double>(mantissa), 1 - f.bias - f.mantissa_bits);
  } else {
    value = std::ldexp(1.0 + std::ldexp(static_cast<double>(mantissa), -f.mantissa_bits),
                       static_cast<int>(exponent) - f.bias);
  }
  return negative ? -value : value;
}

// Largest finite positive code: below inf for IEEE formats, below the NaN code for E4M3.
uint32_t max_code(const Format& f) {
  return f.ieee_specials ? (((1u << f.exponent_bits) - 1) << f.mantissa_bits) - 1 : sign_bit(f) - 2;
}

// All finite non-negative values, indexed by code (codes 0..max_code are increasing).
std::vector<double> finite_table(const Format& f) {
  std::vector<double> t(max_code(f) + 1);
  for (uint32_t c = 0; c <= max_code(f); ++c) t[c] = reference_decode(f, c);
  return t;
}

// Code of the value that overflow produces: +-max when saturating; inf (IEEE) or NaN (E4M3) otherwise.
// bf16 and fp16 have no saturating mode: they overflow to inf like IEEE.
uint32_t overflow_code(const Format& f, Fp8Saturation s) {
  if (s == Fp8Saturation::saturate && is_fp8(f)) return max_code(f);
  return max_code(f) + 1;
}

// Independent encoder: nearest entry of the table, ties to the even code. Returns the expected code, or
// kAnyNaN where any NaN code is right.
constexpr uint32_t kAnyNaN = ~0u;
uint32_t reference_encode(const Format& f, const std::vector<double>& table, float x, Fp8Saturation s) {
  if (std::isnan(x)) return kAnyNaN;
  const uint32_t sign = std::signbit(x) ? sign_bit(f) : 0;
  const double a = std::abs(static_cast<double>(x));
  const uint32_t top = max_code(f);
  const double boundary = table[top] + (table[top] - table[top - 1]) / 2;  // max + half an ulp
  if (std::isinf(a) || a > boundary || (a == boundary && (top & 1))) {
    const uint32_t code = overflow_code(f, s);
    return (code == top + 1 && !f.ieee_specials) ? kAnyNaN : (sign | code);
  }
  if (a >= table[top]) return sign | top;
  const auto upper = std::upper_bound(table.begin(), table.end(), a);  // first value > a
  const uint32_t high = static_cast<uint32_t>(upper - table.begin());
  const uint32_t low = high - 1;  // table[low] <= a < table[high]
  const double below = a - table[low], above = table[high] - a;
  uint32_t code = below < above ? low : (above < below ? high : ((low & 1) ? high : low));
  return sign | code;
}

const Format* const kFormats[] = {&kBf16, &kF16, &kE4m3, &kE5m2};
constexpr Fp8Saturation kModes[] = {Fp8Saturation::saturate, Fp8Saturation::no_saturate};

const char* mode_name(Fp8Saturation s) { return s == Fp8Saturation::saturate ? "saturate" : "no_saturate"; }

void expect_encodes(const Format& f, float x, Fp8Saturation s, uint32_t want) {
  const uint32_t got = f.encode(x, s);
  if (want == kAnyNaN) {
    EXPECT_TRUE(std::isnan(f.decode(got)))
        << f.name << " " << mode_name(s) << " x=" << x << " got 0x" << std::hex << got;
  } else {
    EXPECT_EQ(got, want) << f.name << " " << mode_name(s) << " x=" << std::hexfloat << x << " ("
                         << std::bit_cast<uint32_t>(x) << ")";
  }
}

TEST(DType, NamesAndSizes) {
  const DType all[] = {DType::f32,  DType::bf16, DType::f16, DType::e4m3,
                       DType::e5m2, DType::i32,  DType::i64, DType::u8};
  const char* names[] = {"fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int32", "int64", "uint8"};
  const size_t sizes[] = {4, 2, 2, 1, 1, 4, 8, 1};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(dtype_name(all[i]), names[i]);
    EXPECT_EQ(dtype_from_name(names[i]), all[i]);
    EXPECT_EQ(dtype_size(all[i]), sizes[i]);
  }
  EXPECT_EQ(dtype_from_name("float32"), DType::f32);
  EXPECT_EQ(dtype_from_name("f32"), DType::f32);
  EXPECT_EQ(dtype_from_name("bfloat16"), DType::bf16);
  EXPECT_EQ(dtype_from_name("float16"), DType::f16);
  EXPECT_EQ(dtype_from_name("e4m3"), DType::e4m3);
  EXPECT_EQ(dtype_from_name("e5m2"), DType::e5m2);
}

TEST(DType, UnknownNameThrowsNamingIt) {
  for (const char* bad : {"fp64", "", "FP32", "bf16 "}) {
    try {
      dtype_from_name(bad);
      ADD_FAILURE() << "no throw for '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + std::string(bad) + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(DType, EveryCodeDecodesToItsBitFieldValue) {
  for (const Format* f : kFormats) {
    for (uint32_t code = 0; code < (1u << f->total_bits); ++code) {
      const double want = reference_decode(*f, code);
      const float got = f->decode(code);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << f->name << " code 0x" << std::hex << code;
      } else {
        EXPECT_EQ(static_cast<double>(got), want) << f->name << " code 0x" << std::hex << code;
        EXPECT_EQ(std::signbit(got), std::signbit(want)) << f->name << " code 0x" << std::hex << code;
      }
    }
  }
  // Anchors from the OCP FP8 spec.
  EXPECT_EQ(e4m3_to_f32(0x7e), kE4m3Max);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)) && std::isnan(e4m3_to_f32(0xff)));
  EXPECT_EQ(e5m2_to_f32(0x7b), kE5m2Max);
  EXPECT_EQ(e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(e5m2_to_f32(0x7c), kInf);
  EXPECT_EQ(e5m2_to_f32(0xfc), -kInf);
}

TEST(DType, EveryCodeRoundTrips) {
  for (const Format* f : kFormats) {
    for (Fp8Saturation s : kModes) {
      for (uint32_t code = 0; code < (1u << f->total_bits); ++code) {
        const float x = f->decode(code);
        if (std::isnan(x)) {
          expect_encodes(*f, x, s, kAnyNaN);
        } else if (std::isinf(x) && s == Fp8Saturation::saturate && is_fp8(*f)) {
          expect_encodes(*f, x, s, (code & sign_bit(*f)) | max_code(*f));  // saturation clamps inf
        } else {
          expect_encodes(*f, x, s, code);
        }
      }
    }
  }
}

// For every pair of adjacent finite codes of either sign: the midpoint rounds to the even code and the
// floats just inside it round to the nearer code.
TEST(DType, MidpointsRoundToEvenExhaustive) {
  for (const Format* f : kFormats) {
    const std::vector<double> table = finite_table(*f);
    for (Fp8Saturation s : kModes) {
      for (uint32_t low = 0; low < max_code(*f); ++low) {
        const uint32_t high = low + 1;
        const double mid = (table[low] + table[high]) / 2;
        const float mid_f = static_cast<float>(mid);
        ASSERT_EQ(static_cast<double>(mid_f), mid) << "midpoint not exact in fp32";
        const uint32_t even = (low & 1) ? high : low;
        for (uint32_t sign : {0u, sign_bit(*f)}) {
          const float m = sign ? -mid_f : mid_f;
          expect_encodes(*f, m, s, sign | even);
          expect_encodes(*f, std::nextafter(m, 0.0f), s, sign | low);
          expect_encodes(*f, std::nextafter(m, sign ? -kInf : kInf), s, sign | high);
          EXPECT_EQ(reference_encode(*f, table, m, s), sign | even);
        }
      }
    }
  }
}

TEST(DType, OverflowBoundaryInfAndNaN) {
  const auto sat = Fp8Saturation::saturate;
  const auto nosat = Fp8Saturation::no_saturate;
  // E4M3: max 448 (0x7e, even mantissa), so the tie at 448 + 16 = 464 stays finite; anything above is NaN
  // without saturation.
  EXPECT_EQ(f32_to_e4m3(464.0f, nosat), 0x7e);
  EXPECT_EQ(f32_to_e4m3(std::nextafter(464.0f, kInf), nosat), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-std::nextafter(464.0f, kInf), nosat), 0xff);
  EXPECT_EQ(f32_to_e4m3(std::nextafter(464.0f, kInf), sat), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-1e30f, sat), 0xfe);
  EXPECT_EQ(f32_to_e4m3(kInf, sat), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-kInf, sat), 0xfe);
  EXPECT_EQ(f32_to_e4m3(kInf, nosat) & 0x7f, 0x7f);
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::max(), nosat), 0x7f);
  // E5M2: max 57344 (0x7b, odd mantissa), so the tie at 61440 goes up to inf without saturation.
  EXPECT_EQ(f32_to_e5m2(61440.0f, nosat), 0x7c);
  EXPECT_EQ(f32_to_e5m2(std::nextafter(61440.0f, 0.0f), nosat), 0x7b);
  EXPECT_EQ(f32_to_e5m2(-61440.0f, nosat), 0xfc);
  EXPECT_EQ(f32_to_e5m2(61440.0f, sat), 0x7b);
  EXPECT_EQ(f32_to_e5m2(kInf, sat), 0x7b);
  EXPECT_EQ(f32_to_e5m2(-kInf, sat), 0xfb);
  EXPECT_EQ(f32_to_e5m2(kInf, nosat), 0x7c);
  EXPECT_EQ(f32_to_e5m2(-kInf, nosat), 0xfc);
  // fp16 and bf16 overflow to inf (IEEE).
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16_bits(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(-kInf), 0xfc00);
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x7f7f8000u)), 0x7f80);  // bf16 max + half ulp: tie, odd
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(f32_to_bf16_bits(kInf), 0x7f80);
}

TEST(DType, NaNStaysQuietNaN) {
  const float nans[] = {kNaN, -kNaN, std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xff800001u),
                        std::bit_cast<float>(0x7fbfffffu)};
  for (float x : nans) {
    const uint32_t sign = std::signbit(x) ? 1 : 0;
    for (Fp8Saturation s : kModes) {
      EXPECT_EQ(f32_to_e4m3(x, s), 0x7f | (sign << 7));
      EXPECT_EQ(f32_to_e5m2(x, s), 0x7e | (sign << 7));  // exponent all ones, quiet (top mantissa) bit set
    }
    const uint16_t h = f32_to_f16_bits(x);
    EXPECT_EQ(h & 0x7e00, 0x7e00) << std::hex << h;
    EXPECT_EQ(h >> 15, sign);
    const uint16_t b = f32_to_bf16_bits(x);
    EXPECT_EQ(b & 0x7fc0, 0x7fc0) << std::hex << b;
    EXPECT_EQ(b >> 15, sign);
  }
}

TEST(DType, SignedZeroAndSubnormals) {
  for (Fp8Saturation s : kModes) {
    EXPECT_EQ(f32_to_e4m3(-0.0f, s), 0x80);
    EXPECT_EQ(f32_to_e5m2(-0.0f, s), 0x80);
    // Smallest subnormal 2^-9 (E4M3) and 2^-16 (E5M2); half of it is a tie with zero, which is even.
    EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -9), s), 0x01);
    EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10), s), 0x00);
    EXPECT_EQ(f32_to_e4m3(-std::ldexp(1.0f, -10), s), 0x80);
    EXPECT_EQ(f32_to_e4m3(std::ldexp(1.5f, -10), s), 0x01);
    EXPECT_EQ(f32_to_e4m3(std::ldexp(3.0f, -10), s), 0x02);  // 1.5 ulp: tie between 1 and 2 -> 2
    EXPECT_EQ(f32_to_e4m3(std::ldexp(7.5f, -9), s), 0x08);   // largest subnormal 7 + half -> min normal
    EXPECT_EQ(f32_to_e5m2(std::ldexp(1.0f, -17), s), 0x00);
    EXPECT_EQ(f32_to_e5m2(std::ldexp(1.25f, -17), s), 0x01);
    // fp32 subnormals are far below every target's smallest subnormal except bf16's.
    EXPECT_EQ(f32_to_e4m3(-std::numeric_limits<float>::denorm_min(), s), 0x80);
  }
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -25) * 1.5f), 0x0001);
  EXPECT_EQ(f32_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x00018000u)), 0x0002);  // subnormal tie, odd -> up
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x00008000u)), 0x0000);  // subnormal tie, even -> down
}

// Random fp32 bit patterns (every exponent) and values spread log-uniformly over each format's range,
// against the reference encoder.
TEST(DType, RandomInputsMatchReferenceEncoder) {
  std::mt19937 gen(20240611);
  for (const Format* f : kFormats) {
    const std::vector<double> table = finite_table(*f);
    const double smallest = table[1], largest = table.back();
    std::uniform_real_distribution<double> log_magnitude(std::log2(smallest) - 2, std::log2(largest) + 1);
    for (int i = 0; i < 100000; ++i) {
      float x = std::bit_cast<float>(static_cast<uint32_t>(gen()));
      if (i & 1) x = static_cast<float>(std::exp2(log_magnitude(gen))) * ((gen() & 1) ? -1.0f : 1.0f);
      for (Fp8Saturation s : kModes) expect_encodes(*f, x, s, reference_encode(*f, table, x, s));
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Every E4M3 and E5M2 value is exact in bf16 (the CPU emulation of FP8 GEMMs relies on it).
TEST(DType, Fp8ValuesAreExactInBf16) {
  for (uint32_t code = 0; code < 256; ++code) {
    for (float x : {e4m3_to_f32(code), e5m2_to_f32(code)}) {
      if (std::isnan(x)) continue;
      EXPECT_EQ(bf16_bits_to_f32(f32_to_bf16_bits(x)), x) << "code " << code;
    }
  }
}

// Inputs for the bulk tests: specials, every midpoint neighbourhood of small formats, random patterns.
std::vector<float> bulk_inputs() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          kInf,
                          -kInf,
                          kNaN,
                          -kNaN,
                          std::bit_cast<float>(0x7f800001u),
                          448.0f,
                          464.0f,
                          61440.0f,
                          65520.0f,
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min()};
  for (uint32_t c = 0; c < 256; ++c) {
    for (float x : {e4m3_to_f32(c), e5m2_to_f32(c)}) {
      v.push_back(x);
      v.push_back(std::nextafter(x, kInf));
      v.push_back(std::nextafter(x, -kInf));
    }
  }
  for (uint32_t c = 0; c < 65536; c += 7) {
    v.push_back(bf16_bits_to_f32(c) * 1.00390625f);  // a quarter-ulp offset of bf16: probes rounding
    v.push_back(f16_bits_to_f32(c));
    v.push_back(std::bit_cast<float>((uint32_t{c} << 16) | 0x8000u));  // exact bf16 midpoints
    if ((c & 0x7fff) < 0x7bff) {  // fp16 midpoints and their neighbours: the hardware path must tie to even
      const float mid = (f16_bits_to_f32(c) + f16_bits_to_f32(c + 1)) / 2;
      v.insert(v.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, mid * 2)});
    }
  }
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  while (v.size() < 200003) {
    v.push_back(std::bit_cast<float>(static_cast<uint32_t>(gen())));
    v.push_back(normal(gen));
  }
  return v;  // odd length: exercises vector tails
}

template <typename T>
void expect_same_bits(const std::vector<T>& bulk, const std::vector<T>& scalar, const char* what) {
  ASSERT_EQ(bulk.size(), scalar.size());
  for (size_t i = 0; i < bulk.size(); ++i) {
    if (std::memcmp(&bulk[i], &scalar[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": bulk differs from scalar at " << i;
      return;
    }
  }
}

TEST(DType, BulkEncodeEqualsScalarBitwise) {
  const std::vector<float> in = bulk_inputs();
  const size_t n = in.size();
  std::vector<uint16_t> bulk16(n), scalar16(n);
  convert_f32_to_bf16(in.data(), bulk16.data(), n);
  for (size_t i = 0; i < n; ++i) scalar16[i] = f32_to_bf16_bits(in[i]);
  expect_same_bits(bulk16, scalar16, "f32->bf16");
  convert_f32_to_f16(in.data(), bulk16.data(), n);
  for (size_t i = 0; i < n; ++i) scalar16[i] = f32_to_f16_bits(in[i]);
  expect_same_bits(bulk16, scalar16, "f32->f16");
  std::vector<uint8_t> bulk8(n), scalar8(n);
  for (Fp8Saturation s : kModes) {
    convert_f32_to_e4m3(in.data(), bulk8.data(), n, s);
    for (size_t i = 0; i < n; ++i) scalar8[i] = f32_to_e4m3(in[i], s);
    expect_same_bits(bulk8, scalar8, "f32->e4m3");
    convert_f32_to_e5m2(in.data(), bulk8.data(), n, s);
    for (size_t i = 0; i < n; ++i) scalar8[i] = f32_to_e5m2(in[i], s);
    expect_same_bits(bulk8, scalar8, "f32->e5m2");
  }
}

TEST(DType, BulkDecodeEqualsScalarBitwise) {
  const size_t n = 3 * 65536 + 5;  // every 16-bit code three times, then a tail
  std::vector<uint16_t> codes16(n);
  for (size_t i = 0; i < n; ++i) codes16[i] = static_cast<uint16_t>(i * 40503u);
  std::vector<float> bulk(n), scalar(n);
  convert_bf16_to_f32(codes16.data(), bulk.data(), n);
  for (size_t i = 0; i < n; ++i) scalar[i] = bf16_bits_to_f32(codes16[i]);
  expect_same_bits(bulk, scalar, "bf16->f32");
  convert_f16_to_f32(codes16.data(), bulk.data(), n);
  for (size_t i = 0; i < n; ++i) scalar[i] = f16_bits_to_f32(codes16[i]);
  expect_same_bits(bulk, scalar, "f16->f32");
  std::vector<uint8_t> codes8(n);
  for (size_t i = 0; i < n; ++i) codes8[i] = static_cast<uint8_t>(i * 37u);
  convert_e4m3_to_f32(codes8.data(), bulk.data(), n);
  for (size_t i = 0; i < n; ++i) scalar[i] = e4m3_to_f32(codes8[i]);
  expect_same_bits(bulk, scalar, "e4m3->f32");
  convert_e5m2_to_f32(codes8.data(), bulk.data(), n);
  for (size_t i = 0; i < n; ++i) scalar[i] = e5m2_to_f32(codes8[i]);
  expect_same_bits(bulk, scalar, "e5m2->f32");
}

}  // namespace
}  // namespace forge::dtype_test
