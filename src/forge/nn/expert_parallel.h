// Expert parallelism as modules see it: the expert-parallel group (ExpertParallel, implemented over a
// comm::Communicator in parallel/comm_expert_parallel.h; nn/ knows nothing of MPI or NCCL), and the token
// dispatcher that moves a micro-batch's sorted assignments to the ranks holding their experts and back.
//
// The experts are split evenly and contiguously: rank p of an ep-rank group holds experts
// [p * L, (p + 1) * L), L = experts / ep. A Moe layer sorts its assignments by (global) expert, which is
// also by destination rank, so each rank's share is one contiguous block of the sorted rows. The dispatch:
//   1. the counts: every rank tells every other how many rows it sends each of that rank's L experts
//      (an all-to-all of ep * L integers, on the host: the grouped GEMMs take their offsets there);
//   2. the rows: an all-to-all(v) of the sorted rows, arriving source-major ([from rank 0: its rows for
//      local expert 0, 1, ...][from rank 1: ...]...);
//   3. the local permute: source-major to expert-major ([expert 0: from rank 0, 1, ...][expert 1: ...]), so
//      that every local expert owns one contiguous run of rows (DispatchPlan::local_offsets).
// The combine runs the same steps backwards. In backward the gradient of a dispatch is a combine of the
// gradient and the gradient of a combine a dispatch: both only move rows, so a round trip returns its input
// bit for bit. The routing weights stay with the source rank, which combines the expert outputs it got back.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "forge/core/tensor.h"

namespace forge::nn {

class ExpertParallel {
 public:
  // A row transfer in flight; wait() returns once the receive buffer holds its rows.
  class Transfer {
   public:
    virtual ~Transfer() = default;
    virtual void wait() = 0;
    // Lets the transfer advance without blocking (MPI moves a large message only inside its calls).
    virtual void progress() {}
  };

  virtual ~ExpertParallel() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Host, synchronous: send[size * n] (block j for rank j) -> recv[size * n] (block j from rank j).
  virtual void exchange_counts(const int64_t* send, int64_t* recv, int64_t n) = 0;
  // Rows of `cols` elements, fp32 or bf16 (send's and recv's dtype, the same): send's first send_rows[0] rows
  // go to rank 0, the next send_rows[1] to rank 1, ...; recv receives recv_rows[j] rows from rank j in rank
  // order. Asynchronous: both tensors must stay alive and untouched until wait(). On the tensors' device (a
  // GPU's through its own communicator).
  virtual std::unique_ptr<Transfer> all_to_all_rows(const Tensor& send, std::span<const int64_t> send_rows,
                                                    const Tensor& recv, std::span<const int64_t> recv_rows,
                                                    int64_t cols) = 0;
};

// Where one micro-batch's sorted rows go and come from, on this rank.
struct DispatchPlan {
  int ranks = 1, rank = 0;             // of the expert-parallel group
  int64_t local_experts = 0;           // L
  int64_t first_expert = 0;            // this rank's first expert (global index)
  std::vector<int64_t> send_rows;      // [ranks]: sorted rows this rank sends each rank
  std::vector<int64_t> recv_counts;    // [ranks * L]: rows from rank s for local expert l, at s * L + l
  std::vector<int64_t> recv_rows;      // [ranks]: rows from each rank
  std::vector<int64_t> local_offsets;  // [L + 1]: expert l owns rows [local_offsets[l], local_offsets[l + 1])
  int64_t sent() const;                // rows sent to other ranks (the all-to-all volume out, in rows)
  // Rows this rank's experts take, its own included.
  int64_t received() const { return local_offsets.back(); }
};

// The plan from the sort's offsets [experts + 1] (expert e owns sorted rows [offsets[e], offsets[e + 1])).
// Collective over ep (the counts' exchange). ep null or of one rank: every expert is local, nothing moves.
DispatchPlan plan_dispatch(ExpertParallel* ep, std::span<const int64_t> offsets);

// Moves rows [n, cols] (fp32 or bf16, in their dtype) along a plan: to the experts (source-sorted rows in,
// expert-major local rows out) or back from them (expert-major in, source-sorted out). start() launches the
// transfer and returns at once, so that other work (the shared experts) runs while the rows travel; finish()
// waits and returns the moved rows. Without other ranks the rows are returned as they are. Inside an
// overlapped pair (core/fibers.h: DualPipe's forward of one micro-batch beside the backward of another)
// finish() first yields to the partner, whose compute then hides the transfer; it yields at every finish of a
// moving transfer, whatever the timing, so that every rank interleaves the same way.
class ExpertDispatch {
 public:
  void start(ExpertParallel* ep, const DispatchPlan& plan, const Tensor& rows, int64_t cols, bool to_experts);
  Tensor finish();

 private:
  const DispatchPlan* plan_ = nullptr;
  bool to_experts_ = true;
  int64_t cols_ = 0;
  Tensor send_, recv_;
  std::unique_ptr<ExpertParallel::Transfer> transfer_;
};

// Source-major rows [from rank 0: expert 0..L-1][from rank 1: ...] to expert-major ones, or back
// (to_expert_major = false): one row gather on the rows' device.
Tensor regroup_rows(const Tensor& rows, int64_t cols, const DispatchPlan& plan, bool to_expert_major);

// The synchronous forms: start + finish.
Tensor dispatch_rows(ExpertParallel* ep, const DispatchPlan& plan, const Tensor& sorted_rows, int64_t cols);
Tensor combine_rows(ExpertParallel* ep, const DispatchPlan& plan, const Tensor& local_rows, int64_t cols);

}  // namespace forge::nn
