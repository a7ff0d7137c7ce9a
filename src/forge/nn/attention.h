// Causal self-attention with grouped-query heads and rotary embeddings (Hugging Face Llama semantics):
// one fused q|k|v projection (with biases in some families), QK-norm in some (an RMSNorm over head_dim of
// each q and k head), RoPE on q and k in place, flash attention (over a sliding window in some), output
// projection. forward_cached is the inference path: new tokens attend to themselves and to the keys
// and values of earlier tokens kept in a KvCache, to which they append their own.
#pragma once

#include "forge/nn/bias.h"
#include "forge/nn/compute.h"
#include "forge/nn/kv_cache.h"
#include "forge/nn/layer_part.h"
#include "forge/nn/linear.h"
#include "forge/nn/rmsnorm.h"

namespace forge::nn {

struct AttentionShape {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t qkv_dim() const { return (heads + 2 * kv_heads) * head_dim; }
};

// Precomputed cos/sin tables [positions, head_dim/2].
struct RopeTable {
  int64_t positions = 0, half_dim = 0;
  Tensor cos, sin;
};

// Its parameters, by id in the store, and a layer's options: q, k, v registered one after another (one
// fused GEMM), and o; with bias (Qwen2), the q, k and v biases registered one after another from that id
// (-1: none); with q_norm and k_norm (Qwen3), the [head_dim] weights of the RMSNorms (eps norm_eps) applied
// to every q and k head before RoPE; window > 0 (Mistral): each query sees only the `window` latest keys,
// itself included (ops::AttentionParams::window). scale: the scores' factor (0: 1 / sqrt(head_dim); Gemma's
// query_pre_attn_scalar^-1/2); softcap > 0 (Gemma 2): scores soft-capped (ops::AttentionParams::softcap);
// norm_weight_offset: the QK-norms scale by weight + offset (Gemma 3: 1 + w).
struct AttentionParams {
  int q = -1, k = -1, v = -1, o = -1;
  int bias = -1;
  int q_norm = -1, k_norm = -1;
  float norm_eps = 1e-6f;
  float norm_weight_offset = 0.0f;
  int64_t window = 0;
  float scale = 0.0f;
  float softcap = 0.0f;
};

class Attention final : public LayerPart {
 public:
  struct Saved : LayerPart::Saved {
    GemmOperand h;         // input of the qkv projection (as its GEMMs read it)
    Tensor qkv;            // q|k|v after RoPE [rows, qkv_dim], in the activation dtype
    Tensor out, lse;       // attention core output and row log-sum-exp (absent under selective recompute)
    GemmOperand out_op;    // core output as the o-projection's operand (out itself when it is bf16)
    GemmOperand dy, dqkv;  // kept from backward_input for backward_weight
    Tensor dbias;          // the q|k|v biases' gradient, from backward_input for backward_weight
    RmsNorm::Saved q_norm, k_norm;  // QK-norm's inputs, packed [rows, heads * head_dim]
  };

  Attention() = default;
  // shape: this rank's heads (its tensor-parallel shard).
  Attention(ParameterStore* store, AttentionParams params, AttentionShape shape, const RopeTable* rope,
            ComputeOptions options);

  std::unique_ptr<LayerPart::Saved> new_saved() const override { return std::make_unique<Saved>(); }
  // h: normed input [batch*seq, hidden]. keep_core=false drops out/lse (recomputed in backward).
  Tensor forward(const Tensor& h, int64_t batch, int64_t seq, Saved& saved, bool keep_core) const;
  Tensor backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const;
  void backward_weight(Saved& saved) const;
  Tensor forward(const Tensor& h, int64_t batch, int64_t seq, LayerPart::Saved& saved,
                 bool keep) const override {
    return forward(h, batch, seq, static_cast<Saved&>(saved), keep);
  }
  Tensor backward_input(const Tensor& dy, int64_t batch, int64_t seq,
                        LayerPart::Saved& saved) const override {
    return backward_input(dy, batch, seq, static_cast<Saved&>(saved));
  }
  void backward_weight(LayerPart::Saved& saved) const override {
    backward_weight(static_cast<Saved&>(saved));
  }
  DType input_dtype() const override { return act_dtype_; }
  void drop_input(LayerPart::Saved& saved) const override;
  void restore_input(const Tensor& h, LayerPart::Saved& saved) const override;
  Tensor forward_cached(const Tensor& h, int64_t batch, int64_t tokens, const KvLayer* cache) const override {
    FORGE_CHECK(cache != nullptr, "attention's cached inference needs a KV cache");
    return forward_cached(h, batch, tokens, *cache);
  }

  // Inference: h is [batch * tokens, hidden] for `tokens` new tokens per sequence at positions
  // cache.length .. cache.length + tokens - 1. Writes their keys (after RoPE) and values into the cache at
  // those positions (the caller commits them with KvCache::advance once every layer ran) and attends
  // causally over everything cached. Keeps nothing for backward.
  Tensor forward_cached(const Tensor& h, int64_t batch, int64_t tokens, const KvLayer& cache) const;

 private:
  // documents (LayerPart::Saved::documents): attention within each packed document, one call of the kernel
  // per document (its keys only: no mask tensor, and the work of the documents' triangles alone).
  void core_forward(Tensor& qkv, int64_t batch, int64_t seq, const std::vector<int64_t>* documents,
                    Tensor& out, Tensor& lse) const;
  void apply_rope(Elements qkv, int64_t batch, int64_t seq, bool inverse, int64_t first_position = 0) const;
  // Training's RoPE: at positions 0.. of each sequence (of each packed document), or under context
  // parallelism each local half at its global positions.
  void rope_for_training(Elements qkv, int64_t batch, int64_t seq, const std::vector<int64_t>* documents,
                         bool inverse) const;
  // QK-norm in place on the q and k columns of qkv [rows, qkv_dim], and its B (on dqkv); W is the norms'.
  void qk_norm_forward(Tensor& qkv, RmsNorm::Saved& q_saved, RmsNorm::Saved& k_saved) const;
  void qk_norm_backward_input(Tensor& dqkv, Saved& saved) const;
  // The core's parameters over q|k|v [batch * seq, qkv_dim] (mask, window, scale, layout).
  ops::AttentionParams core_params(ConstElements qkv, int64_t batch, int64_t seq) const;

  Linear qkv_, o_;
  Bias qkv_bias_;  // undefined: no biases
  RmsNorm q_norm_, k_norm_;
  bool qk_norm_ = false;
  AttentionShape shape_;
  const RopeTable* rope_ = nullptr;
  ComputeOptions options_;
  int64_t window_ = 0;
  float scale_ = 0.0f, softcap_ = 0.0f;
  // The input, q|k|v, the core's output, the output and all their gradients: bf16 under
  // ComputeOptions::activation_dtype bf16 (with bf16 GEMMs, not FP8), else fp32. Cached inference returns
  // fp32.
  DType act_dtype_ = DType::f32;
};

}  // namespace forge::nn
