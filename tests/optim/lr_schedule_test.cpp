#include "forge/optim/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "forge/core/error.h"

namespace forge::lr_schedule_test {
using namespace forge::optim;
namespace {

LrSchedule make(LrSchedule::Kind kind, int64_t warmup, int64_t total, double decay_fraction = 0.2) {
  LrSchedule s;
  s.kind = kind;
  s.peak_lr = 1.0f;
  s.min_lr = 0.1f;
  s.warmup_steps = warmup;
  s.total_steps = total;
  s.decay_fraction = decay_fraction;
  return s;
}

// float results against double hand values: one float rounding apart.
void expect_lr(const LrSchedule& s, int64_t step, double expected) {
  EXPECT_NEAR(s.lr_at(step), expected, 1e-6 * std::max(1.0, std::fabs(expected))) << "step " << step;
}

TEST(LrSchedule, LinearWarmupReachesPeakOnLastWarmupStep) {
  for (auto kind : {LrSchedule::Kind::constant, LrSchedule::Kind::cosine, LrSchedule::Kind::wsd}) {
    const LrSchedule s = make(kind, 4, 100);
    expect_lr(s, 0, 0.25);
    expect_lr(s, 1, 0.5);
    expect_lr(s, 2, 0.75);
    expect_lr(s, 3, 1.0);
  }
}

TEST(LrSchedule, CosineHandValues) {
  // warmup 10, total 110: decay over steps 10..109 with progress (step - 10) / 100.
  const LrSchedule s = make(LrSchedule::Kind::cosine, 10, 110);
  expect_lr(s, 10, 1.0);
  expect_lr(s, 35, 0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.25)));  // 0.868198...
  expect_lr(s, 60, 0.55);                                                  // half way
  expect_lr(s, 85, 0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.75)));  // 0.231802...
  expect_lr(s, 109, 0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.99)));
  expect_lr(s, 110, 0.1);
  expect_lr(s, 1000, 0.1);
  // Monotonically non-increasing after warmup.
  for (int64_t step = 10; step < 120; ++step) EXPECT_LE(s.lr_at(step + 1), s.lr_at(step));
}

TEST(LrSchedule, CosineWithoutWarmup) {
  const LrSchedule s = make(LrSchedule::Kind::cosine, 0, 4);
  expect_lr(s, 0, 1.0);
  expect_lr(s, 1, 0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.25)));
  expect_lr(s, 2, 0.55);
}

TEST(LrSchedule, WsdHandValues) {
  // total 100, decay_fraction 0.2: warmup 0..9, stable until step 79, linear decay over steps 80..99.
  const LrSchedule s = make(LrSchedule::Kind::wsd, 10, 100, 0.2);
  expect_lr(s, 9, 1.0);
  expect_lr(s, 10, 1.0);
  expect_lr(s, 79, 1.0);
  expect_lr(s, 80, 1.0);
  expect_lr(s, 85, 1.0 - 0.9 * 5.0 / 20.0);  // 0.775
  expect_lr(s, 90, 0.55);
  expect_lr(s, 99, 1.0 - 0.9 * 19.0 / 20.0);  // 0.145
  expect_lr(s, 100, 0.1);
}

TEST(LrSchedule, WsdDecayNeverStartsInsideWarmup) {
  // decay_fraction 1 would start decay at step 0; it starts after warmup instead.
  const LrSchedule s = make(LrSchedule::Kind::wsd, 10, 20, 1.0);
  expect_lr(s, 9, 1.0);
  expect_lr(s, 10, 1.0);
  expect_lr(s, 15, 0.55);
}

TEST(LrSchedule, ConstantAfterWarmup) {
  const LrSchedule s = make(LrSchedule::Kind::constant, 2, 10);
  expect_lr(s, 0, 0.5);
  for (int64_t step = 2; step < 30; ++step) expect_lr(s, step, 1.0);
}

TEST(LrSchedule, WarmupLongerThanRun) {
  const LrSchedule s = make(LrSchedule::Kind::cosine, 100, 10);
  expect_lr(s, 9, 0.1);  // still warming up: peak * 10 / 100
}

TEST(LrSchedule, KindNames) {
  EXPECT_EQ(parse_lr_schedule_kind("cosine"), LrSchedule::Kind::cosine);
  EXPECT_EQ(parse_lr_schedule_kind("wsd"), LrSchedule::Kind::wsd);
  EXPECT_EQ(parse_lr_schedule_kind("constant"), LrSchedule::Kind::constant);
  EXPECT_EQ(lr_schedule_kind_name(LrSchedule::Kind::wsd), "wsd");
  try {
    parse_lr_schedule_kind("linear");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'linear'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge::lr_schedule_test
