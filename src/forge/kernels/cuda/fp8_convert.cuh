// Device-side fp32 -> FP8 (E4M3 / E5M2) conversion and block-scale arithmetic, bitwise the CPU's
// (core/dtype.cpp's encode_e4m3 / encode_e5m2 with saturation, fp8/scaling.cpp's compute_scale).
//
// Why not cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 (sm_89+): its NaN result code and sign are not specified
// precisely enough to promise the CPU's codes, and nothing here could be run to check it. The conversion is
// written instead as the same integer recipe as round_magnitude() in core/dtype.cpp, in the same order.
//
// Arithmetic that must round exactly as the CPU does is inline PTX without .ftz: mul.rn / add.rn / div.rn are
// IEEE single precision with subnormals, never contracted into an FMA, and unaffected by -use_fast_math or
// -ftz=true should those flags ever reach this file.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace forge::cuda::detail {

constexpr uint32_t kFloatAbsMask = 0x7fffffffu;
constexpr uint32_t kFloatInfBits = 0x7f800000u;
// std::numeric_limits<float>::quiet_NaN(): the NaN the CPU writes for a NaN amax (fp8/quantize.cpp).
constexpr uint32_t kQuietNanBits = 0x7fc00000u;

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The constants of one FP8 format, filled on the host (fp8_encoding()), so that one kernel serves both
// formats with the same instruction count as a specialised one (shift amounts and bounds come from
// registers).
struct Fp8Encoding {
  uint32_t shift;             // 23 - mantissa bits
  uint32_t rebias;            // (127 - bias) << 23
  uint32_t round_half;        // (1 << (shift - 1)) - 1: round-half-up bias; + odd makes it ties-to-even
  uint32_t min_normal_bits;   // fp32 bits of the format's smallest normal
  uint32_t magic_bits;        // fp32 power of two whose ulp is the format's subnormal step
  uint32_t max_code;          // largest finite code (saturation)
  uint32_t nan_code;          // the CPU's NaN code (without sign)
  uint32_t default_nan_sign;  // 0x80 when the host's default NaN (inf * 0) is negative (x86), else 0
  float max;                  // largest finite value (block scales map a tile's amax onto it)
};

constexpr Fp8Encoding make_fp8_encoding(int mantissa_bits, int bias, uint32_t max_code, uint32_t nan_code,
                                        float max, uint32_t default_nan_sign) {
  const uint32_t shift = static_cast<uint32_t>(23 - mantissa_bits);
  return {shift,
          static_cast<uint32_t>(127 - bias) << 23,
          (1u << (shift - 1)) - 1u,
          static_cast<uint32_t>(127 - bias + 1) << 23,
          static_cast<uint32_t>(127 - bias + static_cast<int>(shift) + 1) << 23,
          max_code,
          nan_code,
          default_nan_sign,
          max};
}

// E4M3: bias 7, max 448 (0x7e), NaN 0x7f, no inf. E5M2: bias 15, max 57344 (0x7b), NaN 0x7e as the CPU
// writes it.
constexpr Fp8Encoding e4m3_encoding(uint32_t default_nan_sign) {
  return make_fp8_encoding(3, 7, 0x7eu, 0x7fu, 448.0f, default_nan_sign);
}
constexpr Fp8Encoding e5m2_encoding(uint32_t default_nan_sign) {
  return make_fp8_encoding(2, 15, 0x7bu, 0x7eu, 57344.0f, default_nan_sign);
}

// The FP8 magnitude code of a finite non-negative fp32 (its bits), round to nearest even, before saturation;
// core/dtype.cpp's round_magnitude() step for step. Garbage for inf and NaN (the caller overrides those).
__device__ __forceinline__ uint32_t round_magnitude(uint32_t abs_bits, const Fp8Encoding& e) {
  // Below the smallest normal the FPU rounds for us: adding the magic power of two leaves the subnormal code
  // (or the carry into the smallest normal) in the low bits of the sum.
  const uint32_t subnormal =
      __float_as_uint(add_rn(__uint_as_float(abs_bits), __uint_as_float(e.magic_bits))) - e.magic_bits;
  const uint32_t odd = (abs_bits >> e.shift) & 1u;
  const uint32_t normal = (abs_bits - e.rebias + e.round_half + odd) >> e.shift;
  return abs_bits < e.min_normal_bits ? subnormal : normal;
}

// The sign of the NaN the host CPU produces for x * scale when the product is NaN: a NaN operand is returned
// quietened (x86 and Arm alike), otherwise (inf * 0) the default NaN. When both operands are NaN the CPU's
// choice depends on the operand order its compiler picked; x's sign is taken.
__device__ __noinline__ uint32_t nan_product_sign(float x, float scale, uint32_t default_nan_sign) {
  const uint32_t ux = __float_as_uint(x), us = __float_as_uint(scale);
  if ((ux & kFloatAbsMask) > kFloatInfBits) return (ux >> 24) & 0x80u;
  if ((us & kFloatAbsMask) > kFloatInfBits) return (us >> 24) & 0x80u;
  return default_nan_sign;
}

// fp8(x * scale), saturating: the CPU's f32_to_e4m3 / f32_to_e5m2 of its fp32 product x * scale, bit for bit.
// (The device's own NaN is the canonical 0x7fffffff whatever the operands; only the NaN's sign reaches the
// code, and it is recomputed from the operands as the CPU would have produced it.)
__device__ __forceinline__ uint32_t encode_product(float x, float scale, const Fp8Encoding& e) {
  const uint32_t u = __float_as_uint(mul_rn(x, scale));
  const uint32_t abs_bits = u & kFloatAbsMask;
  uint32_t code = min(round_magnitude(abs_bits, e), e.max_code);  // saturate (inf included)
  uint32_t sign = (u >> 24) & 0x80u;
  if (abs_bits > kFloatInfBits) {
    code = e.nan_code;
    sign = nan_product_sign(x, scale, e.default_nan_sign);
  }
  return sign | code;
}

// |x| as bits: for non-negative floats the integer order is the numeric order and every NaN is above inf, so
// the integer max of these is the amax with NaN propagation (fp8/quantize.cpp keeps amaxes the same way).
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & kFloatAbsMask; }

// 2^floor(log2 x) for a finite positive x, subnormals included (fp8/scaling.cpp's
// round_down_to_power_of_two).
__device__ __forceinline__ float round_down_to_power_of_two(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t exponent = bits & kFloatInfBits;
  return __uint_as_float(exponent != 0u ? exponent : 1u << (31 - __clz(bits)));
}

// A scale from an amax's bits: fp8/scaling.cpp's compute_scale(amax, fp8_max, margin, previous 1,
// power_of_two) with scaled_max = ldexp(fp8_max, -margin), which the host computes exactly as compute_scale
// does (block scales: margin 0, scaled_max = fp8_max). scaled_max / amax, FLT_MAX when the quotient
// overflows, 1 for an amax of 0, inf or NaN. The bits are taken as they are: a value with the sign bit set
// (-0, a negative, a negative NaN) compares above inf's bits and gives 1, as !(amax > 0) does on the host.
__device__ __forceinline__ float scale_from_amax_bits(uint32_t amax_bits, float scaled_max,
                                                      bool power_of_two) {
  if (amax_bits == 0u || amax_bits >= kFloatInfBits) return 1.0f;
  float scale = div_rn(scaled_max, __uint_as_float(amax_bits));
  if (__float_as_uint(scale) == kFloatInfBits) scale = FLT_MAX;
  return power_of_two ? round_down_to_power_of_two(scale) : scale;
}

// scale_inv as the CPU stores it: 1.0f / scale (exact for powers of two; subnormal for FLT_MAX).
__device__ __forceinline__ float inverse(float scale) { return div_rn(1.0f, scale); }

}  // namespace forge::cuda::detail
