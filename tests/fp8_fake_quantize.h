// What an FP8 GEMM sees of a matrix, in double, built from core's scalar FP8 conversions alone (independent
// of fp8/quantize.cpp): the tests' reference for every recipe's casts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "forge/core/dtype.h"

namespace forge::testing {

inline float fp8_round_trip(float x, DType dtype) {
  return dtype == DType::e4m3 ? e4m3_to_f32(f32_to_e4m3(x)) : e5m2_to_f32(f32_to_e5m2(x));
}
inline float fp8_max_of(DType dtype) { return dtype == DType::e4m3 ? 448.0f : 57344.0f; }

// m [rows, cols] with each tile_r x tile_c tile scaled by fp8_max / tile amax (or by `fixed_scale` when > 0),
// cast, and read back. pow2 rounds each tile's scale down to a power of two.
template <typename T>
std::vector<double> fake_quantize(const std::vector<T>& m, int64_t rows, int64_t cols, int64_t tile_r,
                                  int64_t tile_c, DType dtype, bool pow2, float fixed_scale = 0.0f) {
  std::vector<double> out(m.size());
  for (int64_t r0 = 0; r0 < rows; r0 += tile_r)
    for (int64_t c0 = 0; c0 < cols; c0 += tile_c) {
      const int64_t r1 = std::min(rows, r0 + tile_r), c1 = std::min(cols, c0 + tile_c);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          amax = std::max(amax, std::fabs(static_cast<float>(m[r * cols + c])));
      float scale = fixed_scale > 0 ? fixed_scale : (amax > 0 ? fp8_max_of(dtype) / amax : 1.0f);
      if (pow2 && fixed_scale <= 0) scale = std::exp2(std::floor(std::log2(scale)));
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          out[r * cols + c] =
              static_cast<double>(fp8_round_trip(static_cast<float>(m[r * cols + c]) * scale, dtype)) / scale;
    }
  return out;
}

}  // namespace forge::testing
