#include "forge/fp8/scaling.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include "forge/core/error.h"

namespace forge::fp8 {
namespace {

// max that returns NaN when either side is NaN (std::max would depend on the argument order).
inline float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

}  // namespace

float round_down_to_power_of_two(float x) {
  if (!(x > 0) || !std::isfinite(x)) return x;
  int exponent;
  std::frexp(x, &exponent);  // x = m * 2^exponent, m in [0.5, 1)
  return std::ldexp(1.0f, exponent - 1);
}

float compute_scale(float amax, float fp8_max, int margin, float previous_scale, bool power_of_two) {
  if (!(amax > 0) || !std::isfinite(amax)) return previous_scale;
  const float scaled_max = std::ldexp(fp8_max, -margin);
  float scale = scaled_max / amax;
  if (std::isinf(scale)) scale = FLT_MAX;
  return power_of_two ? round_down_to_power_of_two(scale) : scale;
}

DelayedScalingGroup::DelayedScalingGroup(std::vector<DType> fp8_dtypes, const RecipeConfig& config)
    : dtypes_(std::move(fp8_dtypes)),
      history_len_(config.amax_history_len),
      amax_compute_(config.amax_compute),
      margin_(config.margin) {
  validate(config);
  for (DType d : dtypes_) fp8_max(d);  // throws for a non-FP8 dtype
  history_.assign(static_cast<size_t>(history_len_) * dtypes_.size(), 0.0f);
  scales_.assign(dtypes_.size(), 1.0f);
  scale_invs_.assign(dtypes_.size(), 1.0f);
}

size_t DelayedScalingGroup::checked(int64_t tensor) const {
  if (tensor < 0 || tensor >= size())
    fail("DelayedScalingGroup: tensor index {} out of range [0, {})", tensor, size());
  return static_cast<size_t>(tensor);
}

void DelayedScalingGroup::record(int64_t tensor, float amax) {
  if (amax < 0) fail("DelayedScalingGroup::record: amax of tensor {} is negative ({})", tensor, amax);
  float& slot = current_amaxes()[checked(tensor)];
  slot = nan_max(slot, amax);
}

std::span<float> DelayedScalingGroup::current_amaxes() {
  return std::span<float>(history_).subspan(static_cast<size_t>(head_) * dtypes_.size(), dtypes_.size());
}

std::span<const float> DelayedScalingGroup::current_amaxes() const {
  return std::span<const float>(history_).subspan(static_cast<size_t>(head_) * dtypes_.size(),
                                                  dtypes_.size());
}

float DelayedScalingGroup::amax_history(int64_t tensor, int64_t age) const {
  if (age < 0 || age >= history_len_)
    fail("DelayedScalingGroup::amax_history: age {} out of range [0, {})", age, history_len_);
  const int64_t row = ((head_ - age) % history_len_ + history_len_) % history_len_;
  return history_[static_cast<size_t>(row) * dtypes_.size() + checked(tensor)];
}

void DelayedScalingGroup::update() {
  const size_t n = dtypes_.size();
  std::vector<float> amax(current_amaxes().begin(), current_amaxes().end());
  if (amax_compute_ == AmaxCompute::max) {
    // Row by row: the history is [L][N], so this walks it contiguously.
    for (int64_t row = 0; row < history_len_; ++row) {
      const float* h = history_.data() + static_cast<size_t>(row) * n;
      for (size_t i = 0; i < n; ++i) amax[i] = nan_max(amax[i], h[i]);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    scales_[i] = compute_scale(amax[i], fp8_max(dtypes_[i]), margin_, scales_[i]);
    scale_invs_[i] = 1.0f / scales_[i];
  }
  head_ = (head_ + 1) % history_len_;
  std::fill(current_amaxes().begin(), current_amaxes().end(), 0.0f);
}

void DelayedScalingGroup::export_state(std::span<float> history_by_age, std::span<float> scales) const {
  const size_t n = dtypes_.size();
  if (history_by_age.size() != history_.size() || scales.size() != n)
    fail("DelayedScalingGroup::export_state: buffers of {} and {} floats for a state of {} x {} and {}",
         history_by_age.size(), scales.size(), history_len_, n, n);
  for (int64_t age = 0; age < history_len_; ++age) {
    const int64_t row = ((head_ - age) % history_len_ + history_len_) % history_len_;
    std::copy_n(history_.data() + static_cast<size_t>(row) * n, n, history_by_age.data() + static_cast<size_t>(age) * n);
  }
  std::copy(scales_.begin(), scales_.end(), scales.begin());
}

void DelayedScalingGroup::import_state(std::span<const float> history_by_age, std::span<const float> scales) {
  const size_t n = dtypes_.size();
  if (history_by_age.size() != history_.size() || scales.size() != n)
    fail("FP8 scaling state of {} history values and {} scales does not fit {} tensors with a history of {} steps",
         history_by_age.size(), scales.size(), n, history_len_);
  head_ = 0;  // age a goes to row (-a) mod L
  for (int64_t age = 0; age < history_len_; ++age) {
    const int64_t row = (history_len_ - age) % history_len_;
    std::copy_n(history_by_age.data() + static_cast<size_t>(age) * n, n, history_.data() + static_cast<size_t>(row) * n);
  }
  for (size_t i = 0; i < n; ++i) {
    scales_[i] = scales[i];
    scale_invs_[i] = 1.0f / scales[i];
  }
}

}  // namespace forge::fp8
