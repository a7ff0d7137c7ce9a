// The bias of a Linear layer: y[r, :] += b after the GEMM. Its gradient, the column sums of dy, is taken in
// B, where dy is at hand in fp32 (the GEMMs may hold it in bf16 or FP8), as a [n] tensor the caller keeps
// until W adds it to the parameter's gradient. Several biases registered one after another (q|k|v) act as
// one.
#pragma once

#include <vector>

#include "forge/core/parameters.h"

namespace forge::nn {

class Bias {
 public:
  Bias() = default;
  // params: 1-D parameters registered in a row (their concatenation is the bias).
  Bias(ParameterStore* store, std::vector<int> params);

  bool defined() const { return store_ != nullptr; }
  int64_t size() const { return size_; }
  void forward(Tensor& y) const;  // y [rows, size()] (fp32 or bf16): += bias
  Tensor backward_input(
      const Tensor& dy) const;  // the column sums of dy [rows, size()] (fp32 or bf16): a fresh [size()]
  void backward_weight(const Tensor& dbias) const;  // the gradient += dbias, reported to the store

 private:
  Tensor values(const Tensor& flat) const { return flat.view(store_->info(first_).offset, {size_}); }

  ParameterStore* store_ = nullptr;
  int first_ = -1, count_ = 0;
  int64_t size_ = 0;
};

}  // namespace forge::nn
