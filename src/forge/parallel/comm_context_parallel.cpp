#include "forge/parallel/comm_context_parallel.h"

#include <vector>

namespace forge::parallel {

ContextSplit CommContextParallel::split(const ops::AttentionParams& p) const {
  return ContextSplit::make(size(), rank(), p.seq * size());
}

void CommContextParallel::attention_forward(const ops::AttentionParams& p) {
  context_attention_forward(*device_group_, split(p), mode_, p, &stats_, device_);
}

void CommContextParallel::attention_backward(const ops::AttentionParams& p) {
  context_attention_backward(*device_group_, split(p), mode_, p, &stats_, device_);
}

void CommContextParallel::all_reduce_sum(float* values, int64_t n) {
  if (n > 0) group_->all_reduce(values, n, comm::Type::f32, comm::ReduceOp::sum).wait();
}

// Every rank's tokens gathered (ids are 4 bytes a token: the whole sequences cost less than a second round
// for the boundaries alone), laid out whole, shifted and sliced again.
void CommContextParallel::shift_tokens(const int32_t* local, int32_t* out, int64_t batch, int64_t local_seq,
                                       int64_t k, int32_t fill) {
  const int n = size();
  const int64_t block = batch * local_seq, seq = local_seq * n;
  std::vector<int32_t> gathered(static_cast<size_t>(n * block)), whole(static_cast<size_t>(batch * seq));
  group_->all_gather(local, gathered.data(), block, comm::Type::i32).wait();
  for (int r = 0; r < n; ++r) {
    const ContextSplit theirs = ContextSplit::make(n, r, seq);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < local_seq; ++t)
        whole[b * seq + theirs.position(t)] = gathered[r * block + b * local_seq + t];
  }
  const ContextSplit mine = ContextSplit::make(n, rank(), seq);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < local_seq; ++t) {
      const int64_t p = mine.position(t) + k;
      out[b * local_seq + t] = p < seq ? whole[b * seq + p] : fill;
    }
}

}  // namespace forge::parallel
