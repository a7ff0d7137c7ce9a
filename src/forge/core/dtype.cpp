// Element types and exact conversions (see dtype.h for the contract).
//
// Every fp32 -> narrow conversion goes through one branch-free encoder per format, used by both the scalar
// entry points and the bulk loops, so the bulk results are bit-identical to the scalar ones by construction
// (the AVX-512 paths are checked against the scalar ones in tests/core/dtype_test.cpp).
#include "forge/core/dtype.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "forge/core/error.h"

#if defined(__AVX512F__) || defined(__F16C__)
// GCC 12's AVX-512 headers trip a false -Wmaybe-uninitialized (_mm512_undefined_epi32 initialises itself).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

namespace forge {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::e4m3:
    case DType::e5m2:
    case DType::u8:
      return 1;
    case DType::i64:
      return 8;
  }
  fail("dtype_size: invalid dtype code {}", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "fp32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "fp16";
    case DType::e4m3:
      return "fp8_e4m3";
    case DType::e5m2:
      return "fp8_e5m2";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::u8:
      return "uint8";
  }
  fail("dtype_name: invalid dtype code {}", static_cast<int>(dtype));
}

DType dtype_from_name(std::string_view name) {
  struct Alias {
    std::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"fp32", DType::f32},      {"float32", DType::f32},   {"f32", DType::f32},
      {"bf16", DType::bf16},     {"bfloat16", DType::bf16}, {"fp16", DType::f16},
      {"float16", DType::f16},   {"fp8_e4m3", DType::e4m3}, {"e4m3", DType::e4m3},
      {"fp8_e5m2", DType::e5m2}, {"e5m2", DType::e5m2},     {"int32", DType::i32},
      {"int64", DType::i64},     {"uint8", DType::u8},
  };
  for (const Alias& alias : kAliases)
    if (alias.name == name) return alias.dtype;
  fail("unknown dtype '{}' (expected one of fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int32, int64, uint8)",
       name);
}

namespace {

inline uint32_t float_bits(float x) { return std::bit_cast<uint32_t>(x); }
inline float bits_float(uint32_t u) { return std::bit_cast<float>(u); }

// Rounds a finite, non-negative fp32 (given by its bits) to the code of a narrow IEEE-like format with
// kMantissaBits mantissa bits and exponent bias kBias, ties to even, as if the exponent range were unbounded
// above (the caller detects overflow by comparing with the largest finite code). Branch-free so that the
// bulk loops vectorise.
template <int kMantissaBits, int kBias>
inline uint32_t round_magnitude(uint32_t abs_bits) {
  constexpr int kShift = 23 - kMantissaBits;
  constexpr uint32_t kMinNormalBits = uint32_t(127 - kBias + 1) << 23;
  // Below the target's smallest normal the grid is uniform with step 2^(1-bias-mantissa). Adding a power of
  // two whose fp32 ulp is that step makes the FPU round to nearest even for us; the difference of the bit
  // patterns is then the subnormal code (a carry into the smallest normal code comes out right too).
  constexpr uint32_t kSubnormalMagicBits = uint32_t(127 - kBias + kShift + 1) << 23;
  const uint32_t subnormal =
      float_bits(bits_float(abs_bits) + bits_float(kSubnormalMagicBits)) - kSubnormalMagicBits;
  // Normal range: rebias the exponent, then round the dropped mantissa bits to nearest even. A carry out of
  // the mantissa correctly increments the exponent field.
  const uint32_t odd = (abs_bits >> kShift) & 1u;
  const uint32_t normal =
      (abs_bits - (uint32_t(127 - kBias) << 23) + ((1u << (kShift - 1)) - 1u) + odd) >> kShift;
  return abs_bits < kMinNormalBits ? subnormal : normal;
}

// bf16 has fp32's exponent, so rounding is a plain add-and-truncate (dtype.h).
inline uint16_t encode_bf16(float x) { return float_to_bf16(x); }

inline uint16_t encode_f16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs_bits = u & 0x7fffffffu;
  uint32_t code = round_magnitude<10, 15>(abs_bits);
  code = code > 0x7bffu ? 0x7c00u : code;  // IEEE overflow: inf
  // NaN keeps the top payload bits and is made quiet, as the F16C instructions do.
  const uint32_t nan = 0x7e00u | ((abs_bits >> 13) & 0x3ffu);
  code = abs_bits > 0x7f800000u ? nan : code;
  return static_cast<uint16_t>(sign | code);
}

inline uint8_t encode_e4m3(float x, bool saturate) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs_bits = u & 0x7fffffffu;
  uint32_t code = round_magnitude<3, 7>(abs_bits);
  // 0x7e is 448; E4M3 has no inf, so non-saturating overflow (and inf) becomes NaN (0x7f).
  code = code > 0x7eu ? (saturate ? 0x7eu : 0x7fu) : code;
  code = abs_bits > 0x7f800000u ? 0x7fu : code;
  return static_cast<uint8_t>(sign | code);
}

inline uint8_t encode_e5m2(float x, bool saturate) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs_bits = u & 0x7fffffffu;
  uint32_t code = round_magnitude<2, 15>(abs_bits);
  // 0x7b is 57344, 0x7c is inf, 0x7e the quiet NaN.
  code = code > 0x7bu ? (saturate ? 0x7bu : 0x7cu) : code;
  code = abs_bits > 0x7f800000u ? 0x7eu : code;
  return static_cast<uint8_t>(sign | code);
}

inline float decode_f16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  // Subnormals (and zero): mantissa * 2^-24 is exact in fp32.
  const uint32_t subnormal = float_bits(static_cast<float>(mantissa) * 0x1p-24f);
  // inf stays inf; NaN keeps its payload and is made quiet, as the F16C instructions do.
  const uint32_t special = 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u);
  const uint32_t magnitude = exponent == 0 ? subnormal : (exponent == 31 ? special : normal);
  return bits_float(sign | magnitude);
}

// Decode tables for the two FP8 formats, built at compile time from the bit fields.
constexpr std::array<float, 256> make_fp8_table(int mantissa_bits, int bias, bool e4m3) {
  std::array<float, 256> table{};
  const int exponent_max = (1 << (7 - mantissa_bits)) - 1;
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> mantissa_bits) & exponent_max;
    const int mantissa = code & ((1 << mantissa_bits) - 1);
    const bool negative = code & 0x80;
    float value;
    if (e4m3 && exponent == exponent_max && mantissa == (1 << mantissa_bits) - 1) {
      value = std::bit_cast<float>(0x7fc00000u);
    } else if (!e4m3 && exponent == exponent_max) {
      value = std::bit_cast<float>(mantissa ? 0x7fc00000u : 0x7f800000u);
    } else if (exponent == 0) {
      // mantissa * 2^(1 - bias - mantissa_bits)
      value =
          static_cast<float>(mantissa) * std::bit_cast<float>(uint32_t(127 + 1 - bias - mantissa_bits) << 23);
    } else {
      value = std::bit_cast<float>((uint32_t(exponent - bias + 127) << 23) |
                                   (uint32_t(mantissa) << (23 - mantissa_bits)));
    }
    table[code] = negative ? -value : value;
  }
  return table;
}

constexpr std::array<float, 256> kE4m3Table = make_fp8_table(3, 7, true);
constexpr std::array<float, 256> kE5m2Table = make_fp8_table(2, 15, false);

// Runs block(begin, end) over [0, n) in fixed-size blocks, in parallel when n is large enough to pay for
// waking the OpenMP team.
template <typename Block>
void for_blocks(size_t n, Block&& block) {
  constexpr size_t kBlock = size_t{1} << 14;
  const int64_t blocks = static_cast<int64_t>((n + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(static) if (blocks >= 4)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t begin = static_cast<size_t>(b) * kBlock;
    block(begin, std::min(n, begin + kBlock));
  }
}

void f32_to_bf16_block(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
#ifdef __AVX512F__
  // Same integer recipe as encode_bf16, 16 lanes at a time. (VCVTNEPS2BF16 is not used: it flushes fp32
  // subnormals to zero, which would break bit-identity with the scalar path.)
  const __m512i round_bias = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet_bit = _mm512_set1_epi32(0x40);
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(src + i);
    const __m512i high = _mm512_srli_epi32(u, 16);
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, round_bias), _mm512_and_si512(high, one)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf_bits);
    const __m512i result = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, quiet_bit));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(result));
  }
#endif
  for (; i < n; ++i) dst[i] = encode_bf16(src[i]);
}

void bf16_to_f32_block(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_bits_to_f32(src[i]);
}

// The F16C / AVX-512F conversion instructions implement exactly encode_f16/decode_f16 (round to nearest
// even with subnormals, quiet NaN with payload), which the tests check over all inputs they try.
void f32_to_f16_block(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h =
        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = encode_f16(src[i]);
}

void f16_to_f32_block(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = decode_f16(src[i]);
}

// The FP8 loops live in their own functions with restrict-qualified pointers: a uint8_t store may alias
// anything, and without the qualifiers the compiler reloads src and the mode each iteration and does not
// vectorise.
template <bool kSaturate>
void f32_to_e4m3_block(const float* __restrict src, uint8_t* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = encode_e4m3(src[i], kSaturate);
}

template <bool kSaturate>
void f32_to_e5m2_block(const float* __restrict src, uint8_t* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = encode_e5m2(src[i], kSaturate);
}

void fp8_to_f32_block(const float* __restrict table, const uint8_t* __restrict src, float* __restrict dst,
                      size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = table[src[i]];
}

}  // namespace

uint16_t f32_to_bf16_bits(float x) { return encode_bf16(x); }
float bf16_bits_to_f32(uint16_t bits) { return bits_float(uint32_t(bits) << 16); }
uint16_t f32_to_f16_bits(float x) { return encode_f16(x); }
float f16_bits_to_f32(uint16_t bits) { return decode_f16(bits); }
uint8_t f32_to_e4m3(float x, Fp8Saturation saturation) {
  return encode_e4m3(x, saturation == Fp8Saturation::saturate);
}
float e4m3_to_f32(uint8_t bits) { return kE4m3Table[bits]; }
uint8_t f32_to_e5m2(float x, Fp8Saturation saturation) {
  return encode_e5m2(x, saturation == Fp8Saturation::saturate);
}
float e5m2_to_f32(uint8_t bits) { return kE5m2Table[bits]; }

void convert_f32_to_bf16(const float* src, uint16_t* dst, size_t n) {
  for_blocks(n, [&](size_t begin, size_t end) { f32_to_bf16_block(src + begin, dst + begin, end - begin); });
}

void convert_bf16_to_f32(const uint16_t* src, float* dst, size_t n) {
  for_blocks(n, [&](size_t begin, size_t end) { bf16_to_f32_block(src + begin, dst + begin, end - begin); });
}

void convert_f32_to_f16(const float* src, uint16_t* dst, size_t n) {
  for_blocks(n, [&](size_t begin, size_t end) { f32_to_f16_block(src + begin, dst + begin, end - begin); });
}

void convert_f16_to_f32(const uint16_t* src, float* dst, size_t n) {
  for_blocks(n, [&](size_t begin, size_t end) { f16_to_f32_block(src + begin, dst + begin, end - begin); });
}

void convert_f32_to_e4m3(const float* src, uint8_t* dst, size_t n, Fp8Saturation s) {
  const auto block = s == Fp8Saturation::saturate ? f32_to_e4m3_block<true> : f32_to_e4m3_block<false>;
  for_blocks(n, [&](size_t begin, size_t end) { block(src + begin, dst + begin, end - begin); });
}

void convert_e4m3_to_f32(const uint8_t* src, float* dst, size_t n) {
  for_blocks(n, [&](size_t begin, size_t end) {
    fp8_to_f32_block(kE4m3Table.data(), src + begin, dst + begin, end - begin);
  });
}

void convert_f32_to_e5m2(const float* src, uint8_t* dst, size_t n, Fp8Saturation s) {
  const auto block = s == Fp8Saturation::saturate ? f32_to_e5m2_block<true> : f32_to_e5m2_block<false>;
  for_blocks(n, [&](size_t begin, size_t end) { block(src + begin, dst + begin, end - begin); });
}

void convert_e5m2_to_f32(const uint8_t* src, float* dst, size_t n) {
  for_blocks(n, [&](size_t begin, size_t end) {
    fp8_to_f32_block(kE5m2Table.data(), src + begin, dst + begin, end - begin);
  });
}

}  // namespace forge
