// One pre-norm decoder layer: x + mixer(norm1(x)), then + ffn(norm2(.)) (each branch through hidden dropout
// in training when ComputeOptions::hidden_dropout is set), composed of the two parts its
// family chooses (nn/layer_part.h). Its input and output hold the residual stream's dtype (fp32, or bf16 in a
// bf16 run; ComputeOptions::residual_dtype); the norms write each part's input in the dtype the part takes
// (LayerPart::input_dtype), and each branch joins the stream with one rounding. Some families norm each
// part's output too before it joins the residual stream (Gemma's sandwich: x + post1(mixer(norm1(x))), then +
// post2(ffn(norm2(.)))). The norms are RMSNorms or LayerNorms (nn/norm.h), and some families put a bias on
// each part's output projection (StarCoder2's o_proj and c_proj), which the layer adds to the part's output
// (BranchBiases). Its three entry points follow the module contract: forward, backward_input (B, the
// critical path) and backward_weight (W, may run later).
#pragma once

#include <memory>

#include "forge/nn/bias.h"
#include "forge/nn/compute.h"
#include "forge/nn/layer_part.h"
#include "forge/nn/norm.h"

namespace forge::nn {

// A layer's norms by weight id in the store: before the mixer and before the feed-forward, and after each
// (-1: none).
struct LayerNorms {
  int before_mixer = -1, after_mixer = -1, before_ffn = -1, after_ffn = -1;
  float eps = 1e-6f;
  float weight_offset = 0.0f;  // RMSNorms scale by weight + offset (Gemma: 1 + w)
  NormKind kind = NormKind::rms;
  bool bias = false;  // LayerNorms: each has a bias, registered right after its weight (id weight + 1)
};

// Biases added to the mixer's and the feed-forward's outputs, by id in the store (-1: none): the biases of
// their output projections, which the layer adds once the part's tensor-parallel sum is done.
struct BranchBiases {
  int mixer = -1, ffn = -1;
};

class DecoderLayer {
 public:
  struct Saved {
    Tensor x;  // layer input (always kept)
    Norm::Saved norm1, norm2, post1, post2;
    Tensor dbias_mixer, dbias_ffn;  // the branch biases' gradients, from B for W
    std::unique_ptr<LayerPart::Saved> mixer, ffn;
    bool complete = false;        // false under full recompute until backward recomputes the layer
    bool inputs_dropped = false;  // RecomputeModule::norm: the parts' normed inputs are to be rebuilt
    // Set by the caller before forward: where the micro-batch's rows sit, for hidden dropout on the mixer's
    // and the feed-forward's outputs (sites stream and stream + 1; inactive by default: no dropout).
    DropoutRows dropout;
    // Set by the caller before forward: the micro-batch's MoeRouterAux (null: none), handed to the parts.
    MoeRouterAux* router_aux = nullptr;
    // Set by the caller before forward: packed documents (LayerPart::Saved::documents; null: none).
    const std::vector<int64_t>* documents = nullptr;
  };

  DecoderLayer() = default;
  // norm1, norm2: ids of the two RMSNorm weights in the store.
  DecoderLayer(ParameterStore* store, int norm1, std::unique_ptr<LayerPart> mixer, int norm2,
               std::unique_ptr<LayerPart> ffn, float norm_eps, ComputeOptions options);
  DecoderLayer(ParameterStore* store, const LayerNorms& norms, std::unique_ptr<LayerPart> mixer,
               std::unique_ptr<LayerPart> ffn, ComputeOptions options, BranchBiases biases = {});

  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const;
  Tensor backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const;
  void backward_weight(Saved& saved) const;
  // Inference over a KV cache: x is [batch * tokens, hidden] for new tokens at positions cache.length..;
  // nothing is kept for backward.
  Tensor forward_cached(const Tensor& x, int64_t batch, int64_t tokens, const KvLayer& cache) const;

  const LayerPart& mixer() const { return *mixer_; }
  const LayerPart& ffn() const { return *ffn_; }

 private:
  Tensor run_forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved, bool keep_cores) const;
  Tensor residual_add(const Tensor& x, Tensor branch) const;

  ComputeOptions options_;
  Norm norm1_, norm2_, post1_, post2_;  // post1_, post2_: absent without sandwich norms
  bool post1_on_ = false, post2_on_ = false;
  Bias mixer_bias_, ffn_bias_;  // undefined: none
  std::unique_ptr<LayerPart> mixer_, ffn_;
};

}  // namespace forge::nn
