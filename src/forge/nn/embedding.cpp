#include "forge/nn/embedding.h"

#include "forge/kernels/ops.h"

namespace forge::nn {

Embedding::Embedding(ParameterStore* store, int weight_param)
    : store_(store),
      weight_(weight_param),
      vocab_(store->info(weight_param).shape.at(0)),
      dim_(store->info(weight_param).shape.at(1)) {}

Tensor Embedding::forward(const int32_t* ids, int64_t rows) const {
  Tensor y = Tensor::empty({rows, dim_}, DType::f32);
  ops::EmbeddingParams p;
  p.rows = rows, p.dim = dim_, p.vocab = vocab_, p.ids = ids, p.weight = store_->param(weight_).f32(), p.out = y.f32();
  ops::embedding_forward(p);
  return y;
}

void Embedding::backward_weight(const int32_t* ids, const Tensor& dy) const {
  ops::EmbeddingParams p;
  p.rows = dy.numel() / dim_, p.dim = dim_, p.vocab = vocab_, p.ids = ids, p.dout = dy.f32();
  p.dweight = store_->grad(weight_).f32();
  ops::embedding_backward_weight(p);
}

}  // namespace forge::nn
