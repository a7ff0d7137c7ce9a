// The context-parallel group as modules see it. nn/ knows nothing of MPI: parallel/ implements this interface
// over a communicator (parallel/comm_context_parallel.h), and a model built without one (cp = 1) sees whole
// sequences.
//
// Each rank holds two chunks of every sequence, load-balanced for causal attention: of 2·cp chunks, rank r
// holds chunk r then chunk 2·cp − 1 − r (parallel/context_parallel.h). Everything but attention works token
// by token on those local tokens; attention runs across the group, and RoPE rotates each half at its global
// positions.
#pragma once

#include <cstdint>

#include "forge/kernels/ops.h"

namespace forge::nn {

class ContextParallel {
 public:
  virtual ~ContextParallel() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The global position of the first token of local half `half` (0 or 1) of a sequence of which this rank
  // holds `local` tokens (two chunks of local / 2).
  int64_t first_position(int half, int64_t local) const {
    return (half == 0 ? rank() : 2 * size() - 1 - rank()) * (local / 2);
  }
  // Causal attention of the local tokens (p.seq of them per sequence) over the whole sequences, and its
  // backward, as ops::attention_forward / attention_backward take them.
  virtual void attention_forward(const ops::AttentionParams& p) = 0;
  virtual void attention_backward(const ops::AttentionParams& p) = 0;
  // Sums values over the group, in place (statistics of whole sequences: MoE's balance loss, MTP's counts).
  virtual void all_reduce_sum(float* values, int64_t n) = 0;
  // A token shift across the chunks (multi-token prediction): out[b, t] = the value at global position
  // position(t) + k of sequence b of the whole sequences whose local tokens `local` holds ([batch, local_seq]
  // on every rank), or `fill` past the sequence's end.
  virtual void shift_tokens(const int32_t* local, int32_t* out, int64_t batch, int64_t local_seq, int64_t k,
                            int32_t fill) = 0;
};

}  // namespace forge::nn
