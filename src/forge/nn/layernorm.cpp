#include "forge/nn/layernorm.h"

#include "forge/kernels/ops.h"
#include "forge/nn/compute.h"

namespace forge::nn {

LayerNorm::LayerNorm(ParameterStore* store, int weight_param, int bias_param, float eps)
    : store_(store),
      weight_(weight_param),
      bias_(bias_param),
      dim_(store->info(weight_param).shape.at(0)),
      eps_(eps) {
  store->keep_fp32(weight_param);  // the kernels read the fp32 weights
  if (bias_param >= 0) store->keep_fp32(bias_param);
  FORGE_CHECK(bias_ < 0 || store->info(bias_).shape == store->info(weight_).shape,
              "LayerNorm '{}': bias shape differs from the weight's", store->info(weight_).name);
}

Tensor LayerNorm::forward(const Tensor& x, Saved& saved, DType dtype) const {
  const int64_t rows = x.numel() / dim_;
  const Device device = store_->device();
  const Tensor x32 = to_dtype(x, DType::f32);
  Tensor y = Tensor::empty(x.shape(), DType::f32, device);
  saved.x = x;
  saved.mean = Tensor::empty({rows}, DType::f32, device);
  saved.rstd = Tensor::empty({rows}, DType::f32, device);
  ops::LayerNormParams p;
  p.rows = rows, p.dim = dim_, p.x = x32.f32(), p.weight = store_->param(weight_).f32(), p.eps = eps_;
  p.bias = bias_ >= 0 ? store_->param(bias_).f32() : nullptr;
  p.y = y.f32(), p.mean = saved.mean.f32(), p.rstd = saved.rstd.f32();
  ops::layernorm_forward(p, device);
  return to_dtype(y, dtype);
}

Tensor LayerNorm::forward(const Tensor& x) const {
  Saved scratch;
  Tensor y = forward(x, scratch);
  return y;
}

Tensor LayerNorm::backward_input(const Tensor& dy, Saved& saved, DType dtype) const {
  const int64_t rows = dy.numel() / dim_;
  const Tensor x32 = to_dtype(saved.x, DType::f32), dy32 = to_dtype(dy, DType::f32);
  Tensor dx = Tensor::empty(dy.shape(), DType::f32, store_->device());
  ops::LayerNormParams p;
  p.rows = rows, p.dim = dim_, p.x = x32.f32(), p.weight = store_->param(weight_).f32(), p.eps = eps_;
  p.mean = saved.mean.f32(), p.rstd = saved.rstd.f32(), p.dy = dy32.f32(), p.dx = dx.f32();
  ops::layernorm_backward_input(p, store_->device());
  saved.dy = dy;
  return to_dtype(dx, dtype);
}

void LayerNorm::backward_weight(Saved& saved) const {
  if (!store_->trainable(weight_)) {  // frozen: no weight gradient
    saved = Saved{};
    return;
  }
  const int64_t rows = saved.dy.numel() / dim_;
  const Tensor x32 = to_dtype(saved.x, DType::f32), dy32 = to_dtype(saved.dy, DType::f32);
  ops::LayerNormParams p;
  p.rows = rows, p.dim = dim_, p.x = x32.f32(), p.eps = eps_;
  p.mean = saved.mean.f32(), p.rstd = saved.rstd.f32(), p.dy = dy32.f32();
  p.dweight = store_->grad(weight_).f32();
  p.dbias = bias_ >= 0 ? store_->grad(bias_).f32() : nullptr;
  ops::layernorm_backward_weight(p, store_->device());
  store_->note_grad(weight_);
  if (bias_ >= 0) store_->note_grad(bias_);
  saved = Saved{};
}

}  // namespace forge::nn
