// Declarations of the CUDA backend's kernels (one file per family in this folder); cuda_table.cu gathers
// them into the op table. Every pointer in the parameter structs is a device pointer; kernels run
// asynchronously on cuda::stream(). sum_squares returns to the host (it synchronises).
#pragma once

#include "forge/kernels/ops.h"

namespace forge::cuda {

// GEMMs through cuBLASLt (gemm_cublaslt.cu): fp32 or bf16 operands, fp32 output; FP8 per-tensor scaling
// (E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3) on devices with FP8 tensor cores (sm_89+). Block scaling is the
// block-scaled kernel's (not yet: fails with a clear message).
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
void scale_inplace(float* x, float s, int64_t n);

// Not yet on CUDA (each fails with one line naming the op): attention (cuDNN fused attention or a flash
// kernel) and the vocabulary-chunked cross-entropy.
void attention_forward(const ops::AttentionParams& p);
void attention_backward(const ops::AttentionParams& p);
void linear_cross_entropy_forward(const ops::LinearCrossEntropyParams& p);
void linear_cross_entropy_backward(const ops::LinearCrossEntropyParams& p);

}  // namespace forge::cuda
