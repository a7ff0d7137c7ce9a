#include "forge/nn/bias.h"

#include "forge/kernels/ops.h"

namespace forge::nn {

Bias::Bias(ParameterStore* store, std::vector<int> params)
    : store_(store), first_(params.at(0)), count_(static_cast<int>(params.size())) {
  for (int i = 0; i < count_; ++i) {
    const ParamInfo& p = store->info(params[static_cast<size_t>(i)]);
    FORGE_CHECK(params[static_cast<size_t>(i)] == first_ + i && p.shape.size() == 1 &&
                    p.offset == store->info(first_).offset + size_,
                "bias '{}' is not a 1-D parameter registered right after '{}'", p.name,
                store->info(first_).name);
    size_ += p.shape[0];
    store->keep_fp32(first_ + i);  // added in fp32 (kept ones stay adjacent: one run of fp32_offset)
  }
}

void Bias::forward(Tensor& y) const {
  FORGE_CHECK(y.numel() % size_ == 0, "bias of {} does not divide a tensor of {} elements", size_, y.numel());
  ops::BiasParams p;
  p.rows = y.numel() / size_, p.n = size_, p.y = y.elements(),
  p.bias = store_->params().f32() + store_->fp32_offset(first_);
  ops::bias_add(p, store_->device());
}

Tensor Bias::backward_input(const Tensor& dy) const {
  if (!store_->trainable(first_)) return Tensor();  // frozen: no gradient to take
  FORGE_CHECK(dy.numel() % size_ == 0, "bias of {} does not divide a gradient of {} elements", size_,
              dy.numel());
  Tensor dbias = Tensor::zeros({size_}, DType::f32, store_->device());
  ops::BiasParams p;
  p.rows = dy.numel() / size_, p.n = size_, p.dy = dy.elements(), p.dbias = dbias.f32();
  ops::bias_backward(p, store_->device());
  return dbias;
}

void Bias::backward_weight(const Tensor& dbias) const {
  if (!dbias.defined()) return;  // frozen
  ops::add_inplace(values(store_->grads()).f32(), dbias.f32(), size_, store_->device());
  for (int i = 0; i < count_; ++i) store_->note_grad(first_ + i);
}

}  // namespace forge::nn
