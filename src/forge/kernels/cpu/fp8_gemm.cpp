// Emulated FP8 GEMM (semantics in ops.h). Every E4M3/E5M2 value is exact in bf16, so the codes are widened
// to bf16 once per call through a 256-entry table and multiplied by the bf16 GEMM (fp32 accumulation); scales
// are applied to fp32 partial products, never to the operands, which keeps the products exact.
//
// Scales never reach oneDNN as alpha: its primitives are cached per alpha, and scales change every step.
// A bf16 C is the fp32 result rounded once: the fp32 kernel writes scratch, one pass rounds it (as gemm
// does).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "forge/core/error.h"
#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

using Bf16Table = std::array<uint16_t, 256>;

const Bf16Table& bf16_table(DType dtype) {
  static const Bf16Table e4m3 = [] {
    Bf16Table t;
    for (int code = 0; code < 256; ++code)
      t[code] = f32_to_bf16_bits(e4m3_to_f32(static_cast<uint8_t>(code)));
    return t;
  }();
  static const Bf16Table e5m2 = [] {
    Bf16Table t;
    for (int code = 0; code < 256; ++code)
      t[code] = f32_to_bf16_bits(e5m2_to_f32(static_cast<uint8_t>(code)));
    return t;
  }();
  return dtype == DType::e4m3 ? e4m3 : e5m2;
}

// Widens a stored rows x cols matrix of FP8 codes (leading dimension ld) into dense bf16 [rows, cols].
void widen(const uint8_t* src, int64_t rows, int64_t cols, int64_t ld, DType dtype,
           std::vector<uint16_t>& dst) {
  dst.resize(static_cast<size_t>(rows * cols));
  const uint16_t* table = bf16_table(dtype).data();
  uint16_t* out = dst.data();
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* in = src + r * ld;
    uint16_t* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = table[in[c]];
  }
}

// Rounds toward zero to `bits` explicit mantissa bits (1..23). Done on the double sum so that there is a
// single rounding; the result has at most 24 significant bits and converts to float exactly (barring
// under/overflow).
float truncate_mantissa(double x, int bits) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  u &= ~((uint64_t{1} << (52 - bits)) - 1);
  std::memcpy(&x, &u, sizeof u);
  return static_cast<float>(x);
}

bool is_fp8(DType dtype) { return dtype == DType::e4m3 || dtype == DType::e5m2; }

bool refuse_scales(const ops::Fp8GemmParams& p, std::string* reason) {
  return ops::refuse(reason, "fp8_gemm: per-tensor scale_inv must be finite, got a_scale_inv={} b_scale_inv={}",
                     p.a_scale_inv, p.b_scale_inv);
}

// Per-tensor scale values, those read from behind pointers included.
bool scales_finite(const ops::Fp8GemmParams& p, std::string* reason) {
  if (p.scaling != ops::Fp8Scaling::per_tensor || (std::isfinite(p.a_scale_inv) && std::isfinite(p.b_scale_inv)))
    return true;
  return refuse_scales(p, reason);
}

// The kernel for checked parameters with scale values (no pointers) and an fp32 C.
void fp8_gemm_f32(const ops::Fp8GemmParams& p) {
  float* const c_out = static_cast<float*>(p.c);
  const int64_t m = p.m, n = p.n, k = p.k;
  const int64_t a_cols = p.trans_a ? m : k, b_cols = p.trans_b ? k : n;
  thread_local std::vector<uint16_t> a16, b16;
  widen(p.a, p.trans_a ? k : m, a_cols, p.lda, p.a_dtype, a16);
  widen(p.b, p.trans_b ? n : k, b_cols, p.ldb, p.b_dtype, b16);

  // out[m,n] (leading dimension ldo) = op(A)[:, k0:k0+len] @ op(B)[k0:k0+len, :] in fp32.
  auto multiply_slice = [&](int64_t k0, int64_t len, float* out, int64_t ldo) {
    ops::GemmParams g;
    g.m = m, g.n = n, g.k = len;
    g.ab_dtype = DType::bf16;
    g.a = a16.data() + (p.trans_a ? k0 * m : k0), g.lda = a_cols, g.trans_a = p.trans_a;
    g.b = b16.data() + (p.trans_b ? k0 : k0 * n), g.ldb = b_cols, g.trans_b = p.trans_b;
    g.c = out, g.ldc = ldo;
    cpu::gemm(g);
  };

  const bool block = p.scaling == ops::Fp8Scaling::block;
  const int bits = p.accumulator_bits;
  // Per-tensor scales multiply the finished sum; block scales multiply each K-block's partial product.
  const float alpha = block ? p.alpha : static_cast<float>(double{p.alpha} * p.a_scale_inv * p.b_scale_inv);
  const float beta = p.beta;
  const int64_t mn = m * n;
  const bool parallel = mn > 16384;

  if (!block && bits == 0 && beta == 0.0f) {  // the common case: one GEMM straight into C
    multiply_slice(0, k, c_out, p.ldc);
    if (alpha != 1.0f) {
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) c_out[i * p.ldc + j] *= alpha;
    }
    return;
  }

  // Elements of K summed before the fp32 accumulator takes them: the scaling block when exact (the whole of K
  // without block scales), the promotion interval when the accumulator is limited.
  int64_t interval = block ? ops::kFp8BlockSize : k;
  if (bits > 0 && p.promote_every > 0 && (block || !p.fast_accumulation)) interval = p.promote_every;
  const int64_t k_blocks = (k + ops::kFp8BlockSize - 1) / ops::kFp8BlockSize;
  const int64_t n_blocks = (n + ops::kFp8BlockSize - 1) / ops::kFp8BlockSize;

  thread_local std::vector<float> partial_buffer, accumulator_buffer, slice_buffer, b_scale_buffer;
  partial_buffer.resize(static_cast<size_t>(mn));
  accumulator_buffer.resize(static_cast<size_t>(mn));
  if (bits > 0) slice_buffer.resize(static_cast<size_t>(mn));
  if (block) b_scale_buffer.resize(static_cast<size_t>(n));

  // Raw pointers, taken here: inside an OpenMP region a thread_local names each worker's own (empty)
  // instance.
  float* const partial = partial_buffer.data();
  float* const accumulator = accumulator_buffer.data();
  float* const slice = slice_buffer.data();
  float* const b_scale = b_scale_buffer.data();

  for (int64_t k0 = 0; k0 < k; k0 += interval) {
    const int64_t len = std::min(interval, k - k0);
    if (bits == 0) {
      multiply_slice(k0, len, partial, n);
    } else {
      // The tensor core's narrow running sum: add each 32-wide sub-slice's fp32 dot product, then truncate.
      for (int64_t s0 = k0; s0 < k0 + len; s0 += ops::kFp8AccumulateSlice) {
        multiply_slice(s0, std::min(ops::kFp8AccumulateSlice, k0 + len - s0), slice, n);
        const bool first_slice = s0 == k0;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t e = 0; e < mn; ++e)
          partial[e] =
              truncate_mantissa(first_slice ? double{slice[e]} : double{partial[e]} + slice[e], bits);
      }
    }

    // Promotion: scale the interval's sum and add it into the fp32 accumulator; the last one writes C.
    const bool first = k0 == 0, last = k0 + len >= k;
    const int64_t kb = k0 / ops::kFp8BlockSize;
    if (block) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t jb = j / ops::kFp8BlockSize;
        b_scale[j] = p.b_block == ops::Fp8BlockScales::tile_1x128 ? p.b_scales[j * k_blocks + kb]
                     : p.trans_b                                  ? p.b_scales[jb * k_blocks + kb]
                                                                  : p.b_scales[kb * n_blocks + jb];
      }
    }
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < m; ++i) {
      const float a_scale = block ? p.a_scales[i * k_blocks + kb] : 1.0f;
      const float* pr = partial + i * n;
      float* acc = accumulator + i * n;
      float* c = c_out + i * p.ldc;
      for (int64_t j = 0; j < n; ++j) {
        float v = block ? pr[j] * (a_scale * b_scale[j]) : pr[j];
        if (!first) v += acc[j];
        if (!last)
          acc[j] = v;
        else
          c[j] = beta == 0.0f ? alpha * v : alpha * v + beta * c[j];  // beta = 0 never reads C (may be NaN)
      }
    }
  }
}

}  // namespace

// Scale values on the host are checked here; one behind a pointer (host memory on the CPU) is data, which the
// kernel checks once it has read it.
bool supports_fp8_gemm(const ops::Fp8GemmParams& p, std::string* reason) {
  using ops::refuse;
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return refuse(reason, "fp8_gemm: empty problem m={} n={} k={}", p.m, p.n, p.k);
  if (!is_fp8(p.a_dtype))
    return refuse(reason, "fp8_gemm: a_dtype must be e4m3 or e5m2, got {}", dtype_name(p.a_dtype));
  if (!is_fp8(p.b_dtype))
    return refuse(reason, "fp8_gemm: b_dtype must be e4m3 or e5m2, got {}", dtype_name(p.b_dtype));
  if (!ops::supports_gemm_output("fp8_gemm", p.c_dtype, p.a_dtype, reason)) return false;
  if (!p.a || !p.b || !p.c) return refuse(reason, "fp8_gemm: null operand pointer (a, b or c)");
  const int64_t a_cols = p.trans_a ? p.m : p.k, b_cols = p.trans_b ? p.k : p.n;
  if (p.lda < a_cols) return refuse(reason, "fp8_gemm: lda {} is smaller than A's {} stored columns", p.lda, a_cols);
  if (p.ldb < b_cols) return refuse(reason, "fp8_gemm: ldb {} is smaller than B's {} stored columns", p.ldb, b_cols);
  if (p.ldc < p.n) return refuse(reason, "fp8_gemm: ldc {} is smaller than n {}", p.ldc, p.n);
  if (p.scaling == ops::Fp8Scaling::per_tensor) {
    if ((!p.a_scale_inv_ptr && !std::isfinite(p.a_scale_inv)) || (!p.b_scale_inv_ptr && !std::isfinite(p.b_scale_inv)))
      return refuse_scales(p, reason);
  } else if (!p.a_scales || !p.b_scales) {
    return refuse(reason, "fp8_gemm: block scaling needs a_scales and b_scales (got {} and {})",
                  p.a_scales ? "set" : "null", p.b_scales ? "set" : "null");
  }
  if (p.accumulator_bits < 0 || p.accumulator_bits > 23)
    return refuse(reason, "fp8_gemm: accumulator_bits must be 0 (exact fp32) or 1..23, got {}", p.accumulator_bits);
  if (p.accumulator_bits > 0) {
    if (p.promote_every < 0 || p.promote_every % ops::kFp8AccumulateSlice != 0)
      return refuse(reason, "fp8_gemm: promote_every must be a multiple of {}, got {}", ops::kFp8AccumulateSlice,
                    p.promote_every);
    if (p.scaling == ops::Fp8Scaling::block && (p.promote_every == 0 || ops::kFp8BlockSize % p.promote_every != 0))
      return refuse(reason, "fp8_gemm: with block scaling promote_every must divide {}, got {}", ops::kFp8BlockSize,
                    p.promote_every);
  }
  return true;
}

void fp8_gemm(const ops::Fp8GemmParams& params) {
  if (std::string why; !supports_fp8_gemm(params, &why)) fail("{}", why);
  // Scales behind pointers (host memory here) become the values they hold, then everything is as for values.
  ops::Fp8GemmParams p = params;
  if (p.scaling == ops::Fp8Scaling::per_tensor) {
    if (p.a_scale_inv_ptr) p.a_scale_inv = *p.a_scale_inv_ptr;
    if (p.b_scale_inv_ptr) p.b_scale_inv = *p.b_scale_inv_ptr;
  }
  p.a_scale_inv_ptr = p.b_scale_inv_ptr = nullptr;
  if (std::string why; !scales_finite(p, &why)) fail("{}", why);
  if (p.c_dtype == DType::f32) return fp8_gemm_f32(p);
  gemm_through_fp32_output(p, fp8_gemm_f32);
}

}  // namespace forge::cpu
