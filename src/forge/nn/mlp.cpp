#include "forge/nn/mlp.h"

#include "forge/kernels/ops.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

Mlp::Mlp(ParameterStore* store, int gate_up_param, int down_param, int64_t hidden, int64_t ffn,
         ComputeOptions options)
    : gate_up_(store, gate_up_param, 2, hidden), down_(store, down_param, 1, ffn), ffn_(ffn), options_(options) {}

Tensor Mlp::activation(const Tensor& gate_up) const {
  int64_t rows = gate_up.numel() / (2 * ffn_);
  Tensor act = Tensor::empty({rows, ffn_}, DType::f32);
  ops::SwigluParams p;
  p.rows = rows, p.ffn = ffn_, p.gate_up = gate_up.f32(), p.out = act.f32();
  ops::swiglu_forward(p);
  return act;
}

Tensor Mlp::forward(const Tensor& h, Saved& saved, bool keep_activation) const {
  saved.h_gemm = to_gemm_dtype(gather_in(options_.tp, h), options_.gemm_dtype);
  saved.gate_up = gate_up_.forward(saved.h_gemm);
  Tensor act_gemm = to_gemm_dtype(activation(saved.gate_up), options_.gemm_dtype);
  Tensor y = down_.forward(act_gemm);
  if (keep_activation) saved.act_gemm = act_gemm;
  return reduce_out(options_.tp, y);
}

Tensor Mlp::backward_input(const Tensor& dy, Saved& saved) const {
  if (!saved.act_gemm.defined()) saved.act_gemm = to_gemm_dtype(activation(saved.gate_up), options_.gemm_dtype);
  saved.dy_gemm = to_gemm_dtype(gather_in(options_.tp, dy), options_.gemm_dtype);
  Tensor dact = down_.backward_input(saved.dy_gemm);
  int64_t rows = dact.numel() / ffn_;
  Tensor dgate_up = Tensor::empty({rows, 2 * ffn_}, DType::f32);
  ops::SwigluParams p;
  p.rows = rows, p.ffn = ffn_, p.gate_up = saved.gate_up.f32(), p.dout = dact.f32(), p.dgate_up = dgate_up.f32();
  ops::swiglu_backward(p);
  saved.gate_up = Tensor();
  saved.dgate_up_gemm = to_gemm_dtype(dgate_up, options_.gemm_dtype);
  return reduce_out(options_.tp, gate_up_.backward_input(saved.dgate_up_gemm));
}

void Mlp::backward_weight(Saved& saved) const {
  down_.backward_weight(saved.dy_gemm, saved.act_gemm);
  gate_up_.backward_weight(saved.dgate_up_gemm, saved.h_gemm);
  saved = Saved{};
}

}  // namespace forge::nn
