// Token embedding. The input is token ids, so there is no input gradient: backward_weight scatters dy
// into the embedding gradient. Vocabulary-parallel (the weight is a row shard of the table, see ShardSpec):
// each rank looks up the ids in its range, zeros elsewhere, and the group sums (reduce_out); backward
// scatters the full (gathered) dy into the rows it holds.
#pragma once

#include "forge/core/parameters.h"

namespace forge::nn {
class TensorParallel;
}

namespace forge::nn {

class Embedding {
 public:
  Embedding() = default;
  // scale != 1: the looked-up rows are multiplied by it (Gemma's sqrt(hidden)), and so is their gradient.
  // weights_dtype bf16 (the store keeps a bf16 shadow, and the caller rounds the rows to bf16 anyway): the
  // table is not kept in fp32 (ParameterStore::keep_fp32), and once the distributed optimizer holds its fp32
  // masters the lookup reads the bf16 rows, as Megatron's bf16 weights are; until then it reads fp32 rows.
  // (With hidden dropout the rows are scaled before that rounding: from bf16 rows, a second rounding.)
  Embedding(ParameterStore* store, int weight_param, TensorParallel* tp = nullptr, float scale = 1.0f,
            DType weights_dtype = DType::f32);
  // dtype: what the rows cross the tensor-parallel group in and come back as (fp32, or bf16 for a bf16
  // residual stream: each element of the sum has one nonzero term, the rank holding its token's row, so
  // rounding before the sum is rounding the sum); without tensor parallelism the rows stay fp32.
  Tensor forward(const int32_t* ids, int64_t rows, DType dtype = DType::f32) const;
  // dy: fp32 or bf16 (gathered under sequence parallelism in its dtype, then widened).
  void backward_weight(const int32_t* ids, const Tensor& dy) const;

 private:
  ParameterStore* store_ = nullptr;
  int weight_ = -1;
  int64_t vocab_ = 0, dim_ = 0;
  TensorParallel* tp_ = nullptr;
  int64_t first_ = 0;  // global id of local row 0
  float scale_ = 1.0f;
};

}  // namespace forge::nn
