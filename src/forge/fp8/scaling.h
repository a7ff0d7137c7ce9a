// FP8 scale computation and the delayed-scaling state (TransformerEngine semantics).
//
// A tensor x is stored as q = fp8(x * scale) and read back as q * scale_inv, scale_inv = 1 / scale.
// The scale maps the tensor's amax (max |x|) onto the format's largest finite value, less a margin.
//
// Delayed scaling keeps, per tensor, a history of the amaxes of the last L steps. The scale a step uses was
// computed at the end of the previous step from the amaxes recorded up to and including that step, so the
// cast itself never waits for a reduction over the tensor it casts.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/fp8/recipe.h"

namespace forge::fp8 {

// scale = (fp8_max / 2^margin) / amax, as TransformerEngine computes it, with its special cases:
//   - amax == 0, inf or NaN: the tensor says nothing usable about its range; previous_scale is returned;
//   - the quotient overflows to inf (amax tiny): FLT_MAX, as TE does (not previous_scale, which would keep
//     a scale that is certainly too small; FLT_MAX maps amax as high as fp32 allows);
//   - power_of_two: the result is rounded down to a power of two (2^floor(log2 scale)), so that multiplying
//     by the scale and by its inverse is exact and amax * scale still fits under the (margined) max.
// previous_scale is returned as given (not rounded).
float compute_scale(float amax, float fp8_max, int margin, float previous_scale, bool power_of_two = false);

// 2^floor(log2(x)) for a finite positive x (subnormals included); x itself otherwise.
float round_down_to_power_of_two(float x);

// The delayed-scaling state of N tensors (e.g. every FP8 GEMM operand of a model) in one allocation, so
// that the amaxes of one step are contiguous and one all-reduce (max) over the data-, tensor- or
// pipeline-parallel group covers them all:
//
//   group.record(i, amax_i)                 // as each tensor is cast (quantize() returns its amax)
//   all_reduce_max(group.current_amaxes())  // caller's collective, once per step, optional
//   group.update()                          // end of step: new scales, history rolled
//
// The history is a ring buffer of L rows of N amaxes (row-major [L][N], zero-initialised). The current
// row receives this step's amaxes; update() reduces each tensor's column (max over all L rows, or the
// current row alone for most_recent), turns it into a scale with compute_scale(), then advances to the next
// row and zeroes it, dropping the oldest step. With L = 1024 and `max` the scale of step t comes from the
// amaxes of steps t-1024 .. t-1. Initial scales are 1, as in TE.
//
// NaN amaxes propagate (the max of a column holding a NaN is NaN) and compute_scale then keeps the previous
// scale, as TE's torch.max does; such a tensor's scale stays frozen until the NaN leaves the history.
// (MPI_MAX over NaN is implementation-defined: a caller that reduces across ranks should check for
// non-finite amaxes first if it needs the same behaviour everywhere.)
class DelayedScalingGroup {
 public:
  // One tensor per entry of fp8_dtypes (E4M3 or E5M2); history length, reduction and margin from config.
  DelayedScalingGroup(std::vector<DType> fp8_dtypes, const RecipeConfig& config);

  int64_t size() const { return static_cast<int64_t>(dtypes_.size()); }
  int64_t history_len() const { return history_len_; }

  // Folds amax into tensor's entry for this step (max with what is there, so a tensor cast in several
  // pieces or micro-batches within a step records the max over all of them). amax must be >= 0 or NaN.
  void record(int64_t tensor, float amax);
  // This step's amaxes, one per tensor, contiguous: the buffer to all-reduce (max) before update().
  std::span<float> current_amaxes();
  std::span<const float> current_amaxes() const;
  // End of step: compute every tensor's new scale from its history, then roll the history.
  void update();

  float scale(int64_t tensor) const { return scales_[checked(tensor)]; }
  float scale_inv(int64_t tensor) const { return scale_invs_[checked(tensor)]; }
  std::span<const float> scales() const { return scales_; }
  std::span<const float> scale_invs() const { return scale_invs_; }
  DType dtype(int64_t tensor) const { return dtypes_[checked(tensor)]; }
  // The amax recorded `age` steps ago (0 = the current, not yet updated, step), for age < history_len().
  float amax_history(int64_t tensor, int64_t age) const;

  // The whole state, for checkpoints, independent of where the ring buffer's head is: history_by_age is
  // [history_len][size] with row a holding the amaxes of `a` steps ago (row 0 = the current step), scales
  // [size]. import_state restores it exactly (scale_inv = 1 / scale); sizes must match (forge::Error).
  void export_state(std::span<float> history_by_age, std::span<float> scales) const;
  void import_state(std::span<const float> history_by_age, std::span<const float> scales);

 private:
  size_t checked(int64_t tensor) const;

  std::vector<DType> dtypes_;
  int64_t history_len_;
  AmaxCompute amax_compute_;
  int margin_;
  std::vector<float> history_;  // [history_len][size], row head_ is the current step
  int64_t head_ = 0;
  std::vector<float> scales_, scale_invs_;
};

// The delayed-scaling state of one tensor: a DelayedScalingGroup of size one.
class DelayedScaling {
 public:
  DelayedScaling(DType fp8, const RecipeConfig& config) : group_({fp8}, config) {}

  void record(float amax) { group_.record(0, amax); }
  void update() { group_.update(); }
  float scale() const { return group_.scale(0); }
  float scale_inv() const { return group_.scale_inv(0); }
  float amax_history(int64_t age) const { return group_.amax_history(0, age); }
  int64_t history_len() const { return group_.history_len(); }

 private:
  DelayedScalingGroup group_;
};

}  // namespace forge::fp8
