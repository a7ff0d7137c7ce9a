// SwiGLU MLP: down(silu(gate(x)) * up(x)), with gate|up as one fused GEMM over adjacent weights.
#pragma once

#include "forge/nn/compute.h"
#include "forge/nn/linear.h"

namespace forge::nn {

class Mlp {
 public:
  struct Saved {
    GemmOperand h;           // input of gate|up (as its GEMMs read it)
    Tensor gate_up;          // fp32 [rows, 2*ffn]
    GemmOperand act;         // silu(gate)*up as the down projection's operand (absent under selective)
    GemmOperand dy, dgate_up;  // kept from backward_input for backward_weight
  };

  Mlp() = default;
  Mlp(ParameterStore* store, int gate_up_param, int down_param, int64_t hidden, int64_t ffn,
      ComputeOptions options);

  Tensor forward(const Tensor& h, Saved& saved, bool keep_activation) const;
  Tensor backward_input(const Tensor& dy, Saved& saved) const;
  void backward_weight(Saved& saved) const;

 private:
  Tensor activation(const Tensor& gate_up) const;
  Linear gate_up_, down_;
  int64_t ffn_ = 0;
  ComputeOptions options_;
};

}  // namespace forge::nn
