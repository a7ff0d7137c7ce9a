#include "forge/nn/rmsnorm.h"

#include "forge/kernels/ops.h"

namespace forge::nn {

RmsNorm::RmsNorm(ParameterStore* store, int weight_param, float eps, float weight_offset)
    : store_(store),
      weight_(weight_param),
      dim_(store->info(weight_param).shape.at(0)),
      eps_(eps),
      offset_(weight_offset) {
  store->keep_fp32(weight_param);  // the kernels read the fp32 weights
}

Tensor RmsNorm::forward(const Tensor& x, Saved& saved, DType dtype) const {
  int64_t rows = x.numel() / dim_;
  const Device device = store_->device();
  Tensor y = Tensor::empty(x.shape(), dtype, device);
  saved.x = x;
  saved.rstd = Tensor::empty({rows}, DType::f32, device);
  ops::RmsNormParams p;
  p.rows = rows, p.dim = dim_, p.x = x.elements(), p.weight = store_->param(weight_).f32(), p.eps = eps_;
  p.weight_offset = offset_;
  p.y = y.elements(), p.rstd = saved.rstd.f32();
  ops::rmsnorm_forward(p, device);
  return y;
}

Tensor RmsNorm::backward_input(const Tensor& dy, Saved& saved, DType dtype) const {
  int64_t rows = dy.numel() / dim_;
  Tensor dx = Tensor::empty(dy.shape(), dtype, store_->device());
  ops::RmsNormParams p;
  p.rows = rows, p.dim = dim_, p.x = saved.x.elements(), p.weight = store_->param(weight_).f32(),
  p.eps = eps_;
  p.weight_offset = offset_;
  p.rstd = saved.rstd.f32(), p.dy = dy.elements(), p.dx = dx.elements();
  ops::rmsnorm_backward_input(p, store_->device());
  saved.dy = dy;
  return dx;
}

void RmsNorm::backward_weight(Saved& saved) const {
  if (!store_->trainable(weight_)) {  // frozen: no weight gradient
    saved = Saved{};
    return;
  }
  int64_t rows = saved.dy.numel() / dim_;
  ops::RmsNormParams p;
  p.rows = rows, p.dim = dim_, p.x = saved.x.elements(), p.eps = eps_;
  p.rstd = saved.rstd.f32(), p.dy = saved.dy.elements(), p.dweight = store_->grad(weight_).f32();
  ops::rmsnorm_backward_weight(p, store_->device());
  store_->note_grad(weight_);
  saved = Saved{};
}

}  // namespace forge::nn
