#include "forge/nn/decoder_layer.h"

#include "forge/kernels/ops.h"

namespace forge::nn {

DecoderLayer::DecoderLayer(ParameterStore* store, int norm1, std::unique_ptr<LayerPart> mixer, int norm2,
                           std::unique_ptr<LayerPart> ffn, float norm_eps, ComputeOptions options)
    : DecoderLayer(store, LayerNorms{norm1, -1, norm2, -1, norm_eps, 0.0f}, std::move(mixer), std::move(ffn),
                   options) {}

DecoderLayer::DecoderLayer(ParameterStore* store, const LayerNorms& norms, std::unique_ptr<LayerPart> mixer,
                           std::unique_ptr<LayerPart> ffn, ComputeOptions options)
    : options_(options),
      norm1_(store, norms.before_mixer, norms.eps, norms.weight_offset),
      norm2_(store, norms.before_ffn, norms.eps, norms.weight_offset),
      mixer_(std::move(mixer)),
      ffn_(std::move(ffn)) {
  if ((post1_on_ = norms.after_mixer >= 0))
    post1_ = RmsNorm(store, norms.after_mixer, norms.eps, norms.weight_offset);
  if ((post2_on_ = norms.after_ffn >= 0))
    post2_ = RmsNorm(store, norms.after_ffn, norms.eps, norms.weight_offset);
}

namespace {

// The feed-forward's dropout site: the one after the mixer's.
DropoutRows ffn_rows(DropoutRows rows) {
  rows.stream += 1;
  return rows;
}

}  // namespace

Tensor DecoderLayer::run_forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                                 bool keep_cores) const {
  saved.x = x;
  if (!saved.mixer) saved.mixer = mixer_->new_saved();
  if (!saved.ffn) saved.ffn = ffn_->new_saved();
  Tensor h1 = norm1_.forward(x, saved.norm1);
  Tensor x2 = mixer_->forward(h1, batch, seq, *saved.mixer, keep_cores);
  if (post1_on_) x2 = post1_.forward(x2, saved.post1);
  const int64_t hidden = norm1_.dim();
  dropout_inplace(options_, saved.dropout, x2, hidden);
  ops::add_inplace(x2.f32(), x.f32(), x.numel(), options_.device);
  Tensor h2 = norm2_.forward(x2, saved.norm2);
  Tensor y = ffn_->forward(h2, batch, seq, *saved.ffn, keep_cores);
  if (post2_on_) y = post2_.forward(y, saved.post2);
  dropout_inplace(options_, ffn_rows(saved.dropout), y, hidden);
  ops::add_inplace(y.f32(), x2.f32(), x2.numel(), options_.device);
  saved.complete = true;
  return y;
}

Tensor DecoderLayer::forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const {
  if (options_.recompute != Recompute::full)
    return run_forward(x, batch, seq, saved, options_.recompute == Recompute::none);
  // Full recompute: run the layer, keep only its input (and where its rows sit, for the same masks again).
  Saved scratch;
  scratch.dropout = saved.dropout;
  Tensor y = run_forward(x, batch, seq, scratch, false);
  saved = Saved{};
  saved.x = x;
  saved.dropout = scratch.dropout;
  return y;
}

Tensor DecoderLayer::backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const {
  if (!saved.complete) {
    Tensor x = saved.x;
    run_forward(x, batch, seq, saved, true);
  }
  // y = x2 + drop(post2(ffn(norm2(x2)))):  dx2 = dy + norm2'(ffn'(post2'(drop(dy))))
  const int64_t hidden = norm1_.dim();
  const Tensor dbranch2 = dropout_copy(options_, ffn_rows(saved.dropout), dy, hidden);
  Tensor dffn = post2_on_ ? post2_.backward_input(dbranch2, saved.post2) : dbranch2;
  Tensor dh2 = ffn_->backward_input(dffn, batch, seq, *saved.ffn);
  Tensor dx2 = norm2_.backward_input(dh2, saved.norm2);
  ops::add_inplace(dx2.f32(), dy.f32(), dy.numel(), options_.device);
  // x2 = x + drop(post1(mixer(norm1(x)))):  dx = dx2 + norm1'(mixer'(post1'(drop(dx2))))
  const Tensor dbranch1 = dropout_copy(options_, saved.dropout, dx2, hidden);
  Tensor dmixer = post1_on_ ? post1_.backward_input(dbranch1, saved.post1) : dbranch1;
  Tensor dh1 = mixer_->backward_input(dmixer, batch, seq, *saved.mixer);
  Tensor dx = norm1_.backward_input(dh1, saved.norm1);
  ops::add_inplace(dx.f32(), dx2.f32(), dx2.numel(), options_.device);
  saved.x = Tensor();
  return dx;
}

void DecoderLayer::backward_weight(Saved& saved) const {
  if (post2_on_) post2_.backward_weight(saved.post2);
  ffn_->backward_weight(*saved.ffn);
  norm2_.backward_weight(saved.norm2);
  if (post1_on_) post1_.backward_weight(saved.post1);
  mixer_->backward_weight(*saved.mixer);
  norm1_.backward_weight(saved.norm1);
  saved = Saved{};
}

Tensor DecoderLayer::forward_cached(const Tensor& x, int64_t batch, int64_t tokens,
                                    const KvLayer& cache) const {
  RmsNorm::Saved scratch;  // inference: nothing is kept
  Tensor x2 = mixer_->forward_cached(norm1_.forward(x, scratch), batch, tokens, &cache);
  if (post1_on_) x2 = post1_.forward(x2, scratch);
  ops::add_inplace(x2.f32(), x.f32(), x.numel(), options_.device);
  Tensor y = ffn_->forward_cached(norm2_.forward(x2, scratch), batch, tokens, nullptr);
  if (post2_on_) y = post2_.forward(y, scratch);
  ops::add_inplace(y.f32(), x2.f32(), x2.numel(), options_.device);
  return y;
}

}  // namespace forge::nn
