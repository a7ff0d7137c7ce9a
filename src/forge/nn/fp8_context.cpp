#include "forge/nn/fp8_context.h"

#include "forge/core/error.h"

namespace forge::nn {

void validate(const Fp8Options& options) {
  // The one statement of these rules (with fp8::validate): TrainConfig::validate checks its fp8.* keys here,
  // and the messages name those keys.
  fp8::validate(options.recipe);
  if (options.accumulator_bits < 0 || options.accumulator_bits > 23)
    fail("fp8.accumulator_bits must be in [0, 23] (0 = exact fp32 accumulation), got {}",
         options.accumulator_bits);
  if (options.accumulator_bits > 0) {
    const int64_t p = options.promote_every;
    if (options.recipe.recipe == fp8::Recipe::block) {
      if (p <= 0 || p % 32 != 0 || 128 % p != 0)
        fail(
            "fp8.promote_every must be 32, 64 or 128 under the block recipe (a divisor of its tiles), got {}",
            p);
    } else if (p < 0 || p % 32 != 0) {
      fail("fp8.promote_every must be a multiple of 32 (0 = never promote), got {}", p);
    }
  }
  if (options.bf16_first_layers < 0)
    fail("fp8.bf16_first_layers must be >= 0, got {}", options.bf16_first_layers);
  if (options.bf16_last_layers < 0)
    fail("fp8.bf16_last_layers must be >= 0, got {}", options.bf16_last_layers);
}

Fp8Context::Fp8Context(Fp8Options options) : options_(std::move(options)) { validate(options_); }

int Fp8Context::add_linear(std::string name, Device device, bool expert) {
  if (sealed_) fail("FP8 Linear '{}' registered after the model's FP8 state was sealed", name);
  if (!names_.empty() && device != device_)
    fail("FP8 Linear '{}' runs on another device than the context's other Linears", name);
  device_ = device;
  names_.push_back(std::move(name));
  experts_.push_back(expert ? 1 : 0);
  weights_.emplace_back();
  return static_cast<int>(names_.size() - 1);
}

void Fp8Context::seal() {
  if (sealed_) return;
  sealed_ = true;
  if (recipe() != fp8::Recipe::delayed) return;
  std::vector<DType> dtypes;
  for (size_t i = 0; i < names_.size(); ++i)
    for (auto role : {fp8::TensorRole::input, fp8::TensorRole::weight, fp8::TensorRole::grad_output})
      dtypes.push_back(dtype(role));
  delayed_.emplace(std::move(dtypes), options_.recipe);
}

int64_t Fp8Context::slot(int linear, fp8::TensorRole role) const {
  FORGE_CHECK(linear >= 0 && linear < linears(), "FP8 Linear {} out of range [0, {})", linear, linears());
  return 3 * static_cast<int64_t>(linear) + static_cast<int64_t>(role);
}

fp8::DelayedScalingGroup* Fp8Context::delayed_group() {
  seal();
  return delayed_ ? &*delayed_ : nullptr;
}

float Fp8Context::delayed_scale(int linear, fp8::TensorRole role) {
  fp8::DelayedScalingGroup* group = delayed_group();
  FORGE_CHECK(group, "delayed_scale under the {} recipe", fp8::recipe_name(recipe()));
  return group->scale(slot(linear, role));
}

void Fp8Context::record_amax(int linear, fp8::TensorRole role, float amax) {
  if (fp8::DelayedScalingGroup* group = delayed_group()) group->record(slot(linear, role), amax);
}

float* Fp8Context::amax_accumulator(int linear, fp8::TensorRole role) {
  FORGE_CHECK(delayed_group(), "amax_accumulator under the {} recipe", fp8::recipe_name(recipe()));
  if (!accumulators_.defined()) accumulators_ = Tensor::zeros({3 * linears()}, DType::f32, device_);
  return accumulators_.f32() + slot(linear, role);
}

void Fp8Context::fold_accumulators() {
  fp8::DelayedScalingGroup* group = delayed_group();
  if (!group || !accumulators_.defined()) return;
  const Tensor host = accumulators_.to(Device::cpu);  // the step's one synchronisation on a device
  for (int64_t i = 0; i < host.numel(); ++i) group->record(i, host.f32()[i]);
  accumulators_.fill_zero();
}

std::span<float> Fp8Context::step_amaxes() {
  fold_accumulators();
  fp8::DelayedScalingGroup* group = delayed_group();
  return group ? group->current_amaxes() : std::span<float>();
}

void Fp8Context::discard_step() {
  if (accumulators_.defined()) accumulators_.fill_zero();
  if (fp8::DelayedScalingGroup* group = delayed_group()) {
    const std::span<float> current = group->current_amaxes();
    std::fill(current.begin(), current.end(), 0.0f);
  }
}

void Fp8Context::end_step() {
  fold_accumulators();
  if (fp8::DelayedScalingGroup* group = delayed_group()) group->update();
}

}  // namespace forge::nn
