#include "forge/nn/linear.h"

#include "forge/kernels/ops.h"

namespace forge::nn {

Linear::Linear(ParameterStore* store, int first_param, int param_count, int64_t in_features)
    : store_(store), first_(first_param), count_(param_count), in_(in_features) {
  for (int i = first_; i < first_ + count_; ++i) out_ += store_->info(i).shape.at(0);
}

Tensor Linear::weight(DType dtype) const {
  if (dtype == DType::bf16) {
    FORGE_CHECK(store_->has_bf16(), "bf16 GEMM requested but the model keeps no bf16 weights");
    return store_->span(store_->params_bf16(), first_, count_, in_);
  }
  return store_->span(store_->params(), first_, count_, in_);
}

Tensor Linear::forward(const Tensor& x_gemm) const {
  int64_t rows = x_gemm.numel() / in_;
  Tensor y = Tensor::empty({rows, out_}, DType::f32);
  Tensor w = weight(x_gemm.dtype());
  ops::GemmParams p;
  p.m = rows, p.n = out_, p.k = in_;
  p.a = x_gemm.raw(), p.lda = in_;
  p.b = w.raw(), p.ldb = in_, p.trans_b = true;
  p.ab_dtype = x_gemm.dtype();
  p.c = y.f32(), p.ldc = out_;
  ops::gemm(p);
  return y;
}

Tensor Linear::backward_input(const Tensor& dy_gemm) const {
  int64_t rows = dy_gemm.numel() / out_;
  Tensor dx = Tensor::empty({rows, in_}, DType::f32);
  Tensor w = weight(dy_gemm.dtype());
  ops::GemmParams p;
  p.m = rows, p.n = in_, p.k = out_;
  p.a = dy_gemm.raw(), p.lda = out_;
  p.b = w.raw(), p.ldb = in_;
  p.ab_dtype = dy_gemm.dtype();
  p.c = dx.f32(), p.ldc = in_;
  ops::gemm(p);
  return dx;
}

void Linear::backward_weight(const Tensor& dy_gemm, const Tensor& x_gemm) const {
  FORGE_CHECK(dy_gemm.dtype() == x_gemm.dtype(), "Linear::backward_weight: operand dtypes differ");
  int64_t rows = dy_gemm.numel() / out_;
  Tensor dw = store_->span(store_->grads(), first_, count_, in_);
  ops::GemmParams p;
  p.m = out_, p.n = in_, p.k = rows;
  p.a = dy_gemm.raw(), p.lda = out_, p.trans_a = true;
  p.b = x_gemm.raw(), p.ldb = in_;
  p.ab_dtype = dy_gemm.dtype();
  p.c = dw.f32(), p.ldc = in_;
  p.beta = 1.0f;
  ops::gemm(p);
}

}  // namespace forge::nn
