// Data-parallel gradient reduction in buckets, overlapped with backward.
//
// GradBuckets cuts the flat gradient range of one parameter group of a ParameterStore (BucketOptions::group)
// into contiguous ranges of about bucket_bytes (a boundary may fall inside a parameter: a bucket is a flat
// range) and reduces each one (SUM over the group's dp communicator) as soon as every parameter overlapping
// it is final for the step: readiness by count (ParameterStore::begin_grad_step / note_grad), whatever order
// the schedule runs the weight gradients in, so communication runs while other layers still compute.
//
// shard (ZeRO, Megatron's distributed-optimizer layout): every bucket splits into dp equal shards (the last
// one padded in a staging copy) and is reduce-scattered in place: after finish(), rank r holds the summed
// gradient of shard r of every bucket (its owned ranges); elsewhere its gradient buffer is undefined (fp32
// reductions overwrite it: no buffer of the reduced shards beside the gradients, as Megatron's; bf16 ones
// leave the local values).
// Without shard, buckets are all-reduced in place and every rank owns the whole buffer. With
// BucketOptions::reduce_dtype bf16 a bucket travels as a bf16 copy, reduced and widened back on completion.
//
// Gradients in device memory reduce over a communicator of that memory (NCCL); the staging copies run in the
// device's stream order, which the communicator waits for before it starts. With one dp rank nothing is
// communicated at all: the bucket already holds its sum.
//
// Use, per optimizer step, during the backward of the last micro-batch (gradients of earlier micro-batches
// are accumulated locally first):
//   store.begin_grad_step(micro_batches); begin_step(); ... backward (each final parameter is announced by
//   the store; a bucket launches when its last one is) ...; finish();
// ready_from(offset) is the manual alternative, for callers that know a suffix of the buffer is final.
// Callers scale losses so that the sum over dp is the global mean.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/parameters.h"
#include "forge/core/tensor.h"

namespace forge::parallel {

struct BucketOptions {
  int64_t bucket_bytes = 32ll << 20;  // fp32 gradient bytes per bucket (rounded to whole aligned shards)
  bool shard = false;                 // ZeRO: reduce-scatter, each rank owns one shard of every bucket
  bool overlap = true;                // launch buckets as they become ready; off: everything in finish()
  std::string group = "dense";        // the parameter group (ParamInfo::group) these buckets reduce
  // What the buckets travel and are summed in: f32, or bf16 (Megatron's grad_reduce_in_bf16): each bucket
  // rounded to bf16 once reduced (after the micro-batches' local fp32 accumulation), summed by the
  // communicator in fp32 and rounded at each of its additions, widened back into the fp32 gradients. Half
  // the bytes; the staging copies live while their bucket is in flight.
  DType reduce_dtype = DType::f32;
};

// The bucket size when a run asks for none (parallel.bucket_mb = 0). Host memory over MPI: 4 MiB, small
// enough that reduction starts early in backward and MPI's host-side copies stay cache-sized. Device memory
// (NCCL): Megatron's max(40M, 1M x dp) fp32 elements, since a ring pays its latency per bucket and per step
// (with 4 MiB buckets a 70B layer's gradients make thousands of launches a step; docs/simulator.md measured
// +56% to +66% on B200s against the same run with Megatron's buckets).
int64_t default_bucket_bytes(bool device_memory, int dp);
// bucket_mb (MiB; 0 = the default above) as bytes.
int64_t bucket_bytes_of(double bucket_mb, bool device_memory, int dp);

// Flat range [begin, end) of the gradient buffer. Under shard it splits into `shards` (= dp) shards of
// shard_size elements; in the one bucket that does not divide, the last shards reach into padding.
struct GradBucket {
  int64_t begin = 0, end = 0;
  int64_t shard_size = 0;  // ceil((end - begin) / dp) under shard; end - begin otherwise
  int shards = 1;
  int64_t size() const { return end - begin; }
  int64_t padded_size() const { return shard_size * shards; }
};

// Communication time of reductions. exposed: inside finish() (launching what was left and waiting);
// communication: the union over buckets of [launch, completion observed], where completion is observed by
// polling in ready_from() and finish(), so it can overstate the time the network was busy.
struct GradReductionStats {
  int64_t steps = 0;
  int64_t bytes = 0;  // gradient bytes reduced
  double exposed_seconds = 0;
  double communication_seconds = 0;
  // Share of communication hidden behind backward: 1 - exposed / communication, in [0, 1].
  double overlap_ratio() const;
};

class GradBuckets {
 public:
  GradBuckets(ParameterStore* store, comm::Communicator* dp, BucketOptions options);
  ~GradBuckets();  // waits for reductions still in flight (their buffers are about to go away)
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;

  void begin_step();
  // Every gradient at flat index >= flat_offset is final for this step: with overlap, launches each bucket
  // lying wholly at or above it, and polls those in flight so that MPI progresses while backward computes.
  void ready_from(int64_t flat_offset);
  // Parameter `id` is final for this step (the store's listener calls it): with overlap, launches each bucket
  // whose parameters are now all final, and polls those in flight.
  void param_ready(int id);
  // Launches the buckets not launched yet, waits for all; afterwards the owned ranges hold the sum over dp.
  void finish();
  // Ends a step that failed midway, waiting for whatever reduction it had launched (their results are
  // discarded): the next begin_step starts afresh.
  void cancel_step();

  bool sharded() const { return options_.shard; }
  const std::string& group() const { return options_.group; }
  bool overlapped() const { return options_.overlap; }
  int64_t bucket_bytes() const { return options_.bucket_bytes; }
  comm::Communicator* dp() const { return dp_; }
  const ParameterStore& store() const { return *store_; }
  // In offset order; launched from the last.
  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // This rank's shard of bucket i, clipped to the bucket (may be empty); the whole bucket when unsharded.
  std::pair<int64_t, int64_t> owned_range(int bucket) const {
    return owned_range(bucket, options_.shard ? dp_->rank() : 0);
  }
  // The same for dp rank `rank` (the whole bucket when unsharded).
  std::pair<int64_t, int64_t> owned_range(int bucket, int rank) const;
  // The non-empty owned ranges of every bucket, in offset order; {[0, numel)} when unsharded.
  std::vector<std::pair<int64_t, int64_t>> owned_ranges() const;
  int buckets_launched() const { return launched_; }  // in the current step

  const GradReductionStats& last_step_stats() const { return last_step_; }
  const GradReductionStats& total_stats() const { return total_; }
  void reset_stats() { total_ = {}; }

 private:
  struct InFlight {
    comm::Request request;
    double launched_at = 0, completed_at = 0;
    bool launched = false, completed = false;
    Tensor staged, received;  // bf16 reductions: the bucket in bf16 (padded under shard), the reduced shard
  };
  bool in_bf16() const { return options_.reduce_dtype == DType::bf16; }
  void launch_bf16(int bucket);
  void launch(int bucket);
  void complete(int bucket);  // after the request finished: copy the reduced shard into the gradients
  void poll();
  void launch_if_pending(int bucket);

  ParameterStore* store_;
  comm::Communicator* dp_;
  BucketOptions options_;
  std::vector<GradBucket> buckets_;
  Tensor padded_;  // under shard: send buffer of the one bucket that does not divide into dp shards
  std::vector<InFlight> in_flight_;
  std::vector<std::vector<int>> buckets_of_param_;  // per parameter id: the buckets it overlaps
  std::vector<int> params_in_bucket_,
      params_waiting_;  // per bucket: overlapping parameters, those not final yet
  int listener_ = -1;
  int launched_ = 0;
  int next_ = -1;  // next bucket to launch (descending); -1: none
  bool in_step_ = false;
  double finish_started_at_ = 0;
  GradReductionStats last_step_, total_;
};

}  // namespace forge::parallel
