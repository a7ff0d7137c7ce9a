// Loads and stores of one element type, for kernels templated on their tensors' dtype: F32 as it is, Bf16
// (its bits in uint16_t) widened on load and rounded to nearest even once on store (core/dtype.h).
#pragma once

#include <cstdint>

#include "forge/core/dtype.h"
#include "forge/core/element_ptr.h"

namespace forge::cpu {

struct F32 {
  using T = float;
  static float load(const T* p, int64_t j) { return p[j]; }
  static void store(T* p, int64_t j, float v) { p[j] = v; }
};

struct Bf16 {
  using T = uint16_t;
  static float load(const T* p, int64_t j) { return bf16_to_float(p[j]); }
  static void store(T* p, int64_t j, float v) { p[j] = float_to_bf16(v); }
};

// The same as overloads, for kernels templated on each tensor's pointer type separately.
inline float load_float(const float* p, int64_t j) { return p[j]; }
inline float load_float(const uint16_t* p, int64_t j) { return bf16_to_float(p[j]); }
inline void store_float(float* p, int64_t j, float v) { p[j] = v; }
inline void store_float(uint16_t* p, int64_t j, float v) { p[j] = float_to_bf16(v); }

}  // namespace forge::cpu
