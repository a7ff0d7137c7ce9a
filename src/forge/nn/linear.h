// Linear without bias: y = x @ W^T, W stored [out_features, in_features] (the Hugging Face layout).
// The weight may span several adjacent parameters (q|k|v, gate|up), which then run as one GEMM.
//
// A Linear runs three GEMMs: forward y = x W^T, input gradient dx = dy W and weight gradient dW += dy^T x.
// Their activation operands (x and dy) pass through GemmOperand, which holds them as the GEMMs read them:
// in the GEMM dtype (fp32 or bf16), or under FP8 (ComputeOptions::fp8) as FP8 codes with their scales, in
// the two layouts FP8 tensor cores need (both operands K-major), made in one pass over the input:
//   row-wise     [tokens, features]  for forward (x) and the input gradient (dy), K = the features;
//   column-wise  [features, tokens]  for the weight gradient (x^T, dy^T), K = the tokens.
// Per-tensor recipes (delayed, current) share one scale between the two (fp8::cast_transpose); the block
// recipe (DeepSeek-V3) has 1x128 tiles along each layout's K (fp8::quantize_1x128_with_transpose).
// After forward, an input operand keeps only the column-wise copy the weight gradient reads; with
// Fp8Options::save_fp8_inputs = false it keeps the GEMM-dtype tensor instead and is cast again in backward
// with the forward's scale. The FP8 weight is cast once per weight version and shared (Fp8Context::weight).
//
// Where the per-tensor scales live: the delayed recipe's come from the host (the previous steps' history), so
// they travel as host floats. The current recipe's come from the tensor itself, and on a GPU the host never
// sees them: the amax is reduced into the operand's `scales` in device memory (ops::amax_to), the cast
// computes the scale there and writes scale and scale_inv beside it, and the GEMMs read scale_inv from there
// (ops::Fp8GemmParams::a_scale_inv_ptr), all in stream order, without a synchronisation per cast.
#pragma once

#include <string>
#include <vector>

#include "forge/core/parameters.h"
#include "forge/kernels/ops.h"
#include "forge/nn/compute.h"
#include "forge/nn/fp8_context.h"

namespace forge::nn {

struct GemmOperand {
  Tensor data;  // [rows, cols]: fp32 / bf16, or FP8 codes row-wise (block: 1x128 tiles along cols)
  float scale = 1.0f, scale_inv = 1.0f;  // FP8 delayed recipe: codes * scale_inv is the value
  Tensor scales;  // FP8 current recipe: [amax, scale, scale_inv] on the operand's device (kAmax, kScale, ...)
  Tensor tiles;   // block: scale_inv of data's tiles [rows][ceil(cols/128)]
  Tensor data_t, tiles_t;  // FP8 column-wise: the transpose [cols, rows]; block: its 1x128 tiles along rows,
                           // scale_inv [cols][ceil(rows/128)]
  Tensor high;             // FP8 with save_fp8_inputs = false: the GEMM-dtype tensor kept for backward
  bool defined() const { return data.defined() || data_t.defined() || high.defined(); }
  // Bytes held (what an activation saved for backward costs).
  int64_t bytes() const;
};

class Linear {
 public:
  Linear() = default;
  // params: the weights, stacked along the output rows in this order (q, k, v; gate, up); they must have been
  // registered one after another, so that they form one matrix in the store. With options.fp8 set, registers
  // this Linear with the FP8 context under `name` (for messages).
  Linear(ParameterStore* store, std::vector<int> params, int64_t in_features,
         const ComputeOptions& options = {}, std::string name = {});

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  bool fp8() const { return fp8_ != nullptr; }

  // x [rows, in] (fp32, or bf16 with bf16 GEMMs) as the forward operand: converted to the GEMM dtype (shared
  // when it is in it already), or cast to FP8 per the recipe (from fp32; recording its amax under delayed
  // scaling).
  GemmOperand input(const Tensor& x) const;
  // dy [rows, out] (fp32, or bf16 with bf16 GEMMs) as the operand of the input and weight gradients.
  GemmOperand grad_output(const Tensor& dy) const;

  // y [rows, out] = x @ W^T; then drops from x what only forward reads (keep_for_backward). Written into
  // `out` when given (an fp32 [rows, out] view, e.g. one expert's rows of a larger tensor), else a new
  // tensor of `dtype`: f32, or bf16 (the fp32 result rounded once) with bf16 or FP8 operands.
  Tensor forward(GemmOperand& x, const Tensor& out = Tensor(), DType dtype = DType::f32) const;
  Tensor forward(GemmOperand& x, DType dtype) const { return forward(x, Tensor(), dtype); }
  // dx [rows, in] = dy @ W; then drops from dy what only this GEMM reads. `out` and `dtype` as for forward.
  Tensor backward_input(GemmOperand& dy, const Tensor& out = Tensor(), DType dtype = DType::f32) const;
  Tensor backward_input(GemmOperand& dy, DType dtype) const { return backward_input(dy, Tensor(), dtype); }
  // dW += dy^T @ x, reported to the store (ParameterStore::note_grad) for each weight.
  void backward_weight(const GemmOperand& dy, const GemmOperand& x) const;
  // Drops from an input operand what the weight gradient does not read (for operands recomputed in backward).
  void keep_for_backward(GemmOperand& x) const;

 private:
  Tensor weight(DType dtype) const;
  Tensor result(const Tensor& out, int64_t rows, int64_t cols, DType dtype, const char* what) const;
  void accumulate_weight_grad(const GemmOperand& dy, const GemmOperand& x) const;
  void run_fp8_gemm(const ops::Fp8GemmParams& p) const;
  const Fp8Weight& fp8_weight() const;  // cast when the master weights changed since the last cast
  // x [rows, cols] to FP8 in the role's format: the row-wise codes (with_rows) and, under the block recipe,
  // the transposed tiles (with_transpose).
  // scale_of: cast with the per-tensor scale of this earlier cast of the same tensor (a re-cast in backward)
  // instead of the recipe's.
  GemmOperand quantize(const Tensor& x, int64_t cols, fp8::TensorRole role, bool with_rows,
                       bool with_transpose, const GemmOperand* scale_of = nullptr) const;

  ParameterStore* store_ = nullptr;
  int first_ = 0, count_ = 0;
  int64_t in_ = 0, out_ = 0;
  DType gemm_dtype_ = DType::bf16;
  Device device_ = Device::cpu;
  bool tensor_core_shapes_ = false;  // FP8 operands must come in multiples of 16 rows and columns
  Fp8Context* fp8_ = nullptr;
  TensorParallel* tp_ = nullptr;
  int slot_ = -1;
};

}  // namespace forge::nn
