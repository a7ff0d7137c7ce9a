// AdamW under data parallelism, with ZeRO-1 when the gradient buckets are sharded.
//
// Sharded (Megatron's distributed optimizer): each dp rank keeps fp32 Adam moments only for the ranges it
// owns (its shard of every gradient bucket, where GradBuckets left the summed gradient), updates those
// ranges of the fp32 master weights, then all-gathers the updated weights bucket by bucket so every rank
// holds the whole model again, and refreshes the bf16 shadow. Unsharded: every rank owns everything (the
// gradients were all-reduced) and the update is exactly forge::optim::AdamW's.
//
// Sharded with a bf16 shadow (bf16 GEMMs), the fp32 master weights are sharded too: the optimizer holds the
// masters of its owned ranges and the store frees its fp32 weights (ParameterStore::release_fp32) except
// those modules read in fp32 (keep_fp32: norms, biases, the embedding, the router, FP8 weight casts), whose
// store copy serves as their master. Per parameter a rank then holds 2 bytes of bf16 weights, 4 of fp32
// gradient and 12/dp of master and moments, Megatron's 6 + 12/dp. The gather moves bf16 (Megatron's bf16
// parameter gather): each owner writes the bf16 of its updated masters into the bf16 weights, which are
// all-gathered in place, and the kept parameters' fp32 values of each shard are all-gathered beside them;
// a group mostly kept in fp32 (FP8 recipes keep every Linear's weights) gathers in fp32 through the gradient
// buffer, spent once the update is done, instead. Either way every rank's bf16 weights and kept fp32
// weights are exactly the owners' (the numbers equal those of unsharded masters bit for bit).
//
// On a device (GPUs) the state lives in device memory: the all-gathers run over the gradient buckets'
// communicator (NCCL), and only host scalars (the norm's sums) go over `dp` and `model_parallel` (MPI).
//
// Offloaded (OptimizerOffload::host, a device run with a bf16 shadow: Megatron's optimizer CPU offload,
// DeepSpeed's ZeRO-Offload): the fp32 masters of every owned parameter (the kept ones too) and both moments
// live in host memory, and the device frees its fp32 weights but the kept ones. Each step copies the owned
// ranges' reduced gradients to the host, updates there (the CPU AdamW kernel, the same arithmetic as the
// device's, so the numbers are bitwise those of the device update), and copies the updated fp32 weights back
// into the gradient buffer, from where the gather (sharded) or a local copy (unsharded) writes the bf16
// weights and the kept fp32 ones. The device then holds 2 bytes of bf16 weights and 4 of fp32 gradient per
// parameter (plus the kept parameters' fp32), the host 16 per owned parameter (masters, moments, the
// gradients' landing buffer). In the device emulation's dry run (kernels/emulated_device.h, check_only) the
// host state is counted, not allocated, and the host update is skipped, so models far larger than this
// machine plan their offloaded runs.
//
// The gradient norm counts each element of the model once: over the owned ranges, only parameters whose
// ShardSpec is primary (a replicated copy on a higher tensor-parallel rank is skipped), summed over dp
// when sharded and over the model-parallel group (tp x pp ranks holding different parts) always.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/parameters.h"
#include "forge/core/tensor.h"
#include "forge/core/worker_thread.h"
#include "forge/optim/adamw.h"
#include "forge/parallel/grad_buckets.h"

namespace forge::parallel {

// One parameter group as the optimizer sees it: the gradient buckets that reduce it (which say whether it is
// sharded, ZeRO-1, and over which ranks) and the communicator of host values (norms) over the same ranks.
struct OptimizerGroup {
  const GradBuckets* buckets = nullptr;
  comm::Communicator* dp = nullptr;
  // Ranks holding other parameters of the group (expert parallelism's ep group: other experts), over which
  // the norm's sum is added as well; null: every dp rank holds the group's parameters.
  comm::Communicator* parts = nullptr;
};

// Where the optimizer's state lives.
enum class OptimizerOffload { none, host };

class DistributedAdamW {
 public:
  // One group per parameter group of the store (ParamInfo::group: dense, experts, ...), each sharded or not
  // over its own data-parallel ranks. model_parallel may be null (one model-parallel rank). All pointers must
  // outlive the optimizer.
  DistributedAdamW(ParameterStore* store, optim::AdamWConfig config, std::vector<OptimizerGroup> groups,
                   comm::Communicator* model_parallel, OptimizerOffload offload = OptimizerOffload::none);
  // One group. buckets may be null (unsharded, nothing to gather); when sharded, it must reduce over `dp`.
  DistributedAdamW(ParameterStore* store, optim::AdamWConfig config, comm::Communicator* dp,
                   comm::Communicator* model_parallel, const GradBuckets* buckets)
      : DistributedAdamW(store, config, std::vector<OptimizerGroup>{{buckets, dp}}, model_parallel) {}
  ~DistributedAdamW();  // unpins the offloaded state
  DistributedAdamW(const DistributedAdamW&) = delete;
  DistributedAdamW& operator=(const DistributedAdamW&) = delete;

  // Global gradient norm (collective over each sharded group's dp and over model_parallel). Call after
  // GradBuckets::finish(): only the owned ranges hold summed gradients.
  double grad_norm() const;
  // One update with learning rate lr, gradients first multiplied by grad_scale (clipping). Collective over
  // dp when sharded; afterwards every rank holds the same full parameters and bf16 shadow.
  void step(float lr, float grad_scale);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t step) { step_ = step; }
  const optim::AdamWConfig& config() const { return config_; }
  bool sharded() const { return sharded_; }
  // Flat ranges of the store this rank updates, in offset order; the moments are their concatenation.
  const std::vector<std::pair<int64_t, int64_t>>& owned_ranges() const { return owned_; }
  const Tensor& exp_avg() const { return exp_avg_; }  // undefined in an offloaded dry run
  int64_t moment_numel() const { return moment_numel_; }
  const Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  // Bytes of optimizer state on this rank (both moments, and the sharded master weights it holds), wherever
  // it lives.
  int64_t state_bytes() const {
    return (2 * moment_numel_ + master_numel()) * static_cast<int64_t>(sizeof(float));
  }
  bool offloaded() const { return offload_ == OptimizerOffload::host; }
  // Host memory the offloaded state takes (the state, the gradients' landing buffer and the bf16 staging of
  // the widest bucket; counted, not allocated, in a dry run); 0 unless offloaded.
  int64_t host_bytes() const {
    return offloaded()
               ? state_bytes() + moment_numel_ * static_cast<int64_t>(sizeof(float)) + host_staging_bytes_
               : 0;
  }
  // Bytes each step copies to the host (owned gradients, fp32) and back (the updated owned weights: bf16,
  // or fp32 where the group gathers in fp32 or keeps the parameter in fp32), and the pieces (a bucket's
  // owned part each) the three stages pipeline over; 0 unless offloaded.
  int64_t offload_down_bytes() const { return offload_down_bytes_; }
  int64_t offload_up_bytes() const { return offload_up_bytes_; }
  int64_t offload_chunks() const { return static_cast<int64_t>(chunks_.size()); }
  // The fp32 master weights this rank holds apart from the store (sharded with a bf16 shadow), in offset
  // order of the owned ranges, kept parameters left out; undefined otherwise.
  bool holds_masters() const { return master_numel_ > 0 || masters_.defined(); }
  const Tensor& masters() const { return masters_; }
  int64_t master_numel() const { return master_numel_; }
  // The fp32 master weight of element `flat` (a store offset) of parameter `info` (one of the store's
  // infos()): in the store's fp32 weights, or with sharded masters for a parameter not kept in masters()
  // (refused outside the owned ranges); host: in the checkpoint staging copies of either.
  float* master(const ParamInfo& info, int64_t flat, bool host = false) const;

  // Pieces to save: the moments ("exp_avg.<name>", "exp_avg_sq.<name>") and, with include_params, the
  // weights (fp32 masters), of primary tensor-parallel copies only, each element from exactly one dp rank
  // (its owner when sharded, dp rank 0 otherwise).
  std::vector<ShardPiece> checkpoint_pieces(bool include_params) const;
  // Destinations to load: with include_params the whole local weights on every rank (replicated copies
  // too; with sharded masters the owned ranges and frozen parameters only), and the moments of every
  // parameter in the owned ranges. Afterwards call finish_load() (collective over dp with sharded masters: it
  // gathers the weights), store->refresh_bf16() and set_steps_taken().
  std::vector<ShardPiece> checkpoint_pieces_for_load(bool include_params) const;
  // State on a device is saved and loaded through host copies: checkpoint_pieces() copies it there first and
  // finish_save() frees them once the checkpoint is written; finish_load() copies what a load wrote back to
  // the device and frees them. Both do nothing on the CPU.
  void finish_save();
  void finish_load();

 private:
  // The moments of flat element `index`, which lies in owned range `range`.
  int64_t moment_index(size_t range, int64_t index) const {
    return moment_offsets_[range] + index - owned_[range].first;
  }
  // The updated weights made whole on every rank of group g: in fp32 through the gradient buffer (fp32
  // weights, or most of the group kept in fp32, as under FP8), else in bf16 straight into the bf16 weights
  // with the kept parameters' fp32 values gathered beside them (Megatron's bf16 parameter gather).
  void gather_params(size_t g);
  void gather_params() {
    for (size_t g = 0; g < groups_.size(); ++g)
      if (group_sharded(g) || (offloaded() && groups_[g].buckets)) gather_params(g);
  }
  void gather_fp32(size_t g);
  // Offloaded: waits for the host's update of bucket i of group g (queued by step_on_host).
  void await_update(size_t g, size_t i);
  void gather_bf16(size_t g);
  // Calls fn(src, lo, hi) for each run of the store's flat range [begin, end) whose masters lie adjacent
  // (src: the master of element lo, in the masters' memory).
  template <typename Fn>
  void for_each_master_run(int64_t begin, int64_t end, Fn&& fn) const;
  // Copies the masters of the store's flat range [begin, end) to dst, a view of the weights' device (or
  // the host's) memory.
  void copy_masters(int64_t begin, int64_t end, Tensor dst) const;
  // Writes the bf16 of the masters of [begin, end) into dst (bf16 device memory); offloaded, also copies the
  // kept parameters' masters of the range into the store's fp32 weights.
  void write_bf16(int64_t begin, int64_t end, Tensor dst);
  // How each bucket of a bf16-gathered group gathers its kept parameters: per rank, the runs (fp32 offset
  // in the store's weights, count) its shard holds, their counts, and where the bucket's block lies in the
  // group's send and receive buffers.
  struct KeptGather {
    std::vector<std::vector<std::pair<int64_t, int64_t>>> runs;  // by dp rank
    std::vector<int64_t> counts;                                 // by dp rank
    int64_t send_offset = 0, recv_offset = 0, total = 0;
  };
  void plan_bf16_gathers();
  void plan_offload_chunks();
  // The offloaded update: gradients to the host, AdamW there.
  void step_on_host(float lr, float grad_scale);
  // A dry run (the emulation's check_only) with offload: host state counted, not allocated.
  bool dry_host() const;
  // Pins an offloaded host buffer (fast copies to and from the device), unpinned by the destructor.
  void pin(const Tensor& host);
  std::vector<void*> pinned_;
  void hold_masters();
  bool group_sharded(size_t g) const { return groups_[g].buckets && groups_[g].buckets->sharded(); }
  // Appends the pieces of [begin, end) of the store (owned range `range`, or -1: params only).
  void append_pieces(std::vector<ShardPiece>& pieces, int64_t begin, int64_t end, int range, bool params,
                     bool moments, bool primary_only) const;
  // Where checkpoint pieces point: the state itself on the CPU, else host copies (download: filled from the
  // device now; otherwise allocated for a load).
  void stage_on_host(bool download, bool with_params) const;
  bool on_device() const { return store_->device() != Device::cpu; }
  // Whether the moments (and sharded masters) live on a device: checkpoints stage them through the host.
  bool state_on_device() const { return on_device() && !offloaded(); }

  ParameterStore* store_;
  optim::AdamWConfig config_;
  std::vector<OptimizerGroup> groups_;
  comm::Communicator* model_parallel_;
  OptimizerOffload offload_ = OptimizerOffload::none;
  bool sharded_ = false;  // any group
  int64_t moment_numel_ = 0, master_numel_ = 0;
  std::vector<std::pair<int64_t, int64_t>> owned_;
  std::vector<size_t> range_group_;  // the group of each owned range
  std::vector<int64_t> moment_offsets_;
  Tensor exp_avg_, exp_avg_sq_;
  // Sharded masters: [begin, end) of the store's flat range lies at masters_ offset `offset`.
  struct MasterRun {
    int64_t begin = 0, end = 0, offset = 0;
  };
  std::vector<MasterRun> master_runs_;
  Tensor masters_;
  mutable Tensor host_params_, host_exp_avg_, host_exp_avg_sq_,
      host_masters_;    // device runs: checkpoint staging
  Tensor gather_recv_;  // sharded: a bucket padded to a multiple of the dp ranks (gathered in place)
  Tensor host_grads_;   // offloaded: the owned ranges' gradients, in moment order
  // bf16 gathers: by group, whether it gathers in bf16, and per bucket its kept parameters' gather; the
  // padded receive buffer in bf16, the kept values' send and receive buffers by group, the offloaded bf16
  // staging on the host.
  std::vector<bool> bf16_gather_;
  std::vector<std::vector<KeptGather>> kept_gathers_;
  std::vector<Tensor> kept_send_, kept_recv_;
  Tensor bf16_recv_, host_bf16_;
  int64_t host_staging_bytes_ = 0, offload_down_bytes_ = 0, offload_up_bytes_ = 0;
  // Offloaded: each bucket's owned part (its moments at `moments`), in the order the gathers take them; per
  // group and bucket its chunk (-1: none); the worker's ticket of each chunk's update this step (-1: none
  // pending). The host updates one chunk while the calling thread copies the next one's gradients down and
  // the previous one's weights up.
  struct OffloadChunk {
    int64_t lo = 0, hi = 0, moments = 0;
  };
  std::vector<OffloadChunk> chunks_;
  std::vector<std::vector<int>> chunk_of_bucket_;
  std::vector<int64_t> chunk_ticket_;
  std::unique_ptr<WorkerThread> worker_;
  int64_t step_ = 0;
};

}  // namespace forge::parallel
