#include "forge/nn/parameters.h"

#include "forge/core/init.h"

namespace forge::nn {

int ParameterStore::add(std::string name, Shape shape, bool weight_decay, Init init, float init_std) {
  FORGE_CHECK(!allocated(), "parameter '{}' registered after allocation", name);
  FORGE_CHECK(!by_name_.count(name), "parameter '{}' registered twice", name);
  for (int64_t d : shape)
    if (d <= 0) fail("parameter '{}' has a non-positive dimension in {}", name, shape_string(shape));
  ParamInfo info{std::move(name), std::move(shape), total_, weight_decay, init, init_std};
  // No padding: parameters registered in a row form one contiguous matrix (fused q|k|v, gate|up).
  total_ += shape_numel(info.shape);
  by_name_[info.name] = static_cast<int>(infos_.size());
  infos_.push_back(std::move(info));
  return static_cast<int>(infos_.size()) - 1;
}

void ParameterStore::allocate(bool with_bf16_shadow, bool with_grads) {
  params_ = Tensor::zeros({total_}, DType::f32);
  if (with_grads) grads_ = Tensor::zeros({total_}, DType::f32);
  if (with_bf16_shadow) params_bf16_ = Tensor::zeros({total_}, DType::bf16);
}

Tensor ParameterStore::grad(int id) const {
  FORGE_CHECK(has_grads(), "gradient of '{}' asked of a parameter store built without gradients (inference)",
              infos_.at(id).name);
  return grads_.view(infos_[id].offset, infos_[id].shape);
}

void ParameterStore::initialize(uint64_t seed) {
  FORGE_CHECK(allocated(), "initialize before allocate");
  for (const auto& p : infos_) {
    float* out = params_.f32() + p.offset;
    int64_t n = shape_numel(p.shape);
    switch (p.init) {
      case Init::normal: init_normal(out, n, 0, seed, p.name, 0.0f, p.init_std); break;
      case Init::ones: init_constant(out, n, 1.0f); break;
      case Init::zeros: init_constant(out, n, 0.0f); break;
    }
  }
  refresh_bf16();
}

void ParameterStore::refresh_bf16() {
  if (has_bf16()) convert_f32_to_bf16(params_.f32(), params_bf16_.bf16(), static_cast<size_t>(total_));
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
