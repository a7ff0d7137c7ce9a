// LayerNorm module (PyTorch's nn.LayerNorm over the last dimension): y = (x - mean) / sqrt(var + eps) *
// weight
// + bias. B (backward_input) writes dx; W (backward_weight) accumulates the weight's and bias' gradients.
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

  Tensor forward(const Tensor& x, Saved& saved) const;
  // Inference: keeps nothing.
  Tensor forward(const Tensor& x) const;
  Tensor backward_input(const Tensor& dy, Saved& saved) const;  // dx (a fresh tensor)
  void backward_weight(Saved& saved) const;  // dweight, dbias += ...; then releases the saved tensors

 private:
  ParameterStore* store_ = nullptr;
  int weight_ = -1, bias_ = -1;
  int64_t dim_ = 0;
  float eps_ = 1e-5f;
};

}  // namespace forge::nn
