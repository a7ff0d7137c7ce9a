#include "forge/nn/parameters.h"

#include <algorithm>

#include "forge/core/init.h"
#include "forge/kernels/ops.h"

namespace forge::nn {

int ParameterStore::add(std::string name, Shape shape, bool weight_decay, Init init, float init_std,
                        ShardSpec shard) {
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
  // No padding: parameters registered in a row form one contiguous matrix (fused q|k|v, gate|up).
  total_ += shape_numel(info.shape);
  by_name_[info.name] = static_cast<int>(infos_.size());
  infos_.push_back(std::move(info));
  return static_cast<int>(infos_.size()) - 1;
}

void ParameterStore::allocate(bool with_bf16_shadow, bool with_grads, Device device) {
  device_ = device;
  params_ = Tensor::zeros({total_}, DType::f32, device);
  if (with_grads) grads_ = Tensor::zeros({total_}, DType::f32, device);
  if (with_bf16_shadow) params_bf16_ = Tensor::zeros({total_}, DType::bf16, device);
}

Tensor ParameterStore::grad(int id) const {
  FORGE_CHECK(has_grads(), "gradient of '{}' asked of a parameter store built without gradients (inference)",
              infos_.at(id).name);
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
      case Init::ones: init_constant(out, n, 1.0f); break;
      case Init::zeros: init_constant(out, n, 0.0f); break;
    }
  }
  if (device_ != Device::cpu) params_.copy_from(host);
  refresh_bf16();
}

void ParameterStore::refresh_bf16() {
  mark_updated();
  if (has_bf16()) ops::convert_to_bf16(params_.f32(), params_bf16_.bf16(), total_, device_);
}

int ParameterStore::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

Tensor ParameterStore::span(const Tensor& flat, int first, int count, int64_t cols) const {
  int64_t rows = 0;
  for (int i = first; i < first + count; ++i) {
    const auto& p = infos_.at(i);
    FORGE_CHECK(p.shape.size() == 2 && p.shape[1] == cols, "'{}' is not a [*, {}] matrix", p.name, cols);
    FORGE_CHECK(p.offset == infos_[first].offset + rows * cols, "'{}' is not adjacent to '{}'", p.name,
                infos_[first].name);
    rows += p.shape[0];
  }
  return flat.view(infos_[first].offset, {rows, cols});
}

}  // namespace forge::nn
