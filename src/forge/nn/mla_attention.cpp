#include "forge/nn/mla_attention.h"

#include <algorithm>

#include "forge/kernels/ops.h"
#include "forge/nn/context_parallel.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {
namespace {

// dst[r, g, :width] (+)= src[r, g, :width] for r < rows, g < groups: rows src_stride / dst_stride elements
// apart, groups src_group / dst_group apart (src_group 0: one source row for every group), fp32 or bf16 on
// either side (a bf16 destination rounds once; fp32 to fp32 and bf16 to bf16 are bitwise copies).
void copy_rows(ConstElements src, int64_t src_stride, Elements dst, int64_t dst_stride, int64_t rows,
               int64_t width, Device device, int64_t groups = 1, int64_t src_group = 0, int64_t dst_group = 0,
               bool accumulate = false) {
  if (rows == 0) return;
  ops::StridedCopyParams p;
  p.shape[0] = rows, p.shape[1] = groups, p.shape[2] = width;
  p.src = src, p.src_stride[0] = src_stride, p.src_stride[1] = src_group;
  p.dst = dst, p.dst_stride[0] = dst_stride, p.dst_stride[1] = dst_group;
  p.accumulate = accumulate;
  ops::strided_copy(p, device);
}

}  // namespace

MlaAttention::MlaAttention(ParameterStore* store, MlaParams params, MlaShape shape, const RopeTable* rope,
                           ComputeOptions options)
    : store_(store),
      params_(params),
      shape_(shape),
      rope_(rope),
      options_(options),
      act_dtype_(options.part_dtype()) {
  const MlaShape& s = shape_;
  FORGE_CHECK(s.hidden > 0 && s.heads > 0 && s.kv_lora_rank > 0 && s.qk_nope_head_dim > 0 &&
                  s.qk_rope_head_dim > 0 && s.qk_rope_head_dim % 2 == 0 && s.v_head_dim > 0 &&
                  s.q_lora_rank >= 0,
              "MLA: bad shape hidden {} heads {} q_lora {} kv_lora {} nope {} rope {} v {}", s.hidden,
              s.heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim);
  FORGE_CHECK(rope && rope->half_dim * 2 == s.qk_rope_head_dim,
              "MLA: RoPE tables of {} dims for a rope head of {}", rope ? rope->half_dim * 2 : 0,
              s.qk_rope_head_dim);
  if (s.q_lora_rank > 0) {
    q_a_ = Linear(store, {params.q_a}, s.hidden, options);
    q_norm_ = RmsNorm(store, params.q_a_norm, s.latent_norm_eps);
    q_b_ = Linear(store, {params.q_b}, s.q_lora_rank, options);
    FORGE_CHECK(q_a_.out_features() == s.q_lora_rank && q_b_.out_features() == s.q_dim(),
                "MLA: q_a_proj gives {} rows (q_lora_rank {}), q_b_proj {} (expected {})",
                q_a_.out_features(), s.q_lora_rank, q_b_.out_features(), s.q_dim());
  } else {
    q_ = Linear(store, {params.q}, s.hidden, options);
    FORGE_CHECK(q_.out_features() == s.q_dim(), "MLA: q_proj gives {} rows, expected {}", q_.out_features(),
                s.q_dim());
  }
  kv_a_ = Linear(store, {params.kv_a}, s.hidden, options);
  kv_norm_ = RmsNorm(store, params.kv_a_norm, s.latent_norm_eps);
  kv_b_ = Linear(store, {params.kv_b}, s.kv_lora_rank, options);
  o_ = Linear(store, {params.o}, s.out_dim(), options);
  FORGE_CHECK(kv_a_.out_features() == s.kv_a_dim() && kv_b_.out_features() == s.kv_dim() &&
                  o_.out_features() == s.hidden,
              "MLA: kv_a_proj_with_mqa gives {} rows (expected {}), kv_b_proj {} (expected {}), o_proj {} "
              "(expected {})",
              kv_a_.out_features(), s.kv_a_dim(), kv_b_.out_features(), s.kv_dim(), o_.out_features(),
              s.hidden);
}

std::vector<int> MlaAttention::replicated_params() const {
  if (options_.tp_size() <= 1) return {};
  if (shape_.q_lora_rank > 0) return {params_.q_a, params_.q_a_norm, params_.kv_a, params_.kv_a_norm};
  return {params_.kv_a, params_.kv_a_norm};
}

// Each head's rope columns q[:, h, dn:]: the rope op takes heads head_dim apart, so one call per head.
void MlaAttention::rope_q(Elements q, int64_t batch, int64_t seq, bool inverse, int64_t first_position,
                          const std::vector<int64_t>* documents) const {
  for (int64_t h = 0; h < shape_.heads; ++h)
    rope_k(q + h * shape_.qk_head_dim() + shape_.qk_nope_head_dim, shape_.q_dim(), batch, seq, inverse,
           first_position, documents);
}

void MlaAttention::rope_k(Elements x, int64_t token_stride, int64_t batch, int64_t seq, bool inverse,
                          int64_t first_position, const std::vector<int64_t>* documents) const {
  if (documents) {
    int64_t row = 0;
    for (const int64_t length : *documents) {
      rope_rows(x + row * token_stride, token_stride, 1, length, inverse, 0);
      row += length;
    }
    return;
  }
  if (!options_.cp) return rope_rows(x, token_stride, batch, seq, inverse, first_position);
  // Context parallelism (training only): each sequence's two local chunks at their global positions.
  const int64_t half = seq / 2;
  for (int64_t b = 0; b < batch; ++b)
    for (int h = 0; h < 2; ++h)
      rope_rows(x + (b * seq + h * half) * token_stride, token_stride, 1, half, inverse,
                options_.cp->first_position(h, seq));
}

void MlaAttention::rope_rows(Elements x, int64_t token_stride, int64_t batch, int64_t seq, bool inverse,
                             int64_t first_position) const {
  FORGE_CHECK(first_position + seq <= rope_->positions,
              "positions up to {} exceed the RoPE table ({} positions)", first_position + seq,
              rope_->positions);
  ops::RopeParams p;
  p.batch = batch, p.seq = seq, p.heads = 1, p.head_dim = shape_.qk_rope_head_dim,
  p.token_stride = token_stride;
  p.x = x, p.cos = rope_->cos.f32(), p.sin = rope_->sin.f32(), p.inverse = inverse;
  p.position_offset = first_position, p.interleaved = shape_.rope_interleave;
  ops::rope(p, options_.device);
}

void MlaAttention::project(const Tensor& h, int64_t batch, int64_t seq, int64_t first_position, Saved* saved,
                           DType dtype, Tensor& q, Tensor& kv_a, Tensor* kv) const {
  const MlaShape& s = shape_;
  const int64_t rows = batch * seq, L = s.kv_lora_rank;
  Saved local;
  Saved& keep = saved ? *saved : local;
  make_inputs(h, keep);
  if (s.q_lora_rank > 0) {
    Tensor q_latent = q_norm_.forward(q_a_.forward(keep.h_q, dtype), keep.q_norm, dtype);
    keep.q_latent = q_b_.input(q_latent);
    q = q_b_.forward(keep.q_latent, dtype);
  } else {
    q = q_.forward(keep.h_q, dtype);
  }
  const std::vector<int64_t>* documents = saved ? saved->documents : nullptr;
  rope_q(q.elements(), batch, seq, false, first_position, documents);

  kv_a = kv_a_.forward(keep.h_kv, dtype);
  Tensor latent = Tensor::empty({rows, L}, dtype, options_.device);
  copy_rows(kv_a.elements(), s.kv_a_dim(), latent.elements(), L, rows, L, options_.device);
  rope_k(kv_a.elements() + L, s.kv_a_dim(), batch, seq, false, first_position, documents);
  Tensor kv_latent = kv_norm_.forward(latent, keep.kv_norm, dtype);
  if (!saved)  // inference: the cache row is [normed latent, rotated rope key]
    copy_rows(kv_latent.elements(), L, kv_a.elements(), s.kv_a_dim(), rows, L, options_.device);
  if (!kv) return;
  keep.kv_latent = kv_b_.input(kv_latent);
  *kv = kv_b_.forward(keep.kv_latent, dtype);
}

void MlaAttention::expand_keys(const Tensor& kv, ConstElements rope_key, int64_t rope_stride, int64_t rows,
                               Saved& saved) const {
  const MlaShape& s = shape_;
  const int64_t H = s.heads, dn = s.qk_nope_head_dim, dr = s.qk_rope_head_dim, dv = s.v_head_dim;
  const int64_t qk = s.qk_head_dim(), kv_head = dn + dv;
  saved.k = Tensor::empty({rows, s.q_dim()}, kv.dtype(), options_.device);
  saved.v = Tensor::empty({rows, s.out_dim()}, kv.dtype(), options_.device);
  copy_rows(kv.elements(), kv_head, saved.k.elements(), qk, rows * H, dn, options_.device);
  copy_rows(kv.elements() + dn, kv_head, saved.v.elements(), dv, rows * H, dv, options_.device);
  // The shared rope key into every head.
  copy_rows(rope_key, rope_stride, saved.k.elements() + dn, s.q_dim(), rows, dr, options_.device, H, 0, qk);
}

ops::AttentionParams MlaAttention::core_params(const Saved& saved, int64_t batch, int64_t seq,
                                               int64_t row) const {
  ops::AttentionParams p;
  p.batch = batch, p.seq = seq, p.heads = shape_.heads, p.kv_heads = shape_.heads;
  p.head_dim = shape_.qk_head_dim(), p.v_head_dim = shape_.v_head_dim;
  p.q = saved.q.elements() + row * shape_.q_dim(), p.k = saved.k.elements() + row * shape_.q_dim();
  p.v = saved.v.elements() + row * shape_.out_dim();
  p.q_stride = p.k_stride = shape_.q_dim(), p.v_stride = shape_.out_dim();
  p.out_stride = shape_.out_dim();
  p.scale = shape_.softmax_scale;
  p.causal = true;
  return p;
}

void MlaAttention::core_forward(Saved& saved, int64_t batch, int64_t seq) const {
  saved.out = Tensor::empty({batch * seq, shape_.out_dim()}, saved.q.dtype(), options_.device);
  saved.lse = Tensor::empty({batch, shape_.heads, seq}, DType::f32, options_.device);
  if (saved.documents) {  // lse holds [heads, length] per document, in order
    int64_t row = 0;
    for (const int64_t length : *saved.documents) {
      ops::AttentionParams p = core_params(saved, 1, length, row);
      p.out = saved.out.elements() + row * shape_.out_dim(), p.lse = saved.lse.f32() + row * shape_.heads;
      ops::attention_forward(p, options_.device);
      row += length;
    }
    return;
  }
  ops::AttentionParams p = core_params(saved, batch, seq);
  p.out = saved.out.elements(), p.lse = saved.lse.f32();
  if (options_.cp)
    options_.cp->attention_forward(p);
  else
    ops::attention_forward(p, options_.device);
}

Tensor MlaAttention::forward(const Tensor& h, int64_t batch, int64_t seq, Saved& saved,
                             bool keep_core) const {
  Tensor kv_a, kv;
  project(gather_in(options_.tp, h), batch, seq, 0, &saved, act_dtype_, saved.q, kv_a, &kv);
  const int64_t rows = batch * seq, L = shape_.kv_lora_rank, dr = shape_.qk_rope_head_dim;
  expand_keys(kv, kv_a.elements() + L, shape_.kv_a_dim(), rows, saved);
  core_forward(saved, batch, seq);
  saved.out_op = o_.input(saved.out);
  Tensor y = o_.forward(saved.out_op, act_dtype_);
  if (!keep_core && options_.recomputes(RecomputeModule::core_attn))
    saved.out = Tensor(), saved.lse = Tensor(), saved.out_op = GemmOperand{};
  if (!keep_core && options_.recomputes(RecomputeModule::mla_up_proj)) {
    saved.rope_key = Tensor::empty({rows, dr}, kv_a.dtype(), options_.device);
    copy_rows(kv_a.elements() + L, shape_.kv_a_dim(), saved.rope_key.elements(), dr, rows, dr,
              options_.device);
    if (shape_.q_lora_rank > 0) saved.q = Tensor();  // without a LoRA q comes from h: kept
    saved.k = Tensor(), saved.v = Tensor();
  }
  return reduce_out(options_.tp, y);
}

void MlaAttention::recompute_up_projections(Saved& saved, int64_t batch, int64_t seq) const {
  const DType dtype = act_dtype_;
  if (!saved.q.defined()) {
    RmsNorm::Saved scratch;
    GemmOperand latent = q_b_.input(q_norm_.forward(saved.q_norm.x, scratch, dtype));
    saved.q = q_b_.forward(latent, dtype);
    rope_q(saved.q.elements(), batch, seq, false, 0, saved.documents);
  }
  RmsNorm::Saved scratch;
  GemmOperand latent = kv_b_.input(kv_norm_.forward(saved.kv_norm.x, scratch, dtype));
  const Tensor kv = kv_b_.forward(latent, dtype);
  expand_keys(kv, saved.rope_key.elements(), shape_.qk_rope_head_dim, batch * seq, saved);
  saved.rope_key = Tensor();
}

void MlaAttention::drop_input(LayerPart::Saved& base) const {
  Saved& saved = static_cast<Saved&>(base);
  saved.h_q = GemmOperand{}, saved.h_kv = GemmOperand{};
}

// Without FP8 both projections read h in the GEMM dtype: one conversion, shared (an FP8 operand carries its
// own Linear's scales).
void MlaAttention::make_inputs(const Tensor& h, Saved& saved) const {
  const Linear& q_in = shape_.q_lora_rank > 0 ? q_a_ : q_;
  saved.h_q = q_in.input(h);
  saved.h_kv = kv_a_.fp8() || q_in.fp8() ? kv_a_.input(h) : saved.h_q;
}

void MlaAttention::restore_input(const Tensor& h, LayerPart::Saved& base) const {
  Saved& saved = static_cast<Saved&>(base);
  make_inputs(gather_in(options_.tp, h), saved);
  (shape_.q_lora_rank > 0 ? q_a_ : q_).keep_for_backward(saved.h_q);
  kv_a_.keep_for_backward(saved.h_kv);
}

Tensor MlaAttention::backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const {
  const MlaShape& s = shape_;
  const int64_t rows = batch * seq, H = s.heads, dn = s.qk_nope_head_dim, dr = s.qk_rope_head_dim;
  const int64_t dv = s.v_head_dim, qk = s.qk_head_dim(), kv_head = dn + dv, L = s.kv_lora_rank;
  const Device device = options_.device;
  if (!saved.k.defined()) recompute_up_projections(saved, batch, seq);
  if (!saved.out.defined()) {  // selective recompute of the attention core
    core_forward(saved, batch, seq);
    saved.out_op = o_.input(saved.out);
    o_.keep_for_backward(saved.out_op);
  }
  saved.dy = o_.grad_output(gather_in(options_.tp, dy));
  const DType dtype = act_dtype_;
  Tensor dout = o_.backward_input(saved.dy, dtype);

  Tensor dq = Tensor::empty({rows, s.q_dim()}, dtype, device);
  Tensor dk = Tensor::empty({rows, s.q_dim()}, dtype, device);
  Tensor dvalue = Tensor::empty({rows, s.out_dim()}, dtype, device);
  auto params = [&](int64_t row, int64_t b, int64_t t) {
    ops::AttentionParams p = core_params(saved, b, t, row);
    p.out = saved.out.elements() + row * s.out_dim(), p.lse = saved.lse.f32() + row * H;
    p.dout = dout.elements() + row * s.out_dim(), p.dout_stride = s.out_dim();
    p.dq = dq.elements() + row * s.q_dim(), p.dk = dk.elements() + row * s.q_dim();
    p.dv = dvalue.elements() + row * s.out_dim();
    p.dq_stride = p.dk_stride = s.q_dim(), p.dv_stride = s.out_dim();
    return p;
  };
  if (saved.documents) {
    int64_t row = 0;
    for (const int64_t length : *saved.documents) {
      ops::attention_backward(params(row, 1, length), device);
      row += length;
    }
  } else if (options_.cp) {
    options_.cp->attention_backward(params(0, batch, seq));
  } else {
    ops::attention_backward(params(0, batch, seq), device);
  }
  // The core is no longer needed; o_proj's weight gradient keeps out_op.
  saved.out = Tensor(), saved.lse = Tensor(), saved.q = Tensor(), saved.k = Tensor(), saved.v = Tensor();
  rope_q(dq.elements(), batch, seq, true, 0, saved.documents);

  // kv_b_proj's output gradient: per head [dk_nope, dv].
  Tensor dkv = Tensor::empty({rows, s.kv_dim()}, dtype, device);
  copy_rows(dk.elements(), qk, dkv.elements(), kv_head, rows * H, dn, device);
  copy_rows(dvalue.elements(), dv, dkv.elements() + dn, kv_head, rows * H, dv, device);
  // The shared rope key's gradient is the sum over heads of their rope columns, in fp32 and head order;
  // rotated back, it is kv_a's last dr columns.
  Tensor rope_key = Tensor::empty({rows, dr}, DType::f32, device);
  for (int64_t head = 0; head < H; ++head)
    copy_rows(dk.elements() + head * qk + dn, s.q_dim(), rope_key.elements(), dr, rows, dr, device, 1, 0, 0,
              /*accumulate=*/head > 0);
  rope_k(rope_key.elements(), dr, batch, seq, true, 0, saved.documents);
  dk = Tensor(), dvalue = Tensor();

  saved.dkv = kv_b_.grad_output(dkv);
  Tensor dlatent = kv_norm_.backward_input(kv_b_.backward_input(saved.dkv, dtype), saved.kv_norm, dtype);
  Tensor dkv_a = Tensor::empty({rows, s.kv_a_dim()}, dtype, device);
  copy_rows(dlatent.elements(), L, dkv_a.elements(), s.kv_a_dim(), rows, L, device);
  copy_rows(rope_key.elements(), dr, dkv_a.elements() + L, s.kv_a_dim(), rows, dr, device);
  rope_key = Tensor();
  saved.dkv_a = kv_a_.grad_output(dkv_a);
  // The input's gradient sums the kv and q paths' in fp32, rounded once to the activation dtype.
  Tensor dh = kv_a_.backward_input(saved.dkv_a);

  Tensor dh_q;
  if (s.q_lora_rank > 0) {
    saved.dq = q_b_.grad_output(dq);
    Tensor dq_latent = q_norm_.backward_input(q_b_.backward_input(saved.dq, dtype), saved.q_norm, dtype);
    saved.dq_latent = q_a_.grad_output(dq_latent);
    dh_q = q_a_.backward_input(saved.dq_latent);
  } else {
    saved.dq = q_.grad_output(dq);
    dh_q = q_.backward_input(saved.dq);
  }
  ops::add_inplace(dh.elements(), dh_q.elements(), dh.numel(), device);
  return reduce_out(options_.tp, to_dtype(dh, dtype));
}

void MlaAttention::backward_weight(Saved& saved) const {
  o_.backward_weight(saved.dy, saved.out_op);
  kv_b_.backward_weight(saved.dkv, saved.kv_latent);
  kv_norm_.backward_weight(saved.kv_norm);
  kv_a_.backward_weight(saved.dkv_a, saved.h_kv);
  if (shape_.q_lora_rank > 0) {
    q_b_.backward_weight(saved.dq, saved.q_latent);
    q_norm_.backward_weight(saved.q_norm);
    q_a_.backward_weight(saved.dq_latent, saved.h_q);
  } else {
    q_.backward_weight(saved.dq, saved.h_q);
  }
  saved = Saved{};
}

Tensor MlaAttention::forward_cached(const Tensor& h, int64_t batch, int64_t tokens,
                                    const KvLayer& cache) const {
  const MlaShape& s = shape_;
  FORGE_CHECK(options_.tp_size() <= 1 && options_.cp == nullptr,
              "cached inference runs on one process (tensor and context parallelism are for training)");
  FORGE_CHECK(
      cache.keys && cache.kv_heads == 1 && cache.head_dim == s.kv_a_dim(),
      "MLA's compressed cache holds 1 kv head of kv_lora_rank + qk_rope_head_dim = {} values, not {} x {}",
      s.kv_a_dim(), cache.kv_heads, cache.head_dim);
  FORGE_CHECK(batch == cache.batch && tokens > 0 && h.numel() == batch * tokens * s.hidden,
              "cached MLA: {} tokens x batch {} (cache batch {}) do not match an input of {} elements",
              tokens, batch, cache.batch, h.numel());
  if (cache.length + tokens > cache.capacity)
    fail("KV cache full: {} cached + {} new tokens exceed its capacity of {} positions", cache.length, tokens,
         cache.capacity);
  const int64_t rows = batch * tokens, H = s.heads, dn = s.qk_nope_head_dim, dv = s.v_head_dim;
  const int64_t L = s.kv_lora_rank, qk = s.qk_head_dim(), row = s.kv_a_dim(), kv_head = dn + dv;
  const Device device = options_.device;
  // A prompt into an empty cache attends only to itself: the training path's per-head keys and values, at
  // head_dim dn + dr and dv (a third of the absorbed form's work per query-key pair at DeepSeek-V3's sizes).
  const bool prefill = cache.length == 0;
  Tensor q, kv_a, kv;
  project(h, batch, tokens, cache.length, nullptr, DType::f32, q, kv_a, prefill ? &kv : nullptr);
  ops::KvAppendParams append;
  append.batch = batch, append.tokens = tokens, append.kv_heads = 1, append.head_dim = row;
  append.qkv = kv_a.f32(), append.qkv_stride = row, append.k_offset = 0, append.v_offset = 0;
  append.keys = cache.keys, append.values = cache.values;
  append.batch_stride = cache.batch_stride(), append.head_stride = cache.head_stride();
  append.position = cache.length;
  ops::kv_append(append, device);
  if (prefill) {
    Saved core;
    core.q = q;
    expand_keys(kv, kv_a.elements() + shape_.kv_lora_rank, shape_.kv_a_dim(), rows, core);
    core_forward(core, batch, tokens);
    GemmOperand out_op = o_.input(core.out);
    return o_.forward(out_op);
  }

  // Absorbed queries [rows, H, L + dr]: q_nope_h . W_kb_h (W_kb_h = kv_b_proj's rows of head h's k_nope, [dn,
  // L]), then the rotated q_rope_h.
  // fp32 weights; where the distributed optimizer holds them (sampling from a training model), the bf16
  // ones widened, one layer's at a time.
  const ParamInfo& kv_b_info = store_->info(params_.kv_b);
  const Tensor kv_b =
      store_->keeps_fp32(params_.kv_b)
          ? store_->param(params_.kv_b)
          : to_dtype(store_->params_bf16().view(kv_b_info.offset, kv_b_info.shape), DType::f32);
  const float* w_kv_b = kv_b.f32();
  Tensor query = Tensor::empty({rows, H * row}, DType::f32, device);
  for (int64_t head = 0; head < H; ++head) {
    ops::GemmParams g;
    g.m = rows, g.n = L, g.k = dn;
    g.a = q.f32() + head * qk, g.lda = s.q_dim();
    g.b = w_kv_b + head * kv_head * L, g.ldb = L;
    g.c = query.f32() + head * row, g.ldc = H * row;
    ops::gemm(g, device);
  }
  copy_rows(q.elements() + dn, qk, query.elements() + L, row, rows * H, s.qk_rope_head_dim, device);

  // Multi-query attention over the cache: one kv head of L + dr, values its first L columns.
  Tensor latent_out = Tensor::empty({rows, H * L}, DType::f32, device);
  ops::AttentionParams p;
  p.batch = batch, p.seq = tokens, p.heads = H, p.kv_heads = 1, p.head_dim = row, p.v_head_dim = L;
  p.q = query.f32(), p.q_stride = H * row;
  p.k = cache.keys, p.v = cache.keys, p.k_stride = p.v_stride = row;
  p.k_head_stride = p.v_head_stride = cache.head_stride();
  p.k_batch_stride = p.v_batch_stride = cache.batch_stride();
  p.kv_seq = cache.length + tokens, p.q_offset = cache.length;
  p.out = latent_out.f32(), p.out_stride = H * L, p.lse = nullptr;
  p.scale = s.softmax_scale;
  p.causal = true;
  ops::attention_forward(p, device);

  // Each head's values: latent output . W_vb_h^T (W_vb_h = kv_b_proj's rows of head h's v, [dv, L]).
  Tensor out = Tensor::empty({rows, s.out_dim()}, DType::f32, device);
  for (int64_t head = 0; head < H; ++head) {
    ops::GemmParams g;
    g.m = rows, g.n = dv, g.k = L;
    g.a = latent_out.f32() + head * L, g.lda = H * L;
    g.b = w_kv_b + (head * kv_head + dn) * L, g.ldb = L, g.trans_b = true;
    g.c = out.f32() + head * dv, g.ldc = s.out_dim();
    ops::gemm(g, device);
  }
  GemmOperand out_op = o_.input(out);
  return o_.forward(out_op);
}

}  // namespace forge::nn
