// Context parallelism: every sequence split over the ranks of a cp group, and causal attention computed
// across them.
//
// The split is load-balanced for the causal mask, as Megatron-LM's: a sequence of `seq` tokens is cut into
// 2·cp chunks of seq / (2·cp), and rank r holds chunk r followed by chunk 2·cp − 1 − r (an early chunk, whose
// queries see few keys, with a late one, whose queries see many), so every rank does the same attention work.
// RoPE positions stay global (ContextSplit::position).
//
// Attention across the group, forward and backward, in two modes:
//   ring        keys and values travel around the ring (cp − 1 hops, the next block's transfer in flight
//               while the current block computes); each local query chunk attends to each arriving key chunk
//               that is not entirely in its future (the diagonal chunk under the causal mask, earlier ones in
//               full), and the partial results are merged by their log-sum-exp. Backward replays the same
//               blocks against the final output and log-sum-exp, and the key/value gradients travel with
//               their keys and values, home after cp hops.
//   all_to_all  (Ulysses) one all-to-all scatters the heads and gathers the sequence, so each rank runs the
//               whole sequence's causal attention for heads / cp heads (and kv_heads / cp kv heads), and one
//               all-to-all brings the outputs back. Needs heads and kv_heads divisible by cp.
// Both take the local tokens as ops::AttentionParams do (q [batch, local, heads, head_dim] with q_stride
// between tokens, k and v [batch, local, kv_heads, ...], out, lse [batch, heads, local]), with seq = the
// local length, the default (dense) batch and head strides, causal attention, in memory of `device` (the
// communicator's: MPI for the host, NCCL for a GPU). The packing, merging and gradient sums run as ops on
// that device (strided_copy, attention_merge, add_inplace), so nothing goes through the host. Grouped-query
// and MLA shapes (v_head_dim != head_dim) are supported.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/kernels/ops.h"

namespace forge::parallel {

struct ContextSplit {
  int cp = 1, rank = 0;
  int64_t seq = 0;  // tokens of the whole sequence

  // Fails with one line unless seq divides into 2·cp chunks (and 0 <= rank < cp).
  static ContextSplit make(int cp, int rank, int64_t seq);
  int64_t chunk() const { return seq / (2 * cp); }
  int64_t local() const { return 2 * chunk(); }  // tokens this rank holds
  // The global chunk of half h (0, 1) of rank r's tokens.
  int64_t chunk_of(int half, int r) const { return half == 0 ? r : 2 * cp - 1 - r; }
  // The global position of local token t (0 <= t < local()).
  int64_t position(int64_t t) const { return chunk_of(t < chunk() ? 0 : 1, rank) * chunk() + t % chunk(); }
  // Copies this rank's tokens out of a whole sequence: for each of `batch` sequences of seq tokens of
  // `width` elements (row-major), the local() tokens, in local order.
  template <typename T>
  void take_local(const T* whole, T* local, int64_t batch, int64_t width) const {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < this->local(); ++t)
        for (int64_t i = 0; i < width; ++i)
          local[(b * this->local() + t) * width + i] = whole[(b * seq + position(t)) * width + i];
  }
};

enum class ContextAttention { ring, all_to_all };
ContextAttention context_attention_from_name(const std::string& name);  // "ring" (or "p2p"), "all_to_all"
const char* context_attention_name(ContextAttention mode);
const char* context_attention_setting(ContextAttention mode);  // parallel.cp_comm's spelling: "p2p", "a2a"

// What keeps a run from splitting over cp ranks, for the trainer, the simulator and the plan search alike:
// `setting` names the key at fault ("data.seq_len", "parallel.cp_comm") and `problem` says why; both empty
// when it splits. heads and kv_heads are one tensor-parallel rank's.
struct ContextSplitProblem {
  std::string setting, problem;
  bool none() const { return problem.empty(); }
};
ContextSplitProblem context_split_problem(int cp, ContextAttention mode, int64_t seq, int64_t heads,
                                          int64_t kv_heads);

// Where the attention across the group spent its time on this rank, added up over calls: the compute (the
// attention blocks, the merges, the packing) and the time blocked in transfers (the communication compute did
// not hide), and the bytes sent. step_compute: the ring's compute seconds of each of its cp steps in the
// last call (a replay of the ring needs them: bench/parallel/cp_bench.cpp).
struct ContextAttentionStats {
  int64_t calls = 0, bytes_sent = 0;
  double compute_seconds = 0, wait_seconds = 0;
  std::vector<double> step_compute;
};

// Causal attention of this rank's local tokens over the whole sequence of the cp group. p as described
// above; every rank of `cp` calls it with the same shapes. Writes p.out and p.lse.
void context_attention_forward(comm::Communicator& cp, const ContextSplit& split, ContextAttention mode,
                               const ops::AttentionParams& p, ContextAttentionStats* stats = nullptr,
                               Device device = Device::cpu);
// Its backward: reads p.q, k, v, out, lse (the forward's) and dout; writes dq, dk, dv (overwrite) for the
// local tokens.
void context_attention_backward(comm::Communicator& cp, const ContextSplit& split, ContextAttention mode,
                                const ops::AttentionParams& p, ContextAttentionStats* stats = nullptr,
                                Device device = Device::cpu);

}  // namespace forge::parallel
