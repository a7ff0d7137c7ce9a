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

bool supports_convert_to_bf16(const float*, uint16_t*, int64_t, std::string*) { return true; }
bool supports_convert_to_f32(const uint16_t*, float*, int64_t, std::string*) { return true; }
bool supports_amax(const float*, int64_t, std::string*) { return true; }
bool supports_amax_to(ConstElements x, int64_t n, float* out, std::string* reason) {
  if (n >= 0 && out && (n == 0 || x)) return true;
  return ops::refuse(reason, "amax_to: bad arguments (n = {}, x {}, out {})", n, x ? "set" : "null",
                     out ? "set" : "null");
}

bool supports_fp8_cast_transpose(const ops::Fp8CastParams& p, std::string* reason) {
  if (!p.q && !p.q_t) return ops::refuse(reason, "fp8_cast_transpose: neither output is given");
  if (p.amax_in && p.margin < 0)
    return ops::refuse(reason, "fp8_cast_transpose: negative margin {}", p.margin);
  return true;
}

bool supports_fp8_quantize_1x128(const ops::Fp8CastParams& p, std::string* reason) {
  if (!p.q && !p.q_t) return ops::refuse(reason, "fp8_quantize_1x128: neither output is given");
  if ((p.q && !p.scale_inv) || (p.q_t && !p.scale_inv_t))
    return ops::refuse(reason, "fp8_quantize_1x128: an output lacks its scales");
  return true;
}

bool supports_fp8_quantize_128x128(const ops::Fp8CastParams& p, std::string* reason) {
  if (!p.q || !p.scale_inv)
    return ops::refuse(reason, "fp8_quantize_128x128: the row-wise output and its scales are required");
  if (p.q_t && !p.scale_inv_t)
    return ops::refuse(reason, "fp8_quantize_128x128: the transposed output lacks its scales");
  return true;
}

void convert_to_bf16(const float* x, uint16_t* y, int64_t n) {
  convert_f32_to_bf16(x, y, static_cast<size_t>(n));
}
void convert_to_f32(const uint16_t* x, float* y, int64_t n) {
  convert_bf16_to_f32(x, y, static_cast<size_t>(n));
}
float amax(const float* x, int64_t n) { return fp8::compute_amax(x, n); }

void amax_to(ConstElements x, int64_t n, float* out) {
  if (std::string why; !supports_amax_to(x, n, out, &why)) fail("{}", why);
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
  if (std::string why; !supports_fp8_cast_transpose(p, &why)) fail("{}", why);
  ops::Fp8CastParams cast = p;
  if (p.amax_in) {  // current scaling: the scale from an amax in (here: host) memory, as the GPU computes it
    cast.scale = fp8::compute_scale(*p.amax_in, fp8::fp8_max(p.fp8), p.margin, 1.0f);
  }
  const float amax = cast_transpose_amax(cast);
  if (float* acc = p.amax_accumulate)
    *acc = std::isnan(*acc) || std::isnan(amax) ? NAN : std::max(*acc, amax);
  if (p.scale_out) *p.scale_out = cast.scale;
  if (p.scale_inv_out) *p.scale_inv_out = 1.0f / cast.scale;
  return amax;
}

void fp8_quantize_1x128(const ops::Fp8CastParams& p) {
  if (std::string why; !supports_fp8_quantize_1x128(p, &why)) fail("{}", why);
  if (p.q && p.q_t)
    fp8::quantize_1x128_with_transpose(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q, p.scale_inv,
                                       p.q_t, p.scale_inv_t);
  else if (p.q)
    fp8::quantize_1x128(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q, p.scale_inv);
  else
    fp8::quantize_1x128_transposed(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q_t, p.scale_inv_t);
}

void fp8_quantize_128x128(const ops::Fp8CastParams& p) {
  if (std::string why; !supports_fp8_quantize_128x128(p, &why)) fail("{}", why);
  fp8::quantize_128x128(p.x, p.rows, p.cols, p.fp8, p.power_of_two_scales, p.q, p.scale_inv, p.q_t,
                        p.scale_inv_t);
}

}  // namespace forge::cpu
