// LayerNorm module (PyTorch's nn.LayerNorm over the last dimension): y = (x - mean) / sqrt(var + eps) *
// weight + bias. B (backward_input) writes dx; W (backward_weight) accumulates the weight's and bias'
// gradients. The kernels compute in fp32: a bf16 input or gradient is widened on the way in (kept as given,
// widened again in B and W) and a bf16 output rounded once on the way out.
#pragma once

#include "forge/core/parameters.h"

namespace forge::nn {

class LayerNorm {
 public:
  struct Saved {
    Tensor x, mean, rstd;  // forward
    Tensor dy;             // kept from backward_input for backward_weight
  };

  LayerNorm() = default;
  // bias_param -1: no bias.
  LayerNorm(ParameterStore* store, int weight_param, int bias_param, float eps);

  // x fp32 or bf16; y in `dtype`.
  Tensor forward(const Tensor& x, Saved& saved, DType dtype = DType::f32) const;
  // Inference: keeps nothing.
  Tensor forward(const Tensor& x) const;
  // dy fp32 or bf16; dx (a fresh tensor) in `dtype`.
  Tensor backward_input(const Tensor& dy, Saved& saved, DType dtype = DType::f32) const;
  void backward_weight(Saved& saved) const;  // dweight, dbias += ...; then releases the saved tensors
  int64_t dim() const { return dim_; }

 private:
  ParameterStore* store_ = nullptr;
  int weight_ = -1, bias_ = -1;
  int64_t dim_ = 0;
  float eps_ = 1e-5f;
};

}  // namespace forge::nn
