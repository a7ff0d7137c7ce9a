// A decoder's normalisation, of the kind its family uses: RMSNorm (LLaMA and most families since) or
// LayerNorm with its bias (StarCoder2, GPT-style). One interface, the modules' own (forward, B, W), so that
// a decoder layer and the stack's final norm need not know which.
#pragma once

#include "forge/nn/layernorm.h"
#include "forge/nn/rmsnorm.h"

namespace forge::nn {

enum class NormKind { rms, layer };

class Norm {
 public:
  struct Saved {
    RmsNorm::Saved rms;
    LayerNorm::Saved layer;
  };

  Norm() = default;
  explicit Norm(RmsNorm norm) : rms_(norm) {}
  explicit Norm(LayerNorm norm) : layer_(norm), is_layer_(true) {}

  // x fp32 or bf16; y in `dtype`.
  Tensor forward(const Tensor& x, Saved& saved, DType dtype = DType::f32) const {
    return is_layer_ ? layer_.forward(x, saved.layer, dtype) : rms_.forward(x, saved.rms, dtype);
  }
  // dy fp32 or bf16; dx (a fresh tensor) in `dtype`.
  Tensor backward_input(const Tensor& dy, Saved& saved, DType dtype = DType::f32) const {
    return is_layer_ ? layer_.backward_input(dy, saved.layer, dtype)
                     : rms_.backward_input(dy, saved.rms, dtype);
  }
  void backward_weight(Saved& saved) const {
    if (is_layer_)
      layer_.backward_weight(saved.layer);
    else
      rms_.backward_weight(saved.rms);
  }
  int64_t dim() const { return is_layer_ ? layer_.dim() : rms_.dim(); }
  // The input forward kept (the norm runs again from it under RecomputeModule::norm).
  const Tensor& input(const Saved& saved) const { return is_layer_ ? saved.layer.x : saved.rms.x; }

 private:
  RmsNorm rms_;
  LayerNorm layer_;
  bool is_layer_ = false;
};

// The norm of weight `weight` in the store: an RMSNorm scaling by weight + weight_offset, or a LayerNorm
// whose bias (with `bias`) is the parameter registered right after its weight.
inline Norm make_norm(ParameterStore* store, NormKind kind, int weight, bool bias, float eps,
                      float weight_offset) {
  if (kind == NormKind::layer) return Norm(LayerNorm(store, weight, bias ? weight + 1 : -1, eps));
  return Norm(RmsNorm(store, weight, eps, weight_offset));
}

}  // namespace forge::nn
