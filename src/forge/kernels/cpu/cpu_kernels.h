// Declarations of the CPU backend's kernels (one file each in this folder); cpu_table.cpp gathers them.
#pragma once

#include <vector>

#include "forge/kernels/ops.h"

namespace forge::cpu {

void gemm(const ops::GemmParams& p);
void fp8_gemm(const ops::Fp8GemmParams& p);
// GEMM outputs (gemm_onednn.cpp). check_gemm_output fails with one line naming `op` unless c_dtype is f32, or
// bf16 with operands other than fp32. A bf16 C [rows, cols] (leading dimension ldc) is computed through fp32
// scratch with the same leading dimension: fp32_scratch_for_bf16 sizes it (holding C widened when read_c) and
// returns it for the fp32-output GEMM; round_scratch_to_bf16 then rounds the cols of each row into C, leaving
// its padding alone.
void check_gemm_output(const char* op, DType c_dtype, DType operand_dtype);
float* fp32_scratch_for_bf16(const void* c, int64_t rows, int64_t cols, int64_t ldc, bool read_c,
                             std::vector<float>& scratch);
void round_scratch_to_bf16(const float* scratch, void* c, int64_t rows, int64_t cols, int64_t ldc);
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
