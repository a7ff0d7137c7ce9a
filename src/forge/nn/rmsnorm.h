// RMSNorm module: y = w * x / sqrt(mean(x^2) + eps) over the last dimension; with a weight offset the scale
// is w + offset (Gemma's RMSNorm scales by 1 + w, its weights starting at zero).
#pragma once

#include "forge/core/parameters.h"

namespace forge::nn {

class RmsNorm {
 public:
  struct Saved {
    Tensor x, rstd;  // forward
    Tensor dy;       // kept from backward_input for backward_weight
  };

  RmsNorm() = default;
  RmsNorm(ParameterStore* store, int weight_param, float eps, float weight_offset = 0.0f);

  // x fp32 or bf16; y in `dtype` (fp32, or bf16 rounded once: the operand a bf16 GEMM reads next).
  Tensor forward(const Tensor& x, Saved& saved, DType dtype = DType::f32) const;
  // dy fp32 or bf16; returns dx (fresh tensor) in `dtype`.
  Tensor backward_input(const Tensor& dy, Saved& saved, DType dtype = DType::f32) const;
  void backward_weight(Saved& saved) const;  // dweight += ..., then releases the saved tensors
  int64_t dim() const { return dim_; }

 private:
  ParameterStore* store_ = nullptr;
  int weight_ = -1;
  int64_t dim_ = 0;
  float eps_ = 1e-5f;
  float offset_ = 0.0f;
};

}  // namespace forge::nn
