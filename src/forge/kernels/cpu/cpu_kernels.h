// Declarations of the CPU backend's kernels (one file each in this folder); cpu_table.cpp gathers them.
#pragma once

#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"

namespace forge::cpu {

void gemm(const ops::GemmParams& p);
void fp8_gemm(const ops::Fp8GemmParams& p);
// A GEMM with a bf16 C (gemm, fp8_gemm): run(q) is the fp32-output kernel, given params q whose C is fp32
// scratch with C's leading dimension (holding the old C widened when beta != 0); each row's cols are then
// rounded into C once, its padding left alone. So a bf16 C is the fp32 result rounded, bitwise.
template <typename Params, typename Run>
void gemm_through_fp32_output(const Params& p, Run run) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>((p.m - 1) * p.ldc + p.n));
  // A plain pointer for the parallel loops: in another thread the thread_local names that thread's buffer.
  float* scratch = buffer.data();
  auto* c = static_cast<uint16_t*>(p.c);
  const bool parallel = p.m * p.n > 16384;
  if (p.beta != 0.0f) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < p.m; ++r)
      convert_bf16_to_f32(c + r * p.ldc, scratch + r * p.ldc, static_cast<size_t>(p.n));
  }
  Params q = p;
  q.c_dtype = DType::f32;
  q.c = scratch;
  run(q);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < p.m; ++r)
    convert_f32_to_bf16(scratch + r * p.ldc, c + r * p.ldc, static_cast<size_t>(p.n));
}
void rmsnorm_forward(const ops::RmsNormParams& p);
void rmsnorm_backward_input(const ops::RmsNormParams& p);
void rmsnorm_backward_weight(const ops::RmsNormParams& p);
void rope(const ops::RopeParams& p);
void swiglu_forward(const ops::SwigluParams& p);
void swiglu_backward(const ops::SwigluParams& p);
void attention_forward(const ops::AttentionParams& p);
void attention_backward(const ops::AttentionParams& p);
// attention_forward's kernel for a few queries against a longer key/value cache (attention_decode.cpp);
// expects checked parameters with their defaults filled in.
void attention_forward_decode(const ops::AttentionParams& p);
void embedding_forward(const ops::EmbeddingParams& p);
void embedding_backward_weight(const ops::EmbeddingParams& p);
void linear_cross_entropy_forward(const ops::LinearCrossEntropyParams& p);
void linear_cross_entropy_backward(const ops::LinearCrossEntropyParams& p);
void adamw(const ops::AdamWParams& p);
void add_inplace(float* y, const float* x, int64_t n);
double sum_squares(const float* x, int64_t n);
void sum_squares_accumulate(const float* x, int64_t n, double* total);
void scale_inplace(float* x, float s, int64_t n);
// Conversions and FP8 casts (fp8_cast.cpp): thin entries over core/dtype.h and fp8/quantize.h, where the CPU
// implementations live because the FP8 layer and its tests use them directly.
void convert_to_bf16(const float* x, uint16_t* y, int64_t n);
void convert_to_f32(const uint16_t* x, float* y, int64_t n);
float amax(const float* x, int64_t n);
void amax_to(const float* x, int64_t n, float* out);
float fp8_cast_transpose(const ops::Fp8CastParams& p);
void fp8_quantize_1x128(const ops::Fp8CastParams& p);
void fp8_quantize_128x128(const ops::Fp8CastParams& p);
void kv_append(const ops::KvAppendParams& p);  // attention_decode.cpp

}  // namespace forge::cpu
