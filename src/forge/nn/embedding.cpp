#include "forge/nn/embedding.h"

#include "forge/kernels/ops.h"
#include "forge/nn/compute.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

Embedding::Embedding(ParameterStore* store, int weight_param, TensorParallel* tp, float scale,
                     DType weights_dtype)
    : store_(store),
      weight_(weight_param),
      vocab_(store->info(weight_param).shape.at(0)),
      dim_(store->info(weight_param).shape.at(1)),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      first_(store->info(weight_param).shard.dim == 0 ? store->info(weight_param).shard.start : 0),
      scale_(scale) {
  if (weights_dtype != DType::bf16) store->keep_fp32(weight_param);  // the lookup reads fp32 rows
}

Tensor Embedding::forward(const int32_t* ids, int64_t rows, DType dtype) const {
  // Vocabulary-parallel: each rank looks up the ids of its range (zero rows for the others'), and the partial
  // embeddings sum over the group.
  const Device device = store_->device();
  Tensor y = Tensor::empty({rows, dim_}, DType::f32, device);
  ops::EmbeddingParams p;
  p.rows = rows, p.dim = dim_, p.vocab = vocab_, p.ids = ids, p.out = y.f32();
  if (store_->keeps_fp32(weight_)) {
    p.weight = store_->param(weight_).f32();
  } else {
    const ParamInfo& info = store_->info(weight_);
    p.weight = store_->params_bf16().view(info.offset, info.shape).bf16();
  }
  p.vocab_parallel = tp_ != nullptr, p.first = first_;
  ops::embedding_forward(p, device);
  if (scale_ != 1.0f) ops::scale_inplace(y.f32(), scale_, y.numel(), device);
  return tp_ ? tp_->reduce_out(to_dtype(y, dtype)) : y;
}

void Embedding::backward_weight(const int32_t* ids, const Tensor& dy_in) const {
  if (!store_->trainable(weight_)) return;                                // frozen: no weight gradient
  Tensor dy = to_dtype(tp_ ? tp_->gather_in(dy_in) : dy_in, DType::f32);  // sequence parallel: every row's
  if (scale_ != 1.0f) {  // d(scale e)/de: the caller's gradient stays as it was
    Tensor scaled = Tensor::empty(dy.shape(), DType::f32, store_->device());
    scaled.copy_from(dy);
    ops::scale_inplace(scaled.f32(), scale_, scaled.numel(), store_->device());
    dy = scaled;
  }
  ops::EmbeddingParams p;
  p.rows = dy.numel() / dim_, p.dim = dim_, p.vocab = vocab_, p.ids = ids, p.dout = dy.f32();
  p.vocab_parallel = tp_ != nullptr, p.first = first_;
  p.dweight = store_->grad(weight_).f32();
  ops::embedding_backward_weight(p, store_->device());
  store_->note_grad(weight_);
}

}  // namespace forge::nn
