#include "forge/core/parameters.h"

#include <algorithm>

#include "forge/core/init.h"

namespace forge {

int ParameterStore::add(std::string name, Shape shape, bool weight_decay, Init init, float init_std,
                        ShardSpec shard, std::string group) {
  FORGE_CHECK(!allocated(), "parameter '{}' registered after allocation", name);
  FORGE_CHECK(!by_name_.count(name), "parameter '{}' registered twice", name);
  for (int64_t d : shape)
    if (d <= 0) fail("parameter '{}' has a non-positive dimension in {}", name, shape_string(shape));
  if (shard.dim >= 0) {
    FORGE_CHECK(shard.dim < static_cast<int>(shape.size()) && shard.global_shape.size() == shape.size() &&
                    shard.start >= 0,
                "parameter '{}': shard of {} at {} along dim {} does not fit the global shape {}", name,
                shape_string(shape), shard.start, shard.dim, shape_string(shard.global_shape));
    for (size_t d = 0; d < shape.size(); ++d)
      FORGE_CHECK(static_cast<int>(d) == shard.dim || shape[d] == shard.global_shape[d],
                  "parameter '{}': shard {} and global shape {} differ outside the split dimension", name,
                  shape_string(shape), shape_string(shard.global_shape));
  } else if (shard.global_shape.empty()) {
    shard.global_shape = shape;
  }
  ParamInfo info{std::move(name), std::move(shape), total_, weight_decay, init, init_std, std::move(shard)};
  info.group = std::move(group);
  // No padding: parameters registered in a row form one contiguous matrix (fused q|k|v, gate|up).
  total_ += shape_numel(info.shape);
  by_name_[info.name] = static_cast<int>(infos_.size());
  by_offset_.push_back(static_cast<int>(infos_.size()));
  infos_.push_back(std::move(info));
  return static_cast<int>(infos_.size()) - 1;
}

void ParameterStore::set_grad_uses(int id, int uses) {
  FORGE_CHECK(uses >= 1, "parameter '{}': {} gradient uses per micro-batch", infos_.at(id).name, uses);
  infos_.at(id).grad_uses = uses;
}

void ParameterStore::freeze(int id) {
  FORGE_CHECK(!allocated(), "parameter '{}' frozen after allocation", infos_.at(id).name);
  infos_.at(id).trainable = false;
}

std::pair<int64_t, int64_t> ParameterStore::group_range(const std::string& group) const {
  int64_t begin = -1, end = -1;
  for (const ParamInfo& p : infos_)
    if (p.group == group && p.trainable) {
      if (begin < 0) begin = p.offset;
      end = p.offset + shape_numel(p.shape);
    }
  return begin < 0 ? std::pair<int64_t, int64_t>{0, 0} : std::pair<int64_t, int64_t>{begin, end};
}

void ParameterStore::begin_grad_step(int micro_batches) {
  FORGE_CHECK(micro_batches >= 1, "a gradient step of {} micro-batches", micro_batches);
  FORGE_CHECK(!grad_step_active(),
              "begin_grad_step: the previous step still waits for {} parameters' gradients", params_pending_);
  expected_uses_ = micro_batches;
  grads_seen_.assign(infos_.size(), 0);
  params_pending_ = static_cast<int>(
      std::count_if(infos_.begin(), infos_.end(), [](const ParamInfo& p) { return p.trainable; }));
  for (Finalizer& f : finalizers_) f.pending = static_cast<int>(f.ids.size());
  if (params_pending_ == 0) expected_uses_ = 0;
}

bool ParameterStore::grad_final(int id) const {
  return grad_step_active() && grads_seen_.at(id) == expected_uses_ * infos_.at(id).grad_uses;
}

void ParameterStore::note_grad(int id) {
  FORGE_CHECK(infos_.at(id).trainable, "a weight gradient of frozen parameter '{}'", infos_[id].name);
  if (!grad_step_active()) return;
  const int expected = expected_uses_ * infos_.at(id).grad_uses;
  FORGE_CHECK(grads_seen_[id] < expected,
              "parameter '{}' received more than its {} weight gradients of the step", infos_[id].name,
              expected);
  if (++grads_seen_[id] < expected) return;
  // A parameter with a finalizer is announced once the finalizer ran, with the finalizer's other parameters.
  const int f = finalizers_of_.empty() ? -1 : finalizers_of_[id];
  if (f < 0) return announce_final(id);
  if (--finalizers_[f].pending > 0) return;
  finalizers_[f].fn();
  for (int other : finalizers_[f].ids) announce_final(other);
}

void ParameterStore::announce_final(int id) {
  for (auto& [handle, fn] : listeners_) fn(id);
  if (--params_pending_ == 0) expected_uses_ = 0;  // every gradient is final: the step is over
}

void ParameterStore::add_grad_finalizer(std::vector<int> ids, std::function<void()> fn) {
  FORGE_CHECK(!ids.empty(), "a gradient finalizer without parameters");
  finalizers_of_.resize(infos_.size(), -1);
  const int index = static_cast<int>(finalizers_.size());
  for (int id : ids) {
    FORGE_CHECK(finalizers_of_.at(id) < 0, "parameter '{}' has two gradient finalizers", infos_[id].name);
    finalizers_of_[id] = index;
  }
  finalizers_.push_back({std::move(ids), std::move(fn), 0});
}

int ParameterStore::add_grad_listener(std::function<void(int)> fn) {
  listeners_.emplace_back(next_listener_, std::move(fn));
  return next_listener_++;
}

void ParameterStore::remove_grad_listener(int handle) {
  std::erase_if(listeners_, [handle](const auto& l) { return l.first == handle; });
}

void ParameterStore::allocate(bool with_bf16_shadow, bool with_grads, Device device) {
  // A group's parameters are adjacent: its buckets and its optimizer shard are one flat range. Groups are
  // laid out in the order they first appear, each in registration order (so that parameters registered one
  // after another in one group stay one matrix). Frozen parameters come last, in registration order.
  std::vector<std::string> order;
  for (const ParamInfo& p : infos_)
    if (p.trainable && std::find(order.begin(), order.end(), p.group) == order.end())
      order.push_back(p.group);
  int64_t offset = 0;
  by_offset_.clear();
  auto place = [&](ParamInfo& p, size_t id) {
    p.offset = offset, offset += shape_numel(p.shape);
    by_offset_.push_back(static_cast<int>(id));
  };
  for (const std::string& group : order)
    for (size_t id = 0; id < infos_.size(); ++id)
      if (ParamInfo& p = infos_[id]; p.trainable && p.group == group) place(p, id);
  trained_ = offset;
  for (size_t id = 0; id < infos_.size(); ++id)
    if (ParamInfo& p = infos_[id]; !p.trainable) place(p, id);
  FORGE_CHECK(offset == total_, "parameter layout: {} elements placed of {}", offset, total_);
  device_ = device;
  params_ = Tensor::zeros({total_}, DType::f32, device);
  if (with_grads) grads_ = Tensor::zeros({trained_}, DType::f32, device);
  if (with_bf16_shadow) params_bf16_ = Tensor::zeros({total_}, DType::bf16, device);
}

Tensor ParameterStore::grad(int id) const {
  FORGE_CHECK(has_grads(), "gradient of '{}' asked of a parameter store built without gradients (inference)",
              infos_.at(id).name);
  FORGE_CHECK(infos_[id].trainable, "gradient of frozen parameter '{}' asked for", infos_[id].name);
  return grads_.view(infos_[id].offset, infos_[id].shape);
}

std::vector<ShardRun> shard_runs(const Shape& local_shape, const Shape& global_shape, int dim, int64_t start,
                                 int64_t flat_begin, int64_t flat_end) {
  std::vector<ShardRun> runs;
  if (flat_end <= flat_begin) return runs;
  if (dim < 0) return {{flat_begin, flat_begin, flat_end - flat_begin}};
  // Row-major, the shard is `outer` blocks of [local extent along dim x inner]; the first `real` elements
  // of each block exist globally, contiguously from (o * extent + start) * inner.
  int64_t inner = 1;
  for (size_t d = dim + 1; d < local_shape.size(); ++d) inner *= local_shape[d];
  const int64_t local = local_shape[dim], extent = global_shape[dim];
  const int64_t block = local * inner;
  const int64_t real = std::clamp<int64_t>(extent - start, 0, local) * inner;
  if (real == 0) return runs;  // all padding
  for (int64_t o = flat_begin / block; o * block < flat_end; ++o) {
    const int64_t a = std::max(flat_begin, o * block), b = std::min(flat_end, o * block + real);
    if (a < b) runs.push_back({a, (o * extent + start) * inner + (a - o * block), b - a});
  }
  return runs;
}

void ParameterStore::initialize(uint64_t seed) {
  FORGE_CHECK(allocated(), "initialize before allocate");
  FORGE_CHECK(!released_, "initialize after the fp32 weights moved into the distributed optimizer");
  // Computed on the host (the values are a function of names and indices), then copied to the device.
  Tensor host = device_ == Device::cpu ? params_ : Tensor::empty({total_}, DType::f32);
  for (const auto& p : infos_) {
    float* out = host.f32() + p.offset;
    int64_t n = shape_numel(p.shape);
    switch (p.init) {
      case Init::normal:
        // Each element of a shard takes the value of the same global element of the unsplit tensor, so a
        // model split over any number of ranks is the same model. Padding is zero.
        init_constant(out, n, 0.0f);
        for (const ShardRun& r : shard_runs(p))
          init_normal(out + r.local, r.count, r.global, seed, p.name, 0.0f, p.init_std);
        break;
      case Init::ones:
        init_constant(out, n, 1.0f);
        break;
      case Init::zeros:
        init_constant(out, n, 0.0f);
        break;
    }
  }
  if (device_ != Device::cpu) params_.copy_from(host);
  refresh_bf16();
}

void ParameterStore::refresh_bf16() {
  mark_updated();
  if (!has_bf16()) return;
  if (released_) {
    // The optimizer writes the shadow of the weights it holds; the kept ones convert from here (on a
    // device through host copies, as below).
    const Tensor host = device_ == Device::cpu ? params_ : params_.to(Device::cpu);
    for (size_t id = 0; id < infos_.size(); ++id) {
      if (fp32_offsets_[id] < 0) continue;
      const int64_t n = shape_numel(infos_[id].shape);
      Tensor shadow = params_bf16_.view(infos_[id].offset, {n});
      Tensor out = device_ == Device::cpu ? shadow : Tensor::empty({n}, DType::bf16);
      convert_f32_to_bf16(host.f32() + fp32_offsets_[id], out.bf16(), static_cast<size_t>(n));
      if (device_ != Device::cpu) shadow.copy_from(out);
    }
    return;
  }
  // The core's exact conversion (round to nearest even, NaN kept), which both backends' kernels implement
  // bitwise; a device's store converts a host copy (this runs at initialisation and loads, not per step:
  // the optimizers write the shadow in their own pass).
  if (device_ == Device::cpu) {
    convert_f32_to_bf16(params_.f32(), params_bf16_.bf16(), static_cast<size_t>(total_));
    return;
  }
  const Tensor host = params_.to(Device::cpu);
  Tensor host_bf16 = Tensor::empty({total_}, DType::bf16);
  convert_f32_to_bf16(host.f32(), host_bf16.bf16(), static_cast<size_t>(total_));
  params_bf16_.copy_from(host_bf16);
}

int ParameterStore::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

Tensor ParameterStore::span(const Tensor& flat, int first, int count, int64_t cols) const {
  int64_t rows = 0;
  for (int i = first; i < first + count; ++i) {
    const auto& p = infos_.at(i);
    // A tensor of more dimensions is the matrix of its first against the rest (a convolution's weight
    // [out, channels, kh, kw] as the GEMM over flattened patches reads it).
    FORGE_CHECK(p.shape.size() >= 2 && shape_numel(p.shape) == p.shape[0] * cols,
                "'{}' is not a [*, {}] matrix", p.name, cols);
    FORGE_CHECK(p.offset == infos_[first].offset + rows * cols, "'{}' is not adjacent to '{}'", p.name,
                infos_[first].name);
    rows += p.shape[0];
  }
  return flat.view(infos_[first].offset, {rows, cols});
}

Tensor ParameterStore::fp32_span(int first, int count, int64_t cols) const {
  const Tensor whole = span(params_bf16_.defined() ? params_bf16_ : params_, first, count, cols);
  for (int i = first; i < first + count; ++i)
    FORGE_CHECK(fp32_offset(i) == fp32_offset(first) + (infos_[i].offset - infos_[first].offset),
                "'{}' is not adjacent to '{}' in the fp32 weights", infos_[i].name, infos_[first].name);
  return params_.view(fp32_offset(first), whole.shape());
}

int64_t ParameterStore::fp32_offset(int id) const {
  const ParamInfo& p = infos_.at(id);
  if (!released_) return p.offset;
  FORGE_CHECK(
      fp32_offsets_[id] >= 0,
      "the fp32 weights of '{}' are the distributed optimizer's (sharded over dp); the model reads its "
      "bf16 weights (a module that reads fp32 weights marks them with keep_fp32)",
      p.name);
  return fp32_offsets_[id];
}

void ParameterStore::release_fp32() {
  FORGE_CHECK(allocated() && has_bf16(), "release_fp32 needs an allocated store with its bf16 shadow");
  if (released_) return;
  // Kept and frozen parameters (no optimizer holds those) move to a compact buffer, in offset order:
  // parameters adjacent in the store stay adjacent there (one matrix for fused GEMMs).
  fp32_offsets_.assign(infos_.size(), -1);
  int64_t kept = 0;
  for (int id : by_offset_)
    if (infos_[id].keep_fp32 || !infos_[id].trainable)
      fp32_offsets_[id] = kept, kept += shape_numel(infos_[id].shape);
  Tensor compact = Tensor::empty({kept}, DType::f32, device_);
  for (int id : by_offset_)
    if (fp32_offsets_[id] >= 0)
      compact.view(fp32_offsets_[id], {shape_numel(infos_[id].shape)})
          .copy_from(params_.view(infos_[id].offset, {shape_numel(infos_[id].shape)}));
  params_ = compact;
  released_ = true;
}

}  // namespace forge
