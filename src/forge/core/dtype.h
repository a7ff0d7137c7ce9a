// Element types and exact conversions. fp32 -> bf16/fp16/fp8 round to nearest, ties to even.
// FP8 follows the OCP 8-bit floating point spec: E4M3 (bias 7, max 448, no infinities, NaN = S.1111.111)
// and E5M2 (bias 15, max 57344, IEEE-like inf and NaN). Saturating conversion clamps finite values beyond
// the max to +-max (and +-inf to +-max); non-saturating conversion maps them to inf (E5M2) or NaN (E4M3).
// NaN always converts to NaN.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace forge {

enum class DType : uint8_t { f32, bf16, f16, e4m3, e5m2, i32, i64, u8 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
// Parses "fp32"/"float32"/"f32", "bf16"/"bfloat16", "fp16"/"float16", "fp8_e4m3"/"e4m3", "fp8_e5m2"/"e5m2",
// "int32", "int64", "uint8"; throws forge::Error naming the unknown string.
DType dtype_from_name(std::string_view name);

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

enum class Fp8Saturation : uint8_t { saturate, no_saturate };

// bf16 in kernels' inner loops (inline, branch-free, so they vectorise): widening is exact; narrowing rounds
// to nearest even, NaN staying a quiet NaN (f32_to_bf16_bits gives the same bits).
inline float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
inline uint16_t float_to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // overflow carries into inf
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Scalar conversions.
uint16_t f32_to_bf16_bits(float x);
float bf16_bits_to_f32(uint16_t bits);
uint16_t f32_to_f16_bits(float x);
float f16_bits_to_f32(uint16_t bits);
uint8_t f32_to_e4m3(float x, Fp8Saturation saturation = Fp8Saturation::saturate);
float e4m3_to_f32(uint8_t bits);
uint8_t f32_to_e5m2(float x, Fp8Saturation saturation = Fp8Saturation::saturate);
float e5m2_to_f32(uint8_t bits);

constexpr float kE4m3Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;

// Bulk conversions (OpenMP parallel and vectorised for large n).
void convert_f32_to_bf16(const float* src, uint16_t* dst, size_t n);
void convert_bf16_to_f32(const uint16_t* src, float* dst, size_t n);
void convert_f32_to_f16(const float* src, uint16_t* dst, size_t n);
void convert_f16_to_f32(const uint16_t* src, float* dst, size_t n);
void convert_f32_to_e4m3(const float* src, uint8_t* dst, size_t n, Fp8Saturation s = Fp8Saturation::saturate);
void convert_e4m3_to_f32(const uint8_t* src, float* dst, size_t n);
void convert_f32_to_e5m2(const float* src, uint8_t* dst, size_t n, Fp8Saturation s = Fp8Saturation::saturate);
void convert_e5m2_to_f32(const uint8_t* src, float* dst, size_t n);

}  // namespace forge
