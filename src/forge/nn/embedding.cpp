#include "forge/nn/embedding.h"

#include <algorithm>

#include "forge/kernels/ops.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

Embedding::Embedding(ParameterStore* store, int weight_param, TensorParallel* tp)
    : store_(store),
      weight_(weight_param),
      vocab_(store->info(weight_param).shape.at(0)),
      dim_(store->info(weight_param).shape.at(1)),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      first_(store->info(weight_param).shard.dim == 0 ? store->info(weight_param).shard.start : 0) {}

Tensor Embedding::forward(const int32_t* ids, int64_t rows) const {
  const Device device = store_->device();
  if (tp_) {
    FORGE_CHECK(device == Device::cpu, "the vocabulary-parallel embedding runs on the CPU backend only (for now)");
    Tensor y = Tensor::zeros({rows, dim_}, DType::f32);
    const float* w = store_->param(weight_).f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t local = ids[i] - first_;
      if (local >= 0 && local < vocab_) std::copy_n(w + local * dim_, dim_, y.f32() + i * dim_);
    }
    return tp_->reduce_out(y);
  }
  Tensor y = Tensor::empty({rows, dim_}, DType::f32, device);
  ops::EmbeddingParams p;
  p.rows = rows, p.dim = dim_, p.vocab = vocab_, p.ids = ids, p.weight = store_->param(weight_).f32(), p.out = y.f32();
  ops::embedding_forward(p, device);
  return y;
}

void Embedding::backward_weight(const int32_t* ids, const Tensor& dy_in) const {
  if (tp_) {
    FORGE_CHECK(store_->device() == Device::cpu,
                "the vocabulary-parallel embedding runs on the CPU backend only (for now)");
    Tensor dy = tp_->gather_in(dy_in);
    float* dw = store_->grad(weight_).f32();
    const int64_t rows = dy.numel() / dim_;
    for (int64_t i = 0; i < rows; ++i) {  // serial: ids repeat
      const int64_t local = ids[i] - first_;
      if (local < 0 || local >= vocab_) continue;
      const float* g = dy.f32() + i * dim_;
      float* out = dw + local * dim_;
#pragma omp simd
      for (int64_t j = 0; j < dim_; ++j) out[j] += g[j];
    }
    return;
  }
  const Tensor& dy = dy_in;
  ops::EmbeddingParams p;
  p.rows = dy.numel() / dim_, p.dim = dim_, p.vocab = vocab_, p.ids = ids, p.dout = dy.f32();
  p.dweight = store_->grad(weight_).f32();
  ops::embedding_backward_weight(p, store_->device());
}

}  // namespace forge::nn
