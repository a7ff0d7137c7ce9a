// Declarations of the CUDA backend's kernels (one file per family in this folder); cuda_table.cpp gathers
// them into the op table. Every pointer in the parameter structs is a device pointer; kernels run
// asynchronously on cuda::stream(). sum_squares, amax and fp8_cast_transpose (without amax_accumulate or
// amax_in) return to the host: they synchronise.
//
// Where each op lives:
//   gemm, fp8_gemm (per-tensor)        gemm_cublaslt.cpp: cuBLASLt, fp32 or bf16 operands, fp32 or bf16
//   output
//                                      (bf16 from bf16 or FP8 operands); FP8 per-tensor scaling (E4M3 x E4M3,
//                                      E4M3 x E5M2, E5M2 x E4M3) on devices with FP8 tensor cores (sm_89+).
//   fp8_gemm (block scaling)           fp8_block_gemm.cu, through fp8_block_gemm below.
//   layernorm_*, gelu_*, bias_*        layernorm.cu, gelu.cu, bias.cu: the CPU kernels' semantics and order.
//   rmsnorm_*, rope, swiglu_*,         rmsnorm.cu, rope.cu, swiglu.cu, embedding.cu, adamw.cu,
//   elementwise.cu: embedding_*, adamw, add_inplace,   each the CPU kernel's semantics (kernels/ops.h) on
//   device memory; the sum_squares*, scale_inplace,       bf16 conversions bitwise core/dtype.h's;
//   sum_squares_accumulate in stream convert_to_*                       order, without a synchronisation.
//   attention_*                        attention.cu.
//   linear_cross_entropy_*             cross_entropy.cu: the vocabulary-chunked loss fused with the
//   projection. amax, amax_to, fp8_cast_transpose, fp8_cast.cu: every code and scale bitwise the CPU's
//   (fp8/quantize.h, fp8_quantize_*                     fp8/scaling.h). kv_append kv_append.cu.
//   attention_merge, strided_copy       context_ops.cu (context parallelism).
//   moe_sort_by_expert                 moe_sort.cu: a deterministic, stable counting sort (chunked ranks and
//                                      counts, one scan block, placement); bitwise the CPU's output.
//   moe_permute*, moe_unpermute*       moe_permute.cu: gathers, a block per row, sums in increasing j.
//   m_grouped_gemm, k_grouped_gemm     grouped_gemm.cu: a host loop over the (host) offsets, a cuBLASLt
//                                      matmul (gemm above) per non-empty group.
//
// Each op's supports_<op> is the check it makes on its parameters before touching the device, needing no GPU
// (the CUDA backend's limits are narrower than the CPU's in places: FP8 GEMMs NT only with 16-byte aligned
// operands, no fp32 x fp32 -> bf16 GEMM, the attention kernels' head dimensions and grid, ...). The device
// emulation (kernels/emulated_device.h) runs them before each CPU kernel, so a parameter this backend refuses
// fails there too.
#pragma once

#include <string>

#include "forge/kernels/ops.h"

namespace forge::cuda {

FORGE_OPS(FORGE_OP_DECLARE_KERNEL)

// Block-scaled FP8 GEMM (fp8_block_gemm.cu), DeepSeek-V3 fine-grained scaling: fp8_gemm hands it
// p.scaling == block. Operands K-major (A [m,k] not transposed, B [n,k] with trans_b), the layout FP8 tensor
// cores take; partial sums over each 128-wide K block are promoted to an fp32 accumulator with their scales.
// supports_fp8_gemm defers to supports_fp8_block_gemm under block scaling.
void fp8_block_gemm(const ops::Fp8GemmParams& p);
bool supports_fp8_block_gemm(const ops::Fp8GemmParams& p, std::string* reason);

// Whether cuBLASLt (loaded on the first GEMM with dlopen, gemm_cublaslt.cpp) loads with every function the
// GEMMs call; no GPU needed. reason, when given, says why not.
bool cublaslt_loadable(std::string* reason = nullptr);

}  // namespace forge::cuda
