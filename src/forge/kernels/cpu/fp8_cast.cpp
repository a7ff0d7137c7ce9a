// The CPU table's conversion and FP8 cast entries. The implementations are core/dtype.h's conversions and
// fp8/quantize.h's casts (the FP8 layer, its tests and benchmarks call those directly); these entries give
// the nn modules one device-independent way to reach them and the CUDA kernels' tests their reference.
#include <algorithm>
#include <cmath>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/fp8/quantize.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {

void convert_to_bf16(const float* x, uint16_t* y, int64_t n) { convert_f32_to_bf16(x, y, static_cast<size_t>(n)); }
void convert_to_f32(const uint16_t* x, float* y, int64_t n) { convert_bf16_to_f32(x, y, static_cast<size_t>(n)); }
float amax(const float* x, int64_t n) { return fp8::compute_amax(x, n); }

void amax_to(const float* x, int64_t n, float* out) {
  FORGE_CHECK(n >= 0 && out && (n == 0 || x), "amax_to: bad arguments (n = {}, x {}, out {})", n,
              x ? "set" : "null", out ? "set" : "null");
  *out = fp8::compute_amax(x, n);
}

namespace {
float cast_transpose_amax(const ops::Fp8CastParams& p) {
  if (p.q && p.q_t) return fp8::cast_transpose(p.x, p.rows, p.cols, p.scale, p.fp8, p.q, p.q_t);
  if (p.q) return fp8::quantize(p.x, p.rows * p.cols, p.scale, p.fp8, p.q);
  // Only the transposed copy: cast into a scratch row-wise buffer in the same pass.
  std::vector<uint8_t> scratch(static_cast<size_t>(p.rows * p.cols));
  return fp8::cast_transpose(p.x, p.rows, p.cols, p.scale, p.fp8, scratch.data(), p.q_t);
}
}  // namespace

float fp8_cast_transpose(const ops::Fp8CastParams& p) {
  FORGE_CHECK(p.q || p.q_t, "fp8_cast_transpose: neither output is given");
  ops::Fp8CastParams cast = p;
  if (p.amax_in) {  // current scaling: the scale from an amax in (here: host) memory, as the GPU computes it
    FORGE_CHECK(p.margin >= 0, "fp8_cast_transpose: negative margin {}", p.margin);
    cast.scale = fp8::compute_scale(*p.amax_in, fp8::fp8_max(p.fp8), p.margin, 1.0f);
  }
  const float amax = cast_transpose_amax(cast);
  if (float* acc = p.amax_accumulate) *acc = std::isnan(*acc) || std::isnan(amax) ? NAN : std::max(*acc, amax);
  if (p.scale_out) *p.scale_out = cast.scale;
  if (p.scale_inv_out) *p.scale_inv_out = 1.0f / cast.scale;
  return amax;
}

void fp8_quantize_1x128(const ops::Fp8CastParams& p) {
  FORGE_CHECK(p.q || p.q_t, "fp8_quantize_1x128: neither output is given");
  FORGE_CHECK((!p.q || p.scale_inv) && (!p.q_t || p.scale_inv_t), "fp8_quantize_1x128: an output lacks its scales");
  if (p.q && p.q_t)
    fp8::quantize_1x128_with_transpose(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q, p.scale_inv, p.q_t,
                                       p.scale_inv_t);
  else if (p.q)
    fp8::quantize_1x128(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q, p.scale_inv);
  else
    fp8::quantize_1x128_transposed(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q_t, p.scale_inv_t);
}

void fp8_quantize_128x128(const ops::Fp8CastParams& p) {
  FORGE_CHECK(p.q && p.scale_inv, "fp8_quantize_128x128: the row-wise output and its scales are required");
  FORGE_CHECK(!p.q_t || p.scale_inv_t, "fp8_quantize_128x128: the transposed output lacks its scales");
  fp8::quantize_128x128(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q, p.scale_inv, p.q_t, p.scale_inv_t);
}

}  // namespace forge::cpu
