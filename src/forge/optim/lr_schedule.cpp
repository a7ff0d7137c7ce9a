#include "forge/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "forge/core/error.h"

namespace forge::optim {

float LrSchedule::lr_at(int64_t step) const {
  const double peak = peak_lr, floor = min_lr;
  if (step < warmup_steps) return static_cast<float>(peak * static_cast<double>(step + 1) / warmup_steps);
  if (kind == Kind::constant) return peak_lr;

  const int64_t decay_start = decay_begins();
  if (kind == Kind::wsd && step < decay_start) return peak_lr;
  if (step >= total_steps) return min_lr;
  const double progress =
      static_cast<double>(step - decay_start) / static_cast<double>(total_steps - decay_start);
  if (kind == Kind::cosine)
    return static_cast<float>(floor + 0.5 * (peak - floor) * (1.0 + std::cos(std::numbers::pi * progress)));
  return static_cast<float>(peak + (floor - peak) * progress);
}

int64_t LrSchedule::decay_begins() const {
  if (kind == Kind::constant) return std::numeric_limits<int64_t>::max();
  if (kind == Kind::cosine) return warmup_steps;
  const auto decay_steps = static_cast<int64_t>(std::llround(decay_fraction * static_cast<double>(total_steps)));
  return std::max(warmup_steps, total_steps - decay_steps);
}

LrSchedule::Kind parse_lr_schedule_kind(std::string_view name) {
  if (name == "constant") return LrSchedule::Kind::constant;
  if (name == "cosine") return LrSchedule::Kind::cosine;
  if (name == "wsd") return LrSchedule::Kind::wsd;
  fail("unknown learning-rate schedule '{}' (expected 'cosine', 'wsd' or 'constant')", name);
}

std::string_view lr_schedule_kind_name(LrSchedule::Kind kind) {
  switch (kind) {
    case LrSchedule::Kind::constant:
      return "constant";
    case LrSchedule::Kind::cosine:
      return "cosine";
    case LrSchedule::Kind::wsd:
      return "wsd";
  }
  return "?";
}

}  // namespace forge::optim
