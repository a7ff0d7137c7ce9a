#include "forge/nn/mlp.h"

#include "forge/kernels/ops.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

Mlp::Mlp(ParameterStore* store, MlpParams params, int64_t hidden, int64_t ffn, ComputeOptions options,
         ops::GluActivation activation)
    : gate_up_(store, {params.gate, params.up}, hidden, options),
      down_(store, {params.down}, ffn, options),
      ffn_(ffn),
      options_(options),
      activation_(activation),
      act_dtype_(options.part_dtype()) {}

Tensor Mlp::activation(const Tensor& gate_up) const {
  int64_t rows = gate_up.numel() / (2 * ffn_);
  Tensor act = Tensor::empty({rows, ffn_}, act_dtype_, options_.device);
  ops::SwigluParams p;
  p.rows = rows, p.ffn = ffn_, p.activation = activation_, p.dtype = act_dtype_, p.gate_up = gate_up.raw(),
  p.out = act.raw();
  ops::swiglu_forward(p, options_.device);
  return act;
}

Tensor Mlp::forward(const Tensor& h, Saved& saved, bool keep_activation) const {
  return run_forward(h, saved, keep_activation, act_dtype_);
}

Tensor Mlp::run_forward(const Tensor& h, Saved& saved, bool keep_activation, DType output) const {
  saved.h = gate_up_.input(gather_in(options_.tp, h));
  saved.gate_up = gate_up_.forward(saved.h, act_dtype_);
  GemmOperand act = down_.input(activation(saved.gate_up));
  Tensor y = down_.forward(act, output);
  if (keep_activation || !options_.recomputes(RecomputeModule::mlp_act)) saved.act = std::move(act);
  return reduce_out(options_.tp, y);
}

void Mlp::drop_input(LayerPart::Saved& saved) const { static_cast<Saved&>(saved).h = GemmOperand{}; }

void Mlp::restore_input(const Tensor& h, LayerPart::Saved& base) const {
  Saved& saved = static_cast<Saved&>(base);
  saved.h = gate_up_.input(gather_in(options_.tp, h));
  gate_up_.keep_for_backward(saved.h);
}

Tensor Mlp::backward_input(const Tensor& dy, Saved& saved) const {
  if (!saved.act.defined()) {  // selective recompute
    saved.act = down_.input(activation(saved.gate_up));
    down_.keep_for_backward(saved.act);
  }
  saved.dy = down_.grad_output(gather_in(options_.tp, dy));
  Tensor dact = down_.backward_input(saved.dy, act_dtype_);
  int64_t rows = dact.numel() / ffn_;
  Tensor dgate_up = Tensor::empty({rows, 2 * ffn_}, act_dtype_, options_.device);
  ops::SwigluParams p;
  p.rows = rows, p.ffn = ffn_, p.activation = activation_, p.dtype = act_dtype_,
  p.gate_up = saved.gate_up.raw(), p.dout = dact.raw();
  p.dgate_up = dgate_up.raw();
  ops::swiglu_backward(p, options_.device);
  saved.gate_up = Tensor();
  saved.dgate_up = gate_up_.grad_output(dgate_up);
  return reduce_out(options_.tp, gate_up_.backward_input(saved.dgate_up, act_dtype_));
}

void Mlp::backward_weight(Saved& saved) const {
  down_.backward_weight(saved.dy, saved.act);
  gate_up_.backward_weight(saved.dgate_up, saved.h);
  saved = Saved{};
}

}  // namespace forge::nn
