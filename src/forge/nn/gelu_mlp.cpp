#include "forge/nn/gelu_mlp.h"

#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

GeluMlp::GeluMlp(ParameterStore* store, GeluMlpParams params, int64_t hidden, int64_t ffn,
                 ComputeOptions options, ops::GeluKind kind)
    : fc_(store, {params.fc}, hidden, options),
      proj_(store, {params.proj}, ffn, options),
      ffn_(ffn),
      options_(options),
      kind_(kind),
      act_dtype_(options.part_dtype()) {
  if (params.fc_bias >= 0) {
    fc_bias_ = Bias(store, {params.fc_bias});
    FORGE_CHECK(fc_bias_.size() == ffn, "the MLP's fc bias has {} values, expected {}", fc_bias_.size(), ffn);
  }
}

Tensor GeluMlp::activation(const Tensor& pre) const {
  Tensor act = Tensor::empty(pre.shape(), DType::f32, options_.device);
  const Tensor x = to_dtype(pre, DType::f32);
  ops::GeluParams p;
  p.n = x.numel(), p.kind = kind_, p.x = x.f32(), p.out = act.f32();
  ops::gelu_forward(p, options_.device);
  return to_dtype(act, act_dtype_);
}

Tensor GeluMlp::run_forward(const Tensor& h, Saved& saved, bool keep_activation, DType output) const {
  saved.h = fc_.input(gather_in(options_.tp, h));
  saved.pre = fc_.forward(saved.h, act_dtype_);
  if (fc_bias_.defined()) fc_bias_.forward(saved.pre);
  GemmOperand act = proj_.input(activation(saved.pre));
  Tensor y = proj_.forward(act, output);
  if (keep_activation || !options_.recomputes(RecomputeModule::mlp_act)) saved.act = std::move(act);
  return reduce_out(options_.tp, y);
}

void GeluMlp::drop_input(LayerPart::Saved& saved) const { static_cast<Saved&>(saved).h = GemmOperand{}; }

void GeluMlp::restore_input(const Tensor& h, LayerPart::Saved& base) const {
  Saved& saved = static_cast<Saved&>(base);
  saved.h = fc_.input(gather_in(options_.tp, h));
  fc_.keep_for_backward(saved.h);
}

Tensor GeluMlp::backward_input(const Tensor& dy, int64_t, int64_t, LayerPart::Saved& base) const {
  Saved& saved = static_cast<Saved&>(base);
  if (!saved.act.defined()) {  // selective recompute
    saved.act = proj_.input(activation(saved.pre));
    proj_.keep_for_backward(saved.act);
  }
  saved.dy = proj_.grad_output(gather_in(options_.tp, dy));
  const Tensor dact = to_dtype(proj_.backward_input(saved.dy, act_dtype_), DType::f32);
  const Tensor pre = to_dtype(saved.pre, DType::f32);
  Tensor dpre = Tensor::empty(pre.shape(), DType::f32, options_.device);
  ops::GeluParams p;
  p.n = pre.numel(), p.kind = kind_, p.x = pre.f32(), p.dy = dact.f32(), p.dx = dpre.f32();
  ops::gelu_backward(p, options_.device);
  saved.pre = Tensor();
  if (fc_bias_.defined()) saved.dbias = fc_bias_.backward_input(dpre);
  saved.dpre = fc_.grad_output(to_dtype(dpre, act_dtype_));
  return reduce_out(options_.tp, fc_.backward_input(saved.dpre, act_dtype_));
}

void GeluMlp::backward_weight(LayerPart::Saved& base) const {
  Saved& saved = static_cast<Saved&>(base);
  proj_.backward_weight(saved.dy, saved.act);
  if (fc_bias_.defined()) fc_bias_.backward_weight(saved.dbias);
  fc_.backward_weight(saved.dpre, saved.h);
  saved = Saved{};
}

}  // namespace forge::nn
