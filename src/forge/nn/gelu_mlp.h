// The two-layer MLP of GPT-style families (StarCoder2's mlp.c_fc and mlp.c_proj): proj(gelu(fc(x) + b)).
// fc is column-parallel (its bias split with it), proj row-parallel; proj's bias, when the family has one,
// is added by the decoder layer once the tensor-parallel sum is done (nn::BranchBiases). With bf16
// activations (ComputeOptions::part_dtype), fc writes bf16 (saved for the backward at half the memory) and
// its gradient is bf16; the GELU kernels compute in fp32 in between.
#pragma once

#include "forge/kernels/ops.h"
#include "forge/nn/bias.h"
#include "forge/nn/compute.h"
#include "forge/nn/layer_part.h"
#include "forge/nn/linear.h"

namespace forge::nn {

// Its parameters, by id in the store: fc's weight, its bias (-1: none) and proj's weight.
struct GeluMlpParams {
  int fc = -1, fc_bias = -1, proj = -1;
};

class GeluMlp final : public LayerPart {
 public:
  struct Saved : LayerPart::Saved {
    GemmOperand h;         // fc's input (as its GEMMs read it)
    Tensor pre;            // fc(h) + b [rows, ffn] in the activation dtype: the GELU's input
    GemmOperand act;       // gelu(pre) as proj's operand (absent under selective recompute)
    GemmOperand dy, dpre;  // kept from backward_input for backward_weight
    Tensor dbias;          // fc's bias gradient, from B for W
  };

  GeluMlp() = default;
  // ffn: this rank's share of the intermediate size (its tensor-parallel shard).
  GeluMlp(ParameterStore* store, GeluMlpParams params, int64_t hidden, int64_t ffn, ComputeOptions options,
          ops::GeluKind kind);

  std::unique_ptr<LayerPart::Saved> new_saved() const override { return std::make_unique<Saved>(); }
  Tensor forward(const Tensor& h, int64_t, int64_t, LayerPart::Saved& saved, bool keep) const override {
    return run_forward(h, static_cast<Saved&>(saved), keep, act_dtype_);
  }
  Tensor backward_input(const Tensor& dy, int64_t, int64_t, LayerPart::Saved& saved) const override;
  void backward_weight(LayerPart::Saved& saved) const override;
  Tensor forward_cached(const Tensor& h, int64_t, int64_t, const KvLayer*) const override {
    Saved scratch;
    return run_forward(h, scratch, false, DType::f32);
  }
  DType input_dtype() const override { return act_dtype_; }
  void drop_input(LayerPart::Saved& saved) const override;
  void restore_input(const Tensor& h, LayerPart::Saved& saved) const override;

 private:
  Tensor run_forward(const Tensor& h, Saved& saved, bool keep_activation, DType output) const;
  Tensor activation(const Tensor& pre) const;  // gelu(pre) in the activation dtype
  Linear fc_, proj_;
  Bias fc_bias_;  // undefined: none
  int64_t ffn_ = 0;
  ComputeOptions options_;
  ops::GeluKind kind_ = ops::GeluKind::tanh;
  DType act_dtype_ = DType::f32;
};

}  // namespace forge::nn
