// ParameterStore: every parameter of a model lives in one fp32 allocation (master weights), its gradient
// in a second, and its bf16 shadow (the GEMM operand under bf16 compute) in a third; parameters are typed
// views. Parameters registered one after another are adjacent, which lets q/k/v and gate/up run as one
// fused GEMM over a single weight view. One allocation per state class makes the optimizer one pass and
// checkpoints and memory accounting simple.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "forge/core/tensor.h"

namespace forge::nn {

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
  std::string name;  // Hugging Face tensor name
  Shape shape;       // local shape (the shard this process holds)
  int64_t offset = 0;  // elements into the flat buffers
  bool weight_decay = true;
  Init init = Init::normal;
  float init_std = 0.02f;
  ShardSpec shard;
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

class ParameterStore {
 public:
  // Registration; returns the parameter's id. Must happen before allocate().
  int add(std::string name, Shape shape, bool weight_decay, Init init, float init_std = 0.02f,
          ShardSpec shard = {});
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
  int find(const std::string& name) const;  // -1 when absent

  Tensor param(int id) const { return params_.view(infos_[id].offset, infos_[id].shape); }
  Tensor grad(int id) const;
  // A view spanning `count` adjacent parameters from `first` as one [rows, cols] matrix.
  Tensor span(const Tensor& flat, int first, int count, int64_t cols) const;

  const Tensor& params() const { return params_; }
  const Tensor& grads() const { return grads_; }
  const Tensor& params_bf16() const { return params_bf16_; }
  bool has_bf16() const { return params_bf16_.defined(); }

 private:
  std::vector<ParamInfo> infos_;
  std::unordered_map<std::string, int> by_name_;
  int64_t total_ = 0;
  uint64_t version_ = 0;
  Device device_ = Device::cpu;
  Tensor params_, grads_, params_bf16_;
};

}  // namespace forge::nn
