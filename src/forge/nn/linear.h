// Linear without bias: y = x @ W^T, W stored [out_features, in_features] (the Hugging Face layout).
// The weight may span several adjacent parameters (q|k|v, gate|up), which then run as one GEMM.
#pragma once

#include "forge/nn/compute.h"
#include "forge/nn/parameters.h"

namespace forge::nn {

class Linear {
 public:
  Linear() = default;
  Linear(ParameterStore* store, int first_param, int param_count, int64_t in_features);

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

  // y [rows, out] = x_gemm [rows, in] @ W^T; x_gemm is in the GEMM dtype.
  Tensor forward(const Tensor& x_gemm) const;
  // dx [rows, in] = dy_gemm @ W
  Tensor backward_input(const Tensor& dy_gemm) const;
  // dW += dy_gemm^T @ x_gemm
  void backward_weight(const Tensor& dy_gemm, const Tensor& x_gemm) const;

 private:
  Tensor weight(DType dtype) const;
  ParameterStore* store_ = nullptr;
  int first_ = 0, count_ = 0;
  int64_t in_ = 0, out_ = 0;
};

}  // namespace forge::nn
