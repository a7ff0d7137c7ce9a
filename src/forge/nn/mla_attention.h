// Multi-head latent attention (DeepSeek-V3's MLA, Hugging Face DeepseekV3Attention semantics). Per token h:
//   q    = q_b_proj(RMSNorm(q_a_proj(h)))  [H, dn + dr]   (or q_proj(h) without a q latent, q_lora_rank = 0)
//   kv_a = kv_a_proj_with_mqa(h)           [L + dr]: the latent c = kv_a[:L], one rope key kv_a[L:] for all
//   heads kv   = kv_b_proj(RMSNorm(c))           [H, dn + dv]: per head the key's non-rope part, then the
//   value
// RoPE (interleaved pairs under rope_interleave) on each head's q[dn:] and on the shared rope key; per head
// the query [q_nope, q_rope] attends causally to the keys [k_nope, k_rope] and values v (head_dim dn + dr,
// v_head_dim dv, the softmax scale of the config), and o_proj maps the heads' outputs back to hidden. Hugging
// Face's interleaved RoPE also moves the rotated pairs to halves; applied to q and k alike that permutation
// leaves every q.k unchanged, so forge rotates in place.
//
// Tensor parallelism (ComputeOptions::tp): the heads split over the group. q_b_proj / q_proj and kv_b_proj
// are column-parallel by heads, o_proj row-parallel (reduce_out after it); the input is gathered once
// (sequence parallelism) and feeds every projection. q_a_proj, q_a_layernorm, kv_a_proj_with_mqa and
// kv_a_layernorm are replicated: every rank computes them whole, and its gradient of them holds only its own
// heads' share. The model must sum those gradients over the group (ParameterStore::add_grad_finalizer with an
// all-reduce): replicated_params() names them. The input gradient is partial on every rank; reduce_out sums
// it.
//
// forward_cached keeps DeepSeek's compressed cache: per token the normed latent (L) and the rotated rope key
// (dr) as ONE kv head of L + dr values (576 at DeepSeek-V3 sizes), in KvLayer::keys (KvCache(layers, batch,
// capacity, 1, L + dr); the values half of the cache is written with the same rows and never read). A prompt
// into an empty cache runs the training path's per-head attention; decoding after it absorbs the projections:
// q_nope . W_kb folds the query into the latent space, multi-query attention over the cache runs at head_dim
// L + dr with v_head_dim L, the values aliasing the first L columns of the keys, and W_vb maps each head's
// latent output to its dv values (these absorbed products: fp32 GEMMs on the master weights, one per head).
#pragma once

#include <vector>

#include "forge/nn/attention.h"
#include "forge/nn/compute.h"
#include "forge/nn/kv_cache.h"
#include "forge/nn/layer_part.h"
#include "forge/nn/linear.h"
#include "forge/nn/rmsnorm.h"

namespace forge::nn {

// heads: this rank's share under tensor parallelism. softmax_scale: (dn + dr)^-0.5, times mscale^2 under YaRN
// (DeepseekV3Config::softmax_scale()). The latent norms use latent_norm_eps (1e-6 in Hugging Face, whatever
// rms_norm_eps says).
struct MlaShape {
  int64_t hidden = 0, heads = 0;
  int64_t q_lora_rank = 0;  // 0: a plain q_proj
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = true;
  float softmax_scale = 1.0f;
  float latent_norm_eps = 1e-6f;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t q_dim() const { return heads * qk_head_dim(); }
  int64_t kv_a_dim() const { return kv_lora_rank + qk_rope_head_dim; }
  int64_t kv_dim() const { return heads * (qk_nope_head_dim + v_head_dim); }
  int64_t out_dim() const { return heads * v_head_dim; }
};

// Its parameters, by id in the store (the family registers them under Hugging Face's names
// model.layers.L.self_attn.*.weight). With q_lora_rank > 0: q_a (q_a_proj [Q, hidden]), q_a_norm
// (q_a_layernorm [Q]) and q_b (q_b_proj [H (dn + dr), Q]); else q (q_proj [H (dn + dr), hidden]). kv_a
// (kv_a_proj_with_mqa [L + dr, hidden]), kv_a_norm (kv_a_layernorm [L]), kv_b (kv_b_proj [H (dn + dv), L]),
// o (o_proj [hidden, H dv]). Under tensor parallelism q_b / q, kv_b and o hold this rank's heads.
struct MlaParams {
  int q_a = -1, q_a_norm = -1, q_b = -1, q = -1;
  int kv_a = -1, kv_a_norm = -1, kv_b = -1, o = -1;
};

class MlaAttention final : public LayerPart {
 public:
  struct Saved : LayerPart::Saved {
    GemmOperand h_q, h_kv;            // the input as q_a_proj (or q_proj) and kv_a_proj_with_mqa read it
    RmsNorm::Saved q_norm, kv_norm;   // the latent norms
    GemmOperand q_latent, kv_latent;  // the normed latents as q_b_proj and kv_b_proj read them
    Tensor q, k, v;                   // the attention core's inputs: q and k [rows, H, dn + dr] after RoPE,
                                      // v [rows, H, dv] (in the activation dtype)
    Tensor rope_key;                  // recompute of the up-projections: the rotated rope key [rows, dr]
    Tensor out, lse;                  // the core's output and log-sum-exp (absent under selective recompute)
    GemmOperand out_op;               // the core's output as o_proj's operand
    GemmOperand dy, dq, dq_latent, dkv, dkv_a;  // kept from backward_input for backward_weight
  };

  MlaAttention() = default;
  // rope: cos/sin tables of qk_rope_head_dim (YaRN's attention factor folded in), for every position used.
  MlaAttention(ParameterStore* store, MlaParams params, MlaShape shape, const RopeTable* rope,
               ComputeOptions options);

  const MlaShape& shape() const { return shape_; }
  // The replicated parameters whose gradients each tensor-parallel rank holds only its heads' share of: the
  // model sums them over the group once final (empty without tensor parallelism: nothing to sum).
  std::vector<int> replicated_params() const;

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
    FORGE_CHECK(cache != nullptr, "MLA's cached inference needs a KV cache");
    return forward_cached(h, batch, tokens, *cache);
  }

  // Inference over the compressed cache (see the top of this file): h is [batch * tokens, hidden] for
  // `tokens` new tokens per sequence at positions cache.length ..; writes their latent and rope key rows into
  // the cache (committed by the caller with KvCache::advance) and attends causally over everything cached.
  // cache: one kv head of kv_lora_rank + qk_rope_head_dim. Keeps nothing for backward.
  Tensor forward_cached(const Tensor& h, int64_t batch, int64_t tokens, const KvLayer& cache) const;

 private:
  // q [rows, H (dn + dr)] and kv_a [rows, L + dr] from h, RoPE applied; keeps the operands and norm states in
  // saved (null: inference, nothing kept, and kv_a becomes the cache row [normed latent, rope key]). kv (when
  // not null): [rows, H (dn + dv)] from the normed latent.
  // dtype: q's, kv_a's, kv's and the latents' (the activation dtype in training, fp32 in inference).
  void project(const Tensor& h, int64_t batch, int64_t seq, int64_t first_position, Saved* saved, DType dtype,
               Tensor& q, Tensor& kv_a, Tensor* kv) const;
  // The core's keys [k_nope (per head), k_rope (shared)] and values into saved.k and saved.v, each head's
  // columns together.
  // k and v [rows, H, ...] from kv_b's output and the rotated rope key (rope_stride elements between rows).
  void expand_keys(const Tensor& kv, ConstElements rope_key, int64_t rope_stride, int64_t rows,
                   Saved& saved) const;
  // h_q and h_kv, the input as the first projections read it.
  void make_inputs(const Tensor& h, Saved& saved) const;
  // RecomputeModule::mla_up_proj: q (with a q LoRA), k and v again from the latents' norms' saved inputs.
  void recompute_up_projections(Saved& saved, int64_t batch, int64_t seq) const;
  // documents (LayerPart::Saved::documents): positions restart at each packed document's start.
  void rope_q(Elements q, int64_t batch, int64_t seq, bool inverse, int64_t first_position,
              const std::vector<int64_t>* documents = nullptr) const;
  void rope_k(Elements x, int64_t token_stride, int64_t batch, int64_t seq, bool inverse,
              int64_t first_position, const std::vector<int64_t>* documents = nullptr) const;
  void rope_rows(Elements x, int64_t token_stride, int64_t batch, int64_t seq, bool inverse,
                 int64_t first_position) const;
  // The core over rows [row, row + batch * seq) (a packed document: batch 1, its length).
  ops::AttentionParams core_params(const Saved& saved, int64_t batch, int64_t seq, int64_t row = 0) const;
  void core_forward(Saved& saved, int64_t batch, int64_t seq) const;

  ParameterStore* store_ = nullptr;
  MlaParams params_;
  Linear q_a_, q_b_, q_, kv_a_, kv_b_, o_;
  RmsNorm q_norm_, kv_norm_;
  MlaShape shape_;
  const RopeTable* rope_ = nullptr;
  ComputeOptions options_;
  // The input, the projections' outputs and latents, the core's q, k, v and output, the output and all their
  // gradients: bf16 under ComputeOptions::activation_dtype bf16 (with bf16 GEMMs, not FP8), else fp32. The
  // shared rope key's gradient sums the heads in fp32, and the input's gradient its two paths. Cached
  // inference stays fp32.
  DType act_dtype_ = DType::f32;
};

}  // namespace forge::nn
