// Learning-rate schedules: linear warmup, then cosine decay, warmup-stable-decay (WSD), or constant.
#pragma once

#include <cstdint>
#include <string_view>

namespace forge::optim {

struct LrSchedule {
  enum class Kind { constant, cosine, wsd };
  Kind kind = Kind::cosine;
  float peak_lr = 3e-3f;
  float min_lr = 3e-4f;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double decay_fraction = 0.2;  // wsd: the final fraction of total_steps that decays linearly to min_lr

  // step is 0-based. Warmup: peak * (step + 1) / warmup_steps, so step warmup_steps - 1 trains at peak.
  // After warmup, decay progress p = (step - start) / (total_steps - start) (Megatron's convention: the
  // last step is one step short of min_lr; steps at or past total_steps return min_lr).
  //   cosine:   min + 0.5 * (peak - min) * (1 + cos(pi * p)), start = warmup_steps
  //   wsd:      peak until start = max(warmup, total - round(decay_fraction * total)), then linear to min
  //   constant: peak
  float lr_at(int64_t step) const;
  // The first step whose LR depends on total_steps (cosine: the end of warmup; wsd: the start of the
  // decay; constant: never).
  int64_t decay_begins() const;
};

// "constant" | "cosine" | "wsd"; throws forge::Error naming the value otherwise.
LrSchedule::Kind parse_lr_schedule_kind(std::string_view name);
std::string_view lr_schedule_kind_name(LrSchedule::Kind kind);

}  // namespace forge::optim
