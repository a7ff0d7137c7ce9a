// The loss head's top-1 problem, shared by its one-process tests (nn/loss_head_test.cpp) and the MPI ones
// (parallel/loss_head_tp_mpi_test.cpp). Small integer operands make every logit an exact integer in any
// summation order, so the count is exact on every path and ties are common: a tie with another column counts
// as a hit. Padding columns get logits above every real one, so a max that let them in would find no hit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "forge/core/parameters.h"
#include "forge/core/tensor.h"
#include "forge/nn/compute.h"
#include "forge/nn/loss_head.h"

namespace forge::nn::loss_head_testing {

constexpr int64_t kRows = 40, kDim = 8, kVocab = 50;
constexpr float kPaddingWeight = 40.0f;  // padding logits 80 (hidden column 0 is 2), real ones at most 69

// An integer in [-3, 3] that depends on (i, j) without a visible pattern.
inline float small_integer(uint32_t i, uint32_t j) {
  uint32_t x = i * 0x9e3779b9u ^ (j + 0x7f4a7c15u) * 0x85ebca6bu;
  x ^= x >> 15, x *= 0x2c1b3c6du, x ^= x >> 12;
  return static_cast<float>(static_cast<int>(x % 7) - 3);
}

// hidden [rows, dim]: column 0 fixed at 2, the rest small integers.
inline std::vector<float> make_hidden() {
  std::vector<float> h(kRows * kDim);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t k = 0; k < kDim; ++k) h[r * kDim + k] = k == 0 ? 2.0f : small_integer(r, k);
  return h;
}

// The [padded, dim] weight of the whole vocabulary: small integers, padding rows (kPaddingWeight, 0, ...).
inline std::vector<float> make_weight(int64_t padded) {
  std::vector<float> w(padded * kDim, 0.0f);
  for (int64_t v = 0; v < padded; ++v)
    for (int64_t k = 0; k < kDim; ++k)
      w[v * kDim + k] = v >= kVocab ? (k == 0 ? kPaddingWeight : 0.0f) : small_integer(1000 + v, k);
  return w;
}

// The exact logits of the real columns [rows, vocab].
inline std::vector<double> exact_logits(const std::vector<float>& h, const std::vector<float>& w) {
  std::vector<double> logits(kRows * kVocab);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < kVocab; ++v) {
      double sum = 0;
      for (int64_t k = 0; k < kDim; ++k) sum += double{h[r * kDim + k]} * w[v * kDim + k];
      logits[r * kVocab + v] = sum;
    }
  return logits;
}

// Targets that hit (the last of the row's maxima: with a tie, not the first argmax; or the first), miss (a
// column below the max), are ignored, or fall where they may.
inline std::vector<int32_t> make_targets(const std::vector<double>& logits) {
  std::vector<int32_t> targets(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    const double* row = logits.data() + r * kVocab;
    const double max = *std::max_element(row, row + kVocab);
    int32_t first_max = -1, last_max = -1, below = 0;
    for (int32_t v = 0; v < kVocab; ++v) {
      if (row[v] == max) last_max = v, first_max = first_max < 0 ? v : first_max;
      if (row[v] < max) below = v;
    }
    const int kind = static_cast<int>(r % 5);
    targets[r] = kind == 0   ? last_max
                 : kind == 1 ? below
                 : kind == 2 ? -100
                 : kind == 3 ? first_max
                             : static_cast<int32_t>((r * 7) % kVocab);
  }
  return targets;
}

// Tokens with a target whose logit is >= every logit of the row (the full logits [rows, vocab]).
template <typename T>
int64_t brute_force_top1(const std::vector<T>& logits, const std::vector<int32_t>& targets) {
  int64_t hits = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    if (targets[r] < 0) continue;
    const T* row = logits.data() + r * kVocab;
    hits += row[targets[r]] >= *std::max_element(row, row + kVocab);
  }
  return hits;
}

inline Tensor host_tensor(const std::vector<float>& values, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::copy(values.begin(), values.end(), t.f32());
  return t;
}

// One rank's head over global rows [vocab_start, vocab_start + local) of `weight`, on `device`.
struct Head {
  ParameterStore store;
  LossHead head;
  Head(const std::vector<float>& weight, int64_t vocab_start, int64_t local, ComputeOptions options) {
    const int id = store.add("lm_head.weight", {local, kDim}, false, Init::zeros);
    store.allocate(options.gemm_dtype == DType::bf16, true, options.device);
    const std::vector<float> part(weight.begin() + vocab_start * kDim,
                                  weight.begin() + (vocab_start + local) * kDim);
    store.param(id).copy_from(host_tensor(part, {local, kDim}));
    store.refresh_bf16();
    store.zero_grads();
    head = LossHead(&store, id, kVocab, vocab_start, options);
  }
};

// What one forward gives, for the comparisons.
struct HeadRun {
  LossTotals totals;
  std::vector<float> dhidden;
};

inline HeadRun run_head(const Head& h, const std::vector<float>& hidden, const std::vector<int32_t>& targets,
                        Device device, bool gradients, bool count_top1) {
  const auto rows =
      static_cast<int64_t>(hidden.size()) / kDim;  // this rank's rows under sequence parallelism
  Tensor x = Tensor::empty({rows, kDim}, DType::f32, device);
  x.copy_from(host_tensor(hidden, {rows, kDim}));
  Tensor host_targets = Tensor::empty({kRows}, DType::i32);
  std::copy(targets.begin(), targets.end(), host_targets.i32());
  Tensor device_targets = host_targets.to(device);
  Tensor dhidden;
  HeadRun out;
  out.totals = h.head.forward(x, targets.data(), device_targets.i32(), 0.5f, gradients ? &dhidden : nullptr,
                              count_top1);
  if (gradients) {
    const Tensor host = dhidden.to(Device::cpu);
    out.dhidden.assign(host.f32(), host.f32() + host.numel());
  }
  return out;
}

struct Problem {
  std::vector<float> hidden = make_hidden(), weight = make_weight(kVocab);
  std::vector<double> logits = exact_logits(hidden, weight);
  std::vector<int32_t> targets = make_targets(logits);
  int64_t tokens = std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; });
  int64_t top1 = brute_force_top1(logits, targets);
};

}  // namespace forge::nn::loss_head_testing
