#include "forge/nn/decoder_layer.h"

#include "forge/kernels/ops.h"

namespace forge::nn {

DecoderLayer::DecoderLayer(ParameterStore* store, int norm1, std::unique_ptr<LayerPart> mixer, int norm2,
                           std::unique_ptr<LayerPart> ffn, float norm_eps, ComputeOptions options)
    : DecoderLayer(store, LayerNorms{norm1, -1, norm2, -1, norm_eps, 0.0f}, std::move(mixer), std::move(ffn),
                   options) {}

namespace {

Norm make_norm(ParameterStore* store, const LayerNorms& norms, int weight) {
  return nn::make_norm(store, norms.kind, weight, norms.bias, norms.eps, norms.weight_offset);
}

// The feed-forward's dropout site: the one after the mixer's.
DropoutRows ffn_rows(DropoutRows rows) {
  rows.stream += 1;
  return rows;
}

}  // namespace

DecoderLayer::DecoderLayer(ParameterStore* store, const LayerNorms& norms, std::unique_ptr<LayerPart> mixer,
                           std::unique_ptr<LayerPart> ffn, ComputeOptions options, BranchBiases biases)
    : options_(options),
      norm1_(make_norm(store, norms, norms.before_mixer)),
      norm2_(make_norm(store, norms, norms.before_ffn)),
      mixer_(std::move(mixer)),
      ffn_(std::move(ffn)) {
  if ((post1_on_ = norms.after_mixer >= 0)) post1_ = make_norm(store, norms, norms.after_mixer);
  if ((post2_on_ = norms.after_ffn >= 0)) post2_ = make_norm(store, norms, norms.after_ffn);
  if (biases.mixer >= 0) mixer_bias_ = Bias(store, {biases.mixer});
  if (biases.ffn >= 0) ffn_bias_ = Bias(store, {biases.ffn});
}

// x + branch in x's dtype (the residual stream's), the sum rounded once: in place in the branch (this layer's
// own fresh tensor) when it holds that dtype; an fp32 branch onto a bf16 stream is summed in fp32 and
// rounded; a bf16 branch onto an fp32 stream is added to a copy of x.
Tensor DecoderLayer::residual_add(const Tensor& x, Tensor branch) const {
  const Device device = options_.device;
  if (branch.dtype() == x.dtype() || branch.dtype() == DType::f32) {
    ops::add_inplace(branch.elements(), x.elements(), x.numel(), device);
    return to_dtype(branch, x.dtype());
  }
  Tensor y = x.dtype() == DType::f32 ? x.clone() : to_dtype(x, DType::f32);
  ops::add_inplace(y.elements(), branch.elements(), y.numel(), device);
  return y;
}

// Layer inputs and outputs hold the residual stream's dtype (nn::ComputeOptions::residual_dtype, given by the
// stack); each part reads its input and output gradient in the dtype it asks for (LayerPart::input_dtype),
// which the norms before it write directly.
Tensor DecoderLayer::run_forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                                 bool keep_cores) const {
  saved.x = x;
  if (!saved.mixer) saved.mixer = mixer_->new_saved();
  if (!saved.ffn) saved.ffn = ffn_->new_saved();
  saved.mixer->router_aux = saved.ffn->router_aux = saved.router_aux;
  saved.mixer->documents = saved.ffn->documents = saved.documents;
  const int64_t hidden = norm1_.dim();
  Tensor h1 = norm1_.forward(x, saved.norm1, mixer_->input_dtype());
  const bool drop_inputs = !keep_cores && options_.recomputes(RecomputeModule::norm);
  Tensor b1 = mixer_->forward(h1, batch, seq, *saved.mixer, keep_cores);
  if (drop_inputs) mixer_->drop_input(*saved.mixer);
  h1 = Tensor();
  if (mixer_bias_.defined()) mixer_bias_.forward(b1);
  if (post1_on_) b1 = post1_.forward(b1, saved.post1, x.dtype());
  dropout_inplace(options_, saved.dropout, b1, hidden);
  Tensor x2 = residual_add(x, std::move(b1));
  Tensor h2 = norm2_.forward(x2, saved.norm2, ffn_->input_dtype());
  Tensor b2 = ffn_->forward(h2, batch, seq, *saved.ffn, keep_cores);
  if (drop_inputs) ffn_->drop_input(*saved.ffn);
  h2 = Tensor();
  saved.inputs_dropped = drop_inputs;
  if (ffn_bias_.defined()) ffn_bias_.forward(b2);
  if (post2_on_) b2 = post2_.forward(b2, saved.post2, x.dtype());
  dropout_inplace(options_, ffn_rows(saved.dropout), b2, hidden);
  saved.complete = true;
  return residual_add(x2, std::move(b2));
}

Tensor DecoderLayer::forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const {
  if (options_.recompute != Recompute::full)
    return run_forward(x, batch, seq, saved, options_.recompute == Recompute::none);
  // Full recompute: run the layer, keep only its input (and where its rows sit, for the same masks again).
  Saved scratch;
  scratch.dropout = saved.dropout;
  scratch.router_aux = saved.router_aux;
  scratch.documents = saved.documents;
  Tensor y = run_forward(x, batch, seq, scratch, false);
  saved = Saved{};
  saved.x = x;
  saved.dropout = scratch.dropout;
  saved.router_aux = scratch.router_aux;
  saved.documents = scratch.documents;
  return y;
}

Tensor DecoderLayer::backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const {
  if (!saved.complete) {
    Tensor x = saved.x;
    run_forward(x, batch, seq, saved, true);
  }
  const DType residual = saved.x.dtype();
  const Device device = options_.device;
  // y = x2 + drop(post2(ffn(norm2(x2)))):  dx2 = dy + norm2'(ffn'(post2'(drop(dy))))
  const int64_t hidden = norm1_.dim();
  const Tensor dbranch2 = dropout_copy(options_, ffn_rows(saved.dropout), dy, hidden);
  Tensor dffn = post2_on_ ? post2_.backward_input(dbranch2, saved.post2, ffn_->input_dtype())
                          : to_dtype(dbranch2, ffn_->input_dtype());
  if (ffn_bias_.defined()) saved.dbias_ffn = ffn_bias_.backward_input(dffn);
  if (saved.inputs_dropped) {  // the norm again, from its kept input
    Norm::Saved scratch;
    ffn_->restore_input(norm2_.forward(norm2_.input(saved.norm2), scratch, ffn_->input_dtype()), *saved.ffn);
  }
  Tensor dh2 = ffn_->backward_input(dffn, batch, seq, *saved.ffn);
  Tensor dx2 = norm2_.backward_input(dh2, saved.norm2, residual);
  ops::add_inplace(dx2.elements(), dy.elements(), dy.numel(), device);
  // x2 = x + drop(post1(mixer(norm1(x)))):  dx = dx2 + norm1'(mixer'(post1'(drop(dx2))))
  const Tensor dbranch1 = dropout_copy(options_, saved.dropout, dx2, hidden);
  Tensor dmixer = post1_on_ ? post1_.backward_input(dbranch1, saved.post1, mixer_->input_dtype())
                            : to_dtype(dbranch1, mixer_->input_dtype());
  if (mixer_bias_.defined()) saved.dbias_mixer = mixer_bias_.backward_input(dmixer);
  if (saved.inputs_dropped) {
    Norm::Saved scratch;
    mixer_->restore_input(norm1_.forward(saved.x, scratch, mixer_->input_dtype()), *saved.mixer);
  }
  Tensor dh1 = mixer_->backward_input(dmixer, batch, seq, *saved.mixer);
  Tensor dx = norm1_.backward_input(dh1, saved.norm1, residual);
  ops::add_inplace(dx.elements(), dx2.elements(), dx2.numel(), device);
  saved.x = Tensor();
  return dx;
}

void DecoderLayer::backward_weight(Saved& saved) const {
  if (post2_on_) post2_.backward_weight(saved.post2);
  if (ffn_bias_.defined()) ffn_bias_.backward_weight(saved.dbias_ffn);
  ffn_->backward_weight(*saved.ffn);
  norm2_.backward_weight(saved.norm2);
  if (post1_on_) post1_.backward_weight(saved.post1);
  if (mixer_bias_.defined()) mixer_bias_.backward_weight(saved.dbias_mixer);
  mixer_->backward_weight(*saved.mixer);
  norm1_.backward_weight(saved.norm1);
  saved = Saved{};
}

Tensor DecoderLayer::forward_cached(const Tensor& x, int64_t batch, int64_t tokens,
                                    const KvLayer& cache) const {
  Norm::Saved scratch;  // inference: nothing is kept
  Tensor x2 = mixer_->forward_cached(norm1_.forward(x, scratch), batch, tokens, &cache);
  if (mixer_bias_.defined()) mixer_bias_.forward(x2);
  if (post1_on_) x2 = post1_.forward(x2, scratch);
  ops::add_inplace(x2.f32(), x.f32(), x.numel(), options_.device);
  Tensor y = ffn_->forward_cached(norm2_.forward(x2, scratch), batch, tokens, nullptr);
  if (ffn_bias_.defined()) ffn_bias_.forward(y);
  if (post2_on_) y = post2_.forward(y, scratch);
  ops::add_inplace(y.f32(), x2.f32(), x2.numel(), options_.device);
  return y;
}

}  // namespace forge::nn
