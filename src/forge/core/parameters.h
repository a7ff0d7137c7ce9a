// ParameterStore: every parameter of a model lives in one fp32 allocation (master weights), its gradient
// in a second, and its bf16 shadow (the GEMM operand under bf16 compute) in a third; parameters are typed
// views. Under Megatron's distributed optimizer with bf16 GEMMs the fp32 masters are the optimizer's,
// sharded over dp (release_fp32): the store then keeps fp32 only for the parameters modules read in fp32
// (norms, biases, the embedding, the router, FP8 weight casts: keep_fp32), and the bf16 shadow is the
// model's working copy of everything else. Parameters registered one after another are adjacent, which lets
// q/k/v and gate/up run as one fused GEMM over a single weight view. One allocation per state class makes the
// optimizer one pass and checkpoints and memory accounting simple.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "forge/core/tensor.h"

namespace forge {

enum class Init { normal, ones, zeros };

// How a parameter is split over the tensor-parallel group. The store holds the slice
// [start, start + shape[dim]) along `dim` of the global tensor of shape global_shape; indices at or past
// global_shape[dim] are padding (a padded vocabulary) that exists only in memory: zero, never trained,
// never saved. dim = -1: the store holds the whole tensor (replicated on every tensor-parallel rank).
struct ShardSpec {
  int dim = -1;
  int64_t start = 0;
  Shape global_shape;  // empty: the local shape (an unsplit tensor)
  // False on a copy that a lower tensor-parallel rank also holds (replicated norms, kv heads shared when
  // tp exceeds the kv heads): the global gradient norm and checkpoints count each element once.
  bool primary = true;
};

struct ParamInfo {
  std::string name;    // Hugging Face tensor name
  Shape shape;         // local shape (the shard this process holds)
  int64_t offset = 0;  // elements into the flat buffers (final once the store is allocated)
  bool weight_decay = true;
  Init init = Init::normal;
  float init_std = 0.02f;
  ShardSpec shard;
  // Weight-gradient contributions per micro-batch: the modules that accumulate into it (2 for an embedding
  // tied to the loss head in the same store).
  int grad_uses = 1;
  // The reduction group it belongs to ("dense"; expert-parallel experts get "experts"): allocate() lays each
  // group's parameters out adjacently, groups in the order they first appear, each in registration order,
  // and each group is reduced by its own gradient buckets.
  std::string group = "dense";
  // False for a frozen parameter (ParameterStore::freeze): no gradient, no optimizer state, not trained.
  bool trainable = true;
  // A module reads its fp32 weights (ParameterStore::keep_fp32): they stay whole when the fp32 master
  // weights move into the distributed optimizer's shards (ParameterStore::release_fp32).
  bool keep_fp32 = false;
  const Shape& global_shape() const { return shard.global_shape.empty() ? shape : shard.global_shape; }
};

// `count` consecutive elements of a shard, from local flat index `local`, are the global tensor's elements
// from flat index `global` on.
struct ShardRun {
  int64_t local = 0, global = 0, count = 0;
  bool operator==(const ShardRun&) const = default;
};
// Elements [flat_begin, flat_end) of a shard of `global_shape` — the slice [start, start +
// local_shape[dim]) along dim, or the whole tensor when dim = -1 — as runs in order; padding (local
// indices past the global extent) is left out. The one place that maps shard elements to global ones
// (initialisation, checkpoints, loading Hugging Face tensors).
std::vector<ShardRun> shard_runs(const Shape& local_shape, const Shape& global_shape, int dim, int64_t start,
                                 int64_t flat_begin, int64_t flat_end);
inline std::vector<ShardRun> shard_runs(const ParamInfo& p) {
  return shard_runs(p.shape, p.global_shape(), p.shard.dim, p.shard.start, 0, shape_numel(p.shape));
}

// A contiguous range of one rank's piece of a tensor, by global index: elements [flat_begin, flat_end) of
// the row-major local tensor, which is the slice [split_start, split_start + local_shape[split_dim]) along
// split_dim of the global tensor (split_dim = -1: the whole tensor). What sharded checkpoints save and load
// (ckpt/sharded.h) and what the optimizers describe their state with.
struct ShardPiece {
  std::string name;    // tensor name: the parameter's HF name, or "exp_avg.<name>", "exp_avg_sq.<name>"
  Shape global_shape;  // of the whole tensor
  Shape local_shape;   // of this rank's slice
  int split_dim = -1;
  int64_t split_start = 0;
  int64_t flat_begin = 0, flat_end = 0;  // elements of the local tensor this piece covers
  float* data = nullptr;                 // flat_end - flat_begin floats
};

// AdamW's state over a whole store, as one-process checkpoints read and write it: the two fp32 moments, laid
// out like the store's parameter buffer, and the number of updates taken.
struct OptimizerMoments {
  Tensor exp_avg, exp_avg_sq;
  int64_t steps = 0;
};

class ParameterStore {
 public:
  // Registration; returns the parameter's id. Must happen before allocate().
  int add(std::string name, Shape shape, bool weight_decay, Init init, float init_std = 0.02f,
          ShardSpec shard = {}, std::string group = "dense");
  void set_grad_uses(int id, int uses);
  // Freezing (before allocate()): the parameter keeps its weights but has no gradient (grad() refuses it), no
  // optimizer state and no part in a gradient step; modules skip its weight gradient (trainable()). Frozen
  // parameters are laid out after every trainable one, so that the gradient buffer, the optimizer's moments
  // and the gradient buckets cover [0, trained_numel()) only.
  void freeze(int id);
  bool trainable(int id) const { return infos_.at(id).trainable; }
  int64_t trained_numel() const { return trained_; }
  // The parameter is a copy of one another rank holds as primary (DualPipe's mirrored chunks): like a
  // replicated tensor-parallel copy, it is left out of the gradient norm and of checkpoints' saved pieces.
  void mark_copy(int id) { infos_.at(id).shard.primary = false; }
  // with_grads = false (inference: eval, generate, convert) leaves out the gradient buffer, a third or
  // half of the memory; gradient accessors then fail. The buffers live on `device`; initialisation and
  // loading compute on the host and copy there.
  void allocate(bool with_bf16_shadow, bool with_grads = true, Device device = Device::cpu);
  Device device() const { return device_; }
  bool has_grads() const { return grads_.defined(); }
  bool allocated() const { return params_.defined(); }

  // Deterministic: each element depends only on (seed, name, element index).
  void initialize(uint64_t seed);
  void zero_grads() {
    if (has_grads()) grads_.fill_zero();
  }
  void refresh_bf16();  // recompute the bf16 shadow from the fp32 master weights (and mark_updated())
  // The weights' version: bumped by every writer of the master weights (initialize, refresh_bf16, the
  // optimizers' steps), so that derived copies (the FP8 weight casts) know when to recompute.
  uint64_t version() const { return version_; }
  void mark_updated() { ++version_; }

  int64_t numel() const { return total_; }
  int count() const { return static_cast<int>(infos_.size()); }
  const ParamInfo& info(int id) const { return infos_.at(id); }
  const std::vector<ParamInfo>& infos() const { return infos_; }
  // Parameter ids in increasing offset order (registration order until allocate() groups them).
  const std::vector<int>& ids_by_offset() const { return by_offset_; }
  int find(const std::string& name) const;  // -1 when absent

  // The fp32 weights of a parameter (refused, naming it, when released to the distributed optimizer).
  Tensor param(int id) const { return params_.view(fp32_offset(id), infos_.at(id).shape); }
  Tensor grad(int id) const;
  // A view spanning `count` adjacent parameters from `first` as one [rows, cols] matrix (each parameter
  // [rows_i, ...] with cols elements per row) of a buffer laid out like the store (the bf16 shadow, the
  // gradients; the fp32 weights before release_fp32()).
  Tensor span(const Tensor& flat, int first, int count, int64_t cols) const;
  // The same span of the fp32 weights, before or after release_fp32().
  Tensor fp32_span(int first, int count, int64_t cols) const;

  // ---- fp32 weights under the distributed optimizer. keep_fp32 (any time before release) marks a parameter
  // whose fp32 values a module reads. release_fp32() (the distributed optimizer, once it holds the masters of
  // its shards) frees the fp32 weights of every trainable parameter not kept: params() becomes the kept
  // (and frozen) parameters alone, in offset order, each at fp32_offset(id). Needs the bf16 shadow.
  void keep_fp32(int id) { infos_.at(id).keep_fp32 = true; }
  bool keeps_fp32(int id) const { return !released_ || fp32_offsets_.at(id) >= 0; }
  void release_fp32();
  bool fp32_released() const { return released_; }
  // Where parameter `id`'s fp32 weights start in params(); fails when released.
  int64_t fp32_offset(int id) const;

  // The flat range [begin, end) of a group's parameters (empty when it has none).
  std::pair<int64_t, int64_t> group_range(const std::string& group) const;

  // ---- Gradient readiness by count. A gradient step of n micro-batches expects n * grad_uses
  // weight-gradient contributions to every parameter, in whatever order the schedule runs them; each module's
  // backward_weight reports each one (note_grad). The last one makes the parameter final for the step: the
  // finalizers whose parameters are now all final run (the tensor-parallel sums of replicated copies), then
  // every listener is told (the gradient buckets, which start reducing a bucket once all of its parameters
  // are final). The step ends when every parameter is final. Outside a step note_grad does nothing.
  void begin_grad_step(int micro_batches);
  bool grad_step_active() const { return expected_uses_ > 0; }
  // Ends a step that failed midway (an exception in it, on a one-process run that rolls back): nothing
  // is final, and the next begin_grad_step starts afresh.
  void cancel_grad_step() { expected_uses_ = 0, params_pending_ = 0; }
  void note_grad(int id);
  bool grad_final(int id) const;
  // Runs fn (collectives are allowed: every rank runs the same schedule) once per step, when every one of ids
  // has become final, before the listeners hear of them. A parameter has at most one finalizer.
  void add_grad_finalizer(std::vector<int> ids, std::function<void()> fn);
  // Returns a handle for remove_grad_listener.
  int add_grad_listener(std::function<void(int id)> fn);
  void remove_grad_listener(int handle);

  // The fp32 weights: whole, or the kept parameters only once fp32_released().
  const Tensor& params() const { return params_; }
  const Tensor& grads() const { return grads_; }  // [trained_numel()]
  const Tensor& params_bf16() const { return params_bf16_; }
  bool has_bf16() const { return params_bf16_.defined(); }

 private:
  std::vector<ParamInfo> infos_;
  std::vector<int> by_offset_;
  std::unordered_map<std::string, int> by_name_;
  int64_t total_ = 0, trained_ = 0;
  uint64_t version_ = 0;
  bool released_ = false;
  std::vector<int64_t> fp32_offsets_;  // after release_fp32(): into params_, -1 where released
  void announce_final(int id);

  Device device_ = Device::cpu;
  Tensor params_, grads_, params_bf16_;

  struct Finalizer {
    std::vector<int> ids;
    std::function<void()> fn;
    int pending = 0;
  };
  int expected_uses_ = 0;           // per parameter and use in the current step (0: no step)
  std::vector<int> grads_seen_;     // contributions so far, per parameter
  std::vector<int> finalizers_of_;  // per parameter: its finalizer's index (-1: none; empty: no finalizers)
  std::vector<Finalizer> finalizers_;
  std::vector<std::pair<int, std::function<void(int)>>> listeners_;
  int next_listener_ = 0, params_pending_ = 0;
};

}  // namespace forge
