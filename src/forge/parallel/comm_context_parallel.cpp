#include "forge/parallel/comm_context_parallel.h"

namespace forge::parallel {

ContextSplit CommContextParallel::split(const ops::AttentionParams& p) const {
  return ContextSplit::make(size(), rank(), p.seq * size());
}

void CommContextParallel::attention_forward(const ops::AttentionParams& p) {
  context_attention_forward(*group_, split(p), mode_, p, &stats_);
}

void CommContextParallel::attention_backward(const ops::AttentionParams& p) {
  context_attention_backward(*group_, split(p), mode_, p, &stats_);
}

}  // namespace forge::parallel
