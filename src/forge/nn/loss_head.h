// The loss head: the output projection fused with cross-entropy (ops::linear_cross_entropy_*), over
// vocabulary chunks so that the full logits never have to exist, vocabulary-parallel under tensor
// parallelism: each rank covers its range of the (padded) vocabulary, and the per-range log-sum-exps and
// target logits combine over the group into the global loss. Its weight is an [local vocab, hidden] parameter
// (tied to the embedding or not: the family decides). Multi-token prediction heads reuse it.
#pragma once

#include <cstdint>

#include "forge/core/parameters.h"
#include "forge/nn/compute.h"

namespace forge::nn {

struct LossTotals {
  double sum = 0;      // sum of per-token losses (nats)
  int64_t tokens = 0;  // tokens with a target (target >= 0)
  // Top-1 hits (forward's count_top1, else 0): tokens with a target whose logit is >= the row's largest logit
  // over the whole vocabulary. A tie counts as a hit: the argmax is ambiguous there, and the comparison stays
  // exact (the target logit is one of the values the max was taken over).
  int64_t top1 = 0;
};

class LossHead {
 public:
  LossHead() = default;
  // vocab: the real vocabulary; vocab_start: the global id of this rank's first row of the weight.
  // softcap > 0: logits soft-capped to softcap * tanh(z / softcap) (Gemma 2's final_logit_softcapping), in
  // the loss and in logits() alike.
  LossHead(ParameterStore* store, int weight, int64_t vocab, int64_t vocab_start, ComputeOptions options,
           float softcap = 0.0f);

  // hidden [rows, dim] (this rank's rows under sequence parallelism): the loss over the targets (host array
  // `targets` and the same on the model's device, negative = ignored). With dhidden it also computes the
  // gradient of grad_scale * (sum of losses) with respect to hidden, and accumulates (+=) the weight's
  // gradient while each logits chunk is live (reported to the store: ParameterStore::note_grad). count_top1
  // also counts the top-1 hits (LossTotals::top1; the kernel's max logit per row, all-reduced over the
  // group): an all-reduce of a float per row under tensor parallelism (every rank passes the same flag),
  // nothing when off.
  LossTotals forward(const Tensor& hidden, const int32_t* targets, const int32_t* device_targets,
                     float grad_scale, Tensor* dhidden, bool count_top1 = false) const;
  // Full logits [rows, vocab] (every rank's range gathered, padding dropped), on the model's device without
  // tensor parallelism, else on the host.
  Tensor logits(const Tensor& hidden) const;

 private:
  Tensor weight_gemm() const;
  TensorParallel* tp() const;

  ParameterStore* store_ = nullptr;
  int weight_ = -1;
  int64_t vocab_ = 0, local_vocab_ = 0, vocab_start_ = 0, dim_ = 0;
  ComputeOptions options_;
  float softcap_ = 0.0f;
};

}  // namespace forge::nn
