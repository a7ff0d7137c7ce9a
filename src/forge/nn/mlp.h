// Gated MLP: down(act(gate(x)) * up(x)), with gate|up as one fused GEMM over adjacent weights; act is silu
// (SwiGLU) or the tanh GELU (GeGLU, Gemma). With a bf16 activation dtype (ComputeOptions::activation_dtype,
// neither Linear in FP8) the gate|up GEMM writes bf16, the GLU reads it and writes the down projection's bf16
// operand, and backward runs the same way: no conversion pass, and the saved gate|up takes half the memory.
#pragma once

#include "forge/kernels/ops.h"
#include "forge/nn/compute.h"
#include "forge/nn/layer_part.h"
#include "forge/nn/linear.h"

namespace forge::nn {

// Its parameters, by id in the store: gate and up registered one after another (one fused GEMM), and down.
struct MlpParams {
  int gate = -1, up = -1, down = -1;
};

class Mlp final : public LayerPart {
 public:
  struct Saved : LayerPart::Saved {
    GemmOperand h;             // input of gate|up (as its GEMMs read it)
    Tensor gate_up;            // [rows, 2*ffn] in the activation dtype
    GemmOperand act;           // silu(gate)*up as the down projection's operand (absent under selective)
    GemmOperand dy, dgate_up;  // kept from backward_input for backward_weight
  };

  Mlp() = default;
  // ffn: this rank's share of the intermediate size (its tensor-parallel shard).
  Mlp(ParameterStore* store, MlpParams params, int64_t hidden, int64_t ffn, ComputeOptions options,
      ops::GluActivation activation = ops::GluActivation::silu);

  Tensor forward(const Tensor& h, Saved& saved, bool keep_activation) const;
  Tensor backward_input(const Tensor& dy, Saved& saved) const;
  void backward_weight(Saved& saved) const;

  std::unique_ptr<LayerPart::Saved> new_saved() const override { return std::make_unique<Saved>(); }
  Tensor forward(const Tensor& h, int64_t, int64_t, LayerPart::Saved& saved, bool keep) const override {
    return forward(h, static_cast<Saved&>(saved), keep);
  }
  Tensor backward_input(const Tensor& dy, int64_t, int64_t, LayerPart::Saved& saved) const override {
    return backward_input(dy, static_cast<Saved&>(saved));
  }
  void backward_weight(LayerPart::Saved& saved) const override {
    backward_weight(static_cast<Saved&>(saved));
  }
  Tensor forward_cached(const Tensor& h, int64_t, int64_t, const KvLayer*) const override {
    Saved scratch;
    return run_forward(h, scratch, false, DType::f32);
  }
  DType input_dtype() const override { return act_dtype_; }
  void drop_input(LayerPart::Saved& saved) const override;
  void restore_input(const Tensor& h, LayerPart::Saved& saved) const override;

 private:
  Tensor run_forward(const Tensor& h, Saved& saved, bool keep_activation, DType output) const;
  Tensor activation(const Tensor& gate_up) const;
  Linear gate_up_, down_;
  int64_t ffn_ = 0;
  ComputeOptions options_;
  ops::GluActivation activation_ = ops::GluActivation::silu;
  // The input, gate|up, the activation, the output and all their gradients (cached inference returns fp32).
  DType act_dtype_ = DType::f32;
};

}  // namespace forge::nn
