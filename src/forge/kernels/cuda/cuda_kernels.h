// Declarations of the CUDA backend's kernels (one file per family in this folder); cuda_table.cu gathers
// them into the op table. Every pointer in the parameter structs is a device pointer; kernels run
// asynchronously on cuda::stream(). sum_squares returns to the host (it synchronises).
#pragma once

#include "forge/kernels/ops.h"

namespace forge::cuda {

// GEMMs through cuBLASLt (gemm_cublaslt.cpp): fp32 or bf16 operands, fp32 or bf16 output (c_dtype; bf16
// from bf16 or FP8 operands); FP8 per-tensor scaling (E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3) on devices
// with FP8 tensor cores (sm_89+). Block scaling goes to fp8_block_gemm below.
void gemm(const ops::GemmParams& p);
void fp8_gemm(const ops::Fp8GemmParams& p);

// Elementwise, norm and optimizer kernels (elementwise.cu, rmsnorm.cu, rope.cu, swiglu.cu, embedding.cu,
// adamw.cu), each the CPU kernel's semantics (kernels/ops.h) on device memory.
void rmsnorm_forward(const ops::RmsNormParams& p);
void rmsnorm_backward_input(const ops::RmsNormParams& p);
void rmsnorm_backward_weight(const ops::RmsNormParams& p);
void rope(const ops::RopeParams& p);
void swiglu_forward(const ops::SwigluParams& p);
void swiglu_backward(const ops::SwigluParams& p);
void embedding_forward(const ops::EmbeddingParams& p);
void embedding_backward_weight(const ops::EmbeddingParams& p);
void adamw(const ops::AdamWParams& p);
void add_inplace(float* y, const float* x, int64_t n);
double sum_squares(const float* x, int64_t n);
void sum_squares_accumulate(const float* x, int64_t n, double* total);  // in stream order, no synchronisation
void scale_inplace(float* x, float s, int64_t n);

// bf16 <-> fp32 conversions (elementwise.cu), bitwise core/dtype.h's.
void convert_to_bf16(const float* x, uint16_t* y, int64_t n);
void convert_to_f32(const uint16_t* x, float* y, int64_t n);

// Appending new tokens' keys and values to an inference cache (kv_append.cu).
void kv_append(const ops::KvAppendParams& p);

// Attention forward and backward (attention.cu): ops::AttentionParams semantics on device memory.
void attention_forward(const ops::AttentionParams& p);
void attention_backward(const ops::AttentionParams& p);

// The vocabulary-chunked cross-entropy fused with the output projection (cross_entropy.cu).
void linear_cross_entropy_forward(const ops::LinearCrossEntropyParams& p);
void linear_cross_entropy_backward(const ops::LinearCrossEntropyParams& p);

// FP8 casts (fp8_cast.cu): amax (to the host, or into device memory without a synchronisation), per-tensor
// cast + transpose + amax (with a host scale or one computed on the device from an amax there), 1x128 and
// 128x128 block quantisation, every code and scale bitwise the CPU's (fp8/quantize.h, fp8/scaling.h).
float amax(const float* x, int64_t n);
void amax_to(const float* x, int64_t n, float* out);
float fp8_cast_transpose(const ops::Fp8CastParams& p);
void fp8_quantize_1x128(const ops::Fp8CastParams& p);
void fp8_quantize_128x128(const ops::Fp8CastParams& p);

// Block-scaled FP8 GEMM (fp8_block_gemm.cu), DeepSeek-V3 fine-grained scaling: fp8_gemm hands it
// p.scaling == block. Operands K-major (A [m,k] not transposed, B [n,k] with trans_b), the layout FP8 tensor
// cores take; partial sums over each 128-wide K block are promoted to an fp32 accumulator with their scales.
void fp8_block_gemm(const ops::Fp8GemmParams& p);

// The checks the ops above make on their parameters before touching the device, where the CUDA backend's
// limits are narrower than the CPU's (FP8 GEMMs NT only with 16-byte aligned operands, the attention kernels'
// head dimensions and grid, ...): the same functions the ops call first, needing no GPU. The device emulation
// (kernels/emulated_device.h) runs them before each CPU kernel, so a parameter this backend refuses fails there
// too.
void check_gemm(const ops::GemmParams& p);
void check_fp8_gemm(const ops::Fp8GemmParams& p);  // block scaling: check_fp8_block_gemm
void check_fp8_block_gemm(const ops::Fp8GemmParams& p);
void check_attention(const ops::AttentionParams& p, bool backward);
void check_linear_cross_entropy(const ops::LinearCrossEntropyParams& p, bool backward);

}  // namespace forge::cuda
