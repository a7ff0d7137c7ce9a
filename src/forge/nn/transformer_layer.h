// One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)). Its three entry points follow the
// module contract: forward, backward_input (B, the critical path) and backward_weight (W, may run later).
#pragma once

#include <string>

#include "forge/nn/attention.h"
#include "forge/nn/mlp.h"
#include "forge/nn/rmsnorm.h"

namespace forge::nn {

// Global shapes (the whole model) and this rank's place in the tensor-parallel group: the layer registers
// only its shard. Attention heads split over tp; kv heads too when tp divides them, else each rank keeps
// the one kv head its query heads read (replicated over tp / kv_heads ranks).
struct LayerShape {
  AttentionShape attention;
  int64_t ffn = 0;
  float norm_eps = 1e-5f;
  int tp_rank = 0, tp_size = 1;
  AttentionShape local_attention() const;  // heads and kv heads of this rank
};

class TransformerLayer {
 public:
  struct Saved {
    Tensor x;  // layer input (always kept)
    RmsNorm::Saved norm1, norm2;
    Attention::Saved attention;
    Mlp::Saved mlp;
    bool complete = false;  // false under full recompute until backward recomputes the layer
  };

  TransformerLayer() = default;
  // Registers this layer's parameters under Hugging Face names "model.layers.{index}.*".
  TransformerLayer(ParameterStore* store, int index, LayerShape shape, float init_std, int num_layers);
  // Binds the registered parameters; call once the store is allocated.
  void bind(const RopeTable* rope, ComputeOptions options);

  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const;
  Tensor backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const;
  void backward_weight(Saved& saved) const;
  // Once per optimizer step, after the last micro-batch's backward_weight: sums over the tensor-parallel
  // group the gradients that several ranks hold copies of and each saw only part of (norm weights under
  // sequence parallelism, kv heads replicated over ranks).
  void reduce_replicated_grads() const;
  int first_param() const { return norm1_id_; }  // the layer's parameters are adjacent from here

  // Inference over a KV cache (see Attention::forward_cached): x is [batch * tokens, hidden] for new tokens
  // at positions cache.length.. of each sequence; nothing is kept for backward.
  Tensor forward_cached(const Tensor& x, int64_t batch, int64_t tokens, const KvLayer& cache) const;

 private:
  Tensor run_forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved, bool keep_cores) const;

  ParameterStore* store_ = nullptr;
  LayerShape shape_;
  int norm1_id_ = -1, q_id_ = -1, o_id_ = -1, norm2_id_ = -1, gate_id_ = -1, down_id_ = -1;
  ComputeOptions options_;
  RmsNorm norm1_, norm2_;
  Attention attention_;
  Mlp mlp_;
};

}  // namespace forge::nn
