// A part of a decoder layer: its token mixer (attention: GQA today, MLA next) or its feed-forward network
// (SwiGLU today, mixture-of-experts next). Every part follows the module contract: forward, backward_input
// (B, the critical path) and backward_weight (W, may run later), with the micro-batch's saved state owned
// by the caller. A family composes its layers from parts (nn/decoder_layer.h); the parts know nothing of
// tensor names, which the family registers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "forge/core/tensor.h"
#include "forge/nn/kv_cache.h"

namespace forge::nn {

struct MoeRouterAux;

class LayerPart {
 public:
  // What one micro-batch keeps between forward and backward; each part derives its own.
  struct Saved {
    virtual ~Saved() = default;
    // Set by the caller (DecoderLayer) before forward: the micro-batch's record of Hugging Face's
    // load-balancing loss, which MoE layers taking part in it write at forward and read in backward (null:
    // none; other parts ignore it).
    MoeRouterAux* router_aux = nullptr;
    // Set by the caller (DecoderLayer) before forward: packed documents, the lengths of the documents over
    // the micro-batch's batch * seq rows in order, each within one sequence (null: every sequence is one
    // document). Token mixers attend within each document only, its positions restarting at 0 (Megatron's
    // reset_attention_mask and reset_position_ids); other parts ignore it.
    const std::vector<int64_t>* documents = nullptr;
  };
  virtual ~LayerPart() = default;
  virtual std::unique_ptr<Saved> new_saved() const = 0;
  // h: the normed input [batch * seq, hidden] (this rank's rows under sequence parallelism); returns the
  // part's output, to be added to the residual stream. keep_all = false (selective recompute): drop what
  // backward_input can recompute cheaply.
  virtual Tensor forward(const Tensor& h, int64_t batch, int64_t seq, Saved& saved, bool keep_all) const = 0;
  // dy: the gradient of the output; returns that of h. Keeps what backward_weight needs.
  virtual Tensor backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const = 0;
  // Accumulates (+=) the weight gradients and releases the saved state.
  virtual void backward_weight(Saved& saved) const = 0;
  // Inference for new tokens at positions cache->length..; keeps nothing. cache: this layer's KV cache (null
  // for parts that keep none).
  virtual Tensor forward_cached(const Tensor& h, int64_t batch, int64_t tokens,
                                const KvLayer* cache) const = 0;
  // The dtype the part takes its input h and its output's gradient dy in (the norm before it writes h so);
  // it returns its output and h's gradient in a dtype of its own (fp32, or bf16 with bf16 activations).
  virtual DType input_dtype() const { return DType::f32; }
  // Recompute of the norms (RecomputeModule::norm): after forward, forget the normed input h kept for the
  // weight gradients; before backward_input, take it back (the norm run again, in input_dtype()). Parts that
  // keep no such input ignore both.
  virtual void drop_input(Saved&) const {}
  virtual void restore_input(const Tensor& h, Saved&) const {}
};

}  // namespace forge::nn
