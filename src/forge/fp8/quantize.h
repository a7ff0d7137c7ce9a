// FP8 quantisation on the CPU: per-tensor (delayed and current scaling), the fused cast + transpose + amax
// that produces both operand layouts of a GEMM in one read of the input, and block quantisation
// (DeepSeek-V3 / TE Float8BlockScaling). Every cast is q = fp8(x * scale) with the saturating round-to-
// nearest-even conversion of core/dtype.h, so results are bit-identical to f32_to_e4m3 / f32_to_e5m2 of the
// product; NaN stays NaN, +-inf saturates to +-max. Large inputs run OpenMP-parallel; every result
// (including amax, a max) is independent of the thread count.
//
// The input x is fp32 or bf16 (ConstElements: a float* or the bits of bf16 as uint16_t*); a bf16 element is
// widened exactly as it is read, so casting a bf16 tensor gives the codes of its fp32 copy, bit for bit.
//
// amax = max |x| over the input; NaN when any element is NaN (so an anomaly is visible to the caller),
// inf when any is infinite. compute_scale() keeps the previous scale for either.
//
// Block layouts (kBlockTile = 128; "k" runs along the contiguous, last dimension of the quantised tensor,
// k_blocks = ceil(k / 128); partial tiles at the edges have their own scale over their valid elements):
//   1x128    q [rows, cols], scale_inv [rows][ceil(cols/128)] row-major: scale_inv[r * k_blocks + kb]
//            covers q[r, kb*128 .. kb*128+127].
//   1x128 transposed (quantize_1x128_transposed): q_t = quantised x^T, [cols, rows], tiles of 128 along
//            rows of x; scale_inv [cols][ceil(rows/128)]: scale_inv[c * k_blocks + kb] covers
//            q_t[c, kb*128 .. kb*128+127] = x[kb*128 .. kb*128+127, c].
//   128x128  q [rows, cols], scale_inv [ceil(rows/128)][ceil(cols/128)] row-major: scale_inv[rb * k_blocks
//            + kb] covers q[rb*128 .. rb*128+127, kb*128 .. kb*128+127].
// Each tile's scale is compute_scale(tile amax, fp8_max, 0, 1, power_of_two): fp8_max / amax (rounded
// down to a power of two on request); a tile whose amax is 0, inf or NaN gets scale 1. scale_inv is stored
// as 1 / scale (exact for power-of-two scales), and dequantisation is q * scale_inv.
#pragma once

#include <cstdint>

#include "forge/core/dtype.h"
#include "forge/core/element_ptr.h"
#include "forge/fp8/recipe.h"

namespace forge::fp8 {

// max |x[i]| (NaN if any x[i] is NaN).
float compute_amax(ConstElements x, int64_t n);

// q[i] = fp8(x[i] * scale); returns amax of x, computed in the same pass. fp8 is DType::e4m3 or e5m2.
float quantize(ConstElements x, int64_t n, float scale, DType fp8, uint8_t* q);
// x[i] = float(q[i]) * scale_inv.
void dequantize(const uint8_t* q, int64_t n, float scale_inv, DType fp8, float* x);

// One pass over x [rows, cols]: q_rowwise [rows, cols] = fp8(x * scale) and q_colwise [cols, rows] its
// transpose (same scale, same codes); returns amax of x. Bitwise equal to quantize() then a transpose.
float cast_transpose(ConstElements x, int64_t rows, int64_t cols, float scale, DType fp8, uint8_t* q_rowwise,
                     uint8_t* q_colwise);

// Block quantisation; layouts in the header comment.
void quantize_1x128(ConstElements x, int64_t rows, int64_t cols, DType fp8, bool power_of_two_scales,
                    uint8_t* q, float* scale_inv);
void quantize_1x128_transposed(ConstElements x, int64_t rows, int64_t cols, DType fp8,
                               bool power_of_two_scales, uint8_t* q_t, float* scale_inv_t);
// Both of the above from one read of x (tile by tile): bitwise equal to quantize_1x128 followed by
// quantize_1x128_transposed. The block recipe's activations and gradients need both: 1x128 tiles along
// their features for forward and the input gradient, along the tokens for the weight gradient.
void quantize_1x128_with_transpose(ConstElements x, int64_t rows, int64_t cols, DType fp8,
                                   bool power_of_two_scales, uint8_t* q, float* scale_inv, uint8_t* q_t,
                                   float* scale_inv_t);
// q_transposed ([cols, rows]) and scale_inv_transposed ([ceil(cols/128)][ceil(rows/128)]) are optional
// (null to skip): the 128x128 quantisation of x^T is the transpose of x's, block for block, with the same
// scales, so the backward GEMM's weight operand comes from the same pass.
void quantize_128x128(ConstElements x, int64_t rows, int64_t cols, DType fp8, bool power_of_two_scales,
                      uint8_t* q, float* scale_inv, uint8_t* q_transposed = nullptr,
                      float* scale_inv_transposed = nullptr);
void dequantize_1x128(const uint8_t* q, int64_t rows, int64_t cols, const float* scale_inv, DType fp8,
                      float* x);
void dequantize_128x128(const uint8_t* q, int64_t rows, int64_t cols, const float* scale_inv, DType fp8,
                        float* x);

// ceil(n / kBlockTile): the number of scale blocks along a dimension of n elements.
constexpr int64_t num_blocks(int64_t n) { return (n + kBlockTile - 1) / kBlockTile; }

}  // namespace forge::fp8
