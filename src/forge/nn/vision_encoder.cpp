#include "forge/nn/vision_encoder.h"

#include <algorithm>
#include <cmath>

#include "forge/core/error.h"

namespace forge::nn {
namespace {

// The encoder runs whole on every rank: no tensor parallelism, no context split; FP8 in its layers only with
// Fp8Options::vision.
ComputeOptions unsplit(ComputeOptions o) {
  o.tp = nullptr, o.cp = nullptr, o.ep = nullptr;
  if (o.fp8 && !o.fp8->options().vision) o.fp8 = nullptr;
  return o;
}

// dst [rows, dst_ld] columns [column, column + cols) (+)= src [rows, src_ld] columns [0, cols).
void copy_columns(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows, int64_t cols,
                  bool accumulate, Device device) {
  ops::StridedCopyParams p;
  p.shape[0] = 1, p.shape[1] = rows, p.shape[2] = cols;
  p.src = src, p.src_stride[1] = src_ld;
  p.dst = dst, p.dst_stride[1] = dst_ld;
  p.accumulate = accumulate;
  ops::strided_copy(p, device);
}

}  // namespace

VisionEncoder::VisionEncoder(ParameterStore* store, VisionEncoderParams params, VisionEncoderShape shape,
                             const ComputeOptions& options)
    : store_(store), params_(std::move(params)), shape_(shape), options_(unsplit(options)) {
  FORGE_CHECK(shape_.hidden > 0 && shape_.heads > 0 && shape_.hidden % shape_.heads == 0 &&
                  shape_.patches > 0 && shape_.patch_dim > 0,
              "vision encoder: hidden {} over {} heads, {} patches of {} values", shape_.hidden, shape_.heads,
              shape_.patches, shape_.patch_dim);
  const VisionEncoderParams& p = params_;
  ComputeOptions patch_options =
      options_;                 // K = channels x patch^2: no FP8 tensor-core shape, and the pixels
  patch_options.fp8 = nullptr;  // deserve the GEMM dtype
  patch_ = Linear(store, {p.patch}, shape_.patch_dim, patch_options);
  if (p.patch_bias >= 0) patch_bias_ = Bias(store, {p.patch_bias});
  FORGE_CHECK((p.class_embedding >= 0) == shape_.class_token,
              "vision encoder: class token parameter mismatch");
  if (p.class_embedding >= 0) store->keep_fp32(p.class_embedding);  // both added in fp32
  store->keep_fp32(p.position);
  if (shape_.pre_norm) pre_norm_ = LayerNorm(store, p.pre_norm_weight, p.pre_norm_bias, shape_.eps);
  for (const VisionLayerParams& l : p.layers) {
    Layer layer;
    layer.norm1 = LayerNorm(store, l.norm1_weight, l.norm1_bias, shape_.eps);
    layer.norm2 = LayerNorm(store, l.norm2_weight, l.norm2_bias, shape_.eps);
    layer.qkv = Linear(store, {l.q, l.k, l.v}, shape_.hidden, options_);
    layer.qkv_bias = Bias(store, {l.q_bias, l.k_bias, l.v_bias});
    layer.out = Linear(store, {l.out}, shape_.hidden, options_);
    layer.out_bias = Bias(store, {l.out_bias});
    layer.fc1 = Linear(store, {l.fc1}, shape_.hidden, options_);
    layer.fc1_bias = Bias(store, {l.fc1_bias});
    layer.fc2 = Linear(store, {l.fc2}, shape_.ffn, options_);
    layer.fc2_bias = Bias(store, {l.fc2_bias});
    layers_.push_back(std::move(layer));
  }
}

Tensor VisionEncoder::embed(const Tensor& patches, int64_t images, Saved* saved) const {
  const int64_t h = shape_.hidden, n = shape_.patches, positions = shape_.positions();
  const Device device = options_.device;
  FORGE_CHECK(patches.numel() == images * n * shape_.patch_dim,
              "vision encoder: {} patch values for {} images of {} patches x {}", patches.numel(), images, n,
              shape_.patch_dim);
  GemmOperand in = patch_.input(patches.reshape({images * n, shape_.patch_dim}));
  Tensor embedded = patch_.forward(in);  // [images * patches, hidden]
  if (saved) saved->patches = std::move(in);
  if (patch_bias_.defined()) patch_bias_.forward(embedded);
  Tensor x = embedded;
  if (shape_.class_token) {
    x = Tensor::empty({images * positions, h}, DType::f32, device);
    // Row 0 of each image: the class token (added below to a zero row: copy_columns of one row per image).
    const float* cls = store_->param(params_.class_embedding).f32();
    ops::StridedCopyParams c;
    c.shape[0] = 1, c.shape[1] = images, c.shape[2] = h;
    c.src = cls, c.src_stride[1] = 0;
    c.dst = x.f32(), c.dst_stride[1] = positions * h;
    ops::strided_copy(c, device);
    ops::StridedCopyParams r;
    r.shape[0] = images, r.shape[1] = n, r.shape[2] = h;
    r.src = embedded.f32(), r.src_stride[0] = n * h, r.src_stride[1] = h;
    r.dst = x.f32() + h, r.dst_stride[0] = positions * h, r.dst_stride[1] = h;
    ops::strided_copy(r, device);
  }
  ops::BiasParams pos;  // the position embeddings, the same for every image
  pos.rows = images, pos.n = positions * h, pos.y = x.f32(), pos.bias = store_->param(params_.position).f32();
  ops::bias_add(pos, device);
  if (!shape_.pre_norm) return x;
  if (saved) return pre_norm_.forward(x, saved->pre_norm);
  return pre_norm_.forward(x);
}

void VisionEncoder::attention(const Tensor& qkv, int64_t images, Tensor& core, Tensor& lse) const {
  const int64_t h = shape_.hidden, positions = shape_.positions();
  core = Tensor::empty({images * positions, h}, DType::f32, options_.device);
  lse = Tensor::empty({images, shape_.heads, positions}, DType::f32, options_.device);
  ops::AttentionParams p;
  p.batch = images, p.seq = positions, p.heads = p.kv_heads = shape_.heads, p.head_dim = shape_.head_dim();
  p.q = qkv.f32(), p.k = p.q + h, p.v = p.q + 2 * h;
  p.q_stride = p.k_stride = p.v_stride = 3 * h;
  p.out = core.f32(), p.out_stride = h, p.lse = lse.f32();
  p.scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim()));
  p.causal = false;  // every patch sees every patch
  ops::attention_forward(p, options_.device);
}

Tensor VisionEncoder::layer_forward(const Layer& l, const Tensor& x, int64_t images,
                                    LayerSaved* saved) const {
  LayerSaved scratch;
  LayerSaved& s = saved ? *saved : scratch;
  Tensor h1 = l.norm1.forward(x, s.norm1);
  s.qkv_in = l.qkv.input(h1);
  s.qkv = l.qkv.forward(s.qkv_in);
  l.qkv_bias.forward(s.qkv);
  attention(s.qkv, images, s.core, s.lse);
  s.out_in = l.out.input(s.core);
  Tensor x2 = l.out.forward(s.out_in);
  l.out_bias.forward(x2);
  ops::add_inplace(x2.f32(), x.f32(), x2.numel(), options_.device);  // the residual
  Tensor h2 = l.norm2.forward(x2, s.norm2);
  s.fc1_in = l.fc1.input(h2);
  s.fc1_out = l.fc1.forward(s.fc1_in);
  l.fc1_bias.forward(s.fc1_out);
  Tensor act = Tensor::empty(s.fc1_out.shape(), DType::f32, options_.device);
  ops::GeluParams g;
  g.n = act.numel(), g.kind = shape_.act, g.x = s.fc1_out.f32(), g.out = act.f32();
  ops::gelu_forward(g, options_.device);
  s.fc2_in = l.fc2.input(act);
  Tensor y = l.fc2.forward(s.fc2_in);
  l.fc2_bias.forward(y);
  ops::add_inplace(y.f32(), x2.f32(), y.numel(), options_.device);
  return y;
}

Tensor VisionEncoder::forward(const Tensor& patches, int64_t images, const std::vector<int64_t>& indices,
                              Saved* saved) const {
  FORGE_CHECK(!indices.empty(), "vision encoder: no hidden state asked for");
  for (int64_t i : indices)
    FORGE_CHECK(i >= 0 && i <= layers(), "vision encoder: hidden state {} of {} layers", i, layers());
  const int64_t deepest = *std::max_element(indices.begin(), indices.end());
  const int64_t h = shape_.hidden, rows = images * shape_.positions();
  const int64_t k = static_cast<int64_t>(indices.size());
  if (saved) {
    *saved = Saved{};
    saved->images = images, saved->indices = indices;
    saved->layers.resize(static_cast<size_t>(deepest));
  }
  Tensor features = Tensor::empty({rows, h * k}, DType::f32, options_.device);
  auto collect = [&](int64_t state, const Tensor& x) {
    for (int64_t j = 0; j < k; ++j)
      if (indices[static_cast<size_t>(j)] == state)
        copy_columns(x.f32(), h, features.f32() + j * h, h * k, rows, h, false, options_.device);
  };
  Tensor x = embed(patches, images, saved);
  collect(0, x);
  for (int64_t i = 0; i < deepest; ++i) {
    x = layer_forward(layers_[static_cast<size_t>(i)], x, images,
                      saved ? &saved->layers[static_cast<size_t>(i)] : nullptr);
    collect(i + 1, x);
  }
  return features;
}

Tensor VisionEncoder::layer_backward(const Layer& l, const Tensor& dy, int64_t images, LayerSaved& s) const {
  const Device device = options_.device;
  // MLP: y = x2 + fc2(gelu(fc1(ln2(x2)))).
  GemmOperand d_fc2 = l.fc2.grad_output(dy);
  const Tensor db_fc2 = l.fc2_bias.backward_input(dy);
  Tensor dact = l.fc2.backward_input(d_fc2);
  ops::GeluParams g;
  g.n = dact.numel(), g.kind = shape_.act, g.x = s.fc1_out.f32(), g.dy = dact.f32(), g.dx = dact.f32();
  ops::gelu_backward(g, device);
  s.fc1_out = Tensor();
  const Tensor db_fc1 = l.fc1_bias.backward_input(dact);
  GemmOperand d_fc1 = l.fc1.grad_output(dact);
  Tensor dx2 = l.norm2.backward_input(l.fc1.backward_input(d_fc1), s.norm2);
  ops::add_inplace(dx2.f32(), dy.f32(), dx2.numel(), device);
  // Attention: x2 = x + out(attn(qkv(ln1(x)))).
  GemmOperand d_out = l.out.grad_output(dx2);
  const Tensor db_out = l.out_bias.backward_input(dx2);
  Tensor dcore = l.out.backward_input(d_out);
  const int64_t h = shape_.hidden, positions = shape_.positions();
  Tensor dqkv = Tensor::empty(s.qkv.shape(), DType::f32, device);
  ops::AttentionParams p;
  p.batch = images, p.seq = positions, p.heads = p.kv_heads = shape_.heads, p.head_dim = shape_.head_dim();
  p.q = s.qkv.f32(), p.k = p.q + h, p.v = p.q + 2 * h;
  p.q_stride = p.k_stride = p.v_stride = 3 * h;
  p.out = s.core.f32(), p.out_stride = h, p.lse = s.lse.f32();
  p.scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim()));
  p.causal = false;
  p.dout = dcore.f32(), p.dout_stride = h;
  p.dq = dqkv.f32(), p.dk = p.dq + h, p.dv = p.dq + 2 * h;
  p.dq_stride = p.dk_stride = p.dv_stride = 3 * h;
  ops::attention_backward(p, device);
  s.qkv = Tensor(), s.core = Tensor(), s.lse = Tensor();
  const Tensor db_qkv = l.qkv_bias.backward_input(dqkv);
  GemmOperand d_qkv = l.qkv.grad_output(dqkv);
  Tensor dx = l.norm1.backward_input(l.qkv.backward_input(d_qkv), s.norm1);
  ops::add_inplace(dx.f32(), dx2.f32(), dx.numel(), device);
  // W, right away (least memory; nothing waits on it).
  l.fc2.backward_weight(d_fc2, s.fc2_in);
  l.fc2_bias.backward_weight(db_fc2);
  l.fc1.backward_weight(d_fc1, s.fc1_in);
  l.fc1_bias.backward_weight(db_fc1);
  l.norm2.backward_weight(s.norm2);
  l.out.backward_weight(d_out, s.out_in);
  l.out_bias.backward_weight(db_out);
  l.qkv.backward_weight(d_qkv, s.qkv_in);
  l.qkv_bias.backward_weight(db_qkv);
  l.norm1.backward_weight(s.norm1);
  s = LayerSaved{};
  return dx;
}

void VisionEncoder::embed_backward(const Tensor& dx_in, Saved& saved) const {
  const Device device = options_.device;
  const int64_t h = shape_.hidden, n = shape_.patches, positions = shape_.positions(), images = saved.images;
  Tensor dx = dx_in;
  if (shape_.pre_norm) {
    dx = pre_norm_.backward_input(dx_in, saved.pre_norm);
    pre_norm_.backward_weight(saved.pre_norm);
  }
  if (store_->trainable(params_.position)) {  // (frozen parameters take no gradient)
    ops::BiasParams pos;
    pos.rows = images, pos.n = positions * h, pos.dy = dx.f32();
    pos.dbias = store_->grad(params_.position).f32();
    ops::bias_backward(pos, device);
    store_->note_grad(params_.position);
  }
  if (shape_.class_token && store_->trainable(params_.class_embedding)) {
    ops::BiasParams cls;  // the class token's gradient: row 0 of every image, summed
    cls.rows = images, cls.n = h, cls.dy = dx.f32(), cls.dy_ld = positions * h;
    cls.dbias = store_->grad(params_.class_embedding).f32();
    ops::bias_backward(cls, device);
    store_->note_grad(params_.class_embedding);
  }
  if (!store_->trainable(params_.patch)) return;
  Tensor dembedded = dx;
  if (shape_.class_token) {
    dembedded = Tensor::empty({images * n, h}, DType::f32, device);
    ops::StridedCopyParams r;
    r.shape[0] = images, r.shape[1] = n, r.shape[2] = h;
    r.src = dx.f32() + h, r.src_stride[0] = positions * h, r.src_stride[1] = h;
    r.dst = dembedded.f32(), r.dst_stride[0] = n * h, r.dst_stride[1] = h;
    ops::strided_copy(r, device);
  }
  if (patch_bias_.defined()) patch_bias_.backward_weight(patch_bias_.backward_input(dembedded));
  GemmOperand d = patch_.grad_output(dembedded);
  patch_.backward_weight(d, saved.patches);
}

void VisionEncoder::backward(const Tensor& dfeatures, Saved& saved) const {
  const int64_t h = shape_.hidden, rows = saved.images * shape_.positions();
  const int64_t k = static_cast<int64_t>(saved.indices.size());
  FORGE_CHECK(dfeatures.numel() == rows * h * k,
              "vision encoder: feature gradient of {} elements, expected {}", dfeatures.numel(),
              rows * h * k);
  const int64_t deepest = static_cast<int64_t>(saved.layers.size());
  // The gradient of hidden state `state`: the features' columns taken from it, plus what flows back from
  // above.
  auto inject = [&](int64_t state, Tensor& dx) {
    for (int64_t j = 0; j < k; ++j)
      if (saved.indices[static_cast<size_t>(j)] == state) {
        if (!dx.defined()) dx = Tensor::zeros({rows, h}, DType::f32, options_.device);
        copy_columns(dfeatures.f32() + j * h, h * k, dx.f32(), h, rows, h, true, options_.device);
      }
  };
  Tensor dx;
  inject(deepest, dx);
  for (int64_t i = deepest - 1; i >= 0; --i) {
    dx = layer_backward(layers_[static_cast<size_t>(i)], dx, saved.images,
                        saved.layers[static_cast<size_t>(i)]);
    inject(i, dx);
  }
  embed_backward(dx, saved);
  saved = Saved{};
}

}  // namespace forge::nn
