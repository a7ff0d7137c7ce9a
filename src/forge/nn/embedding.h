// Token embedding. The input is token ids, so there is no input gradient: backward_weight scatters dy
// into the embedding gradient.
#pragma once

#include "forge/nn/parameters.h"

namespace forge::nn {

class Embedding {
 public:
  Embedding() = default;
  Embedding(ParameterStore* store, int weight_param);
  Tensor forward(const int32_t* ids, int64_t rows) const;
  void backward_weight(const int32_t* ids, const Tensor& dy) const;

 private:
  ParameterStore* store_ = nullptr;
  int weight_ = -1;
  int64_t vocab_ = 0, dim_ = 0;
};

}  // namespace forge::nn
