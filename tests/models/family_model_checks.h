// Checks every LLaMA-family model on the decoder stack must pass whatever its per-layer options (Qwen3's
// QK-norm, Mistral's sliding window): the option changes the logits (it is wired in), and the split backward
// (B then W) gives the fused order's gradients bit for bit under every recompute policy.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "forge/models/model.h"

namespace forge::testing {

// Logits of a batch of 2 x `seq` fixed tokens.
inline Tensor family_logits(models::Model& model, int64_t seq) {
  std::vector<int32_t> ids(2 * seq);
  for (int64_t i = 0; i < 2 * seq; ++i) ids[i] = static_cast<int32_t>((i * 7 + 3) % 64);
  return model.logits(ids.data(), 2, seq);
}

inline double max_difference(const Tensor& a, const Tensor& b) {
  double moved = 0;
  for (int64_t i = 0; i < a.numel(); ++i) moved = std::max<double>(moved, std::abs(a.f32()[i] - b.f32()[i]));
  return moved;
}

// B then W equals the fused backward bitwise; `check_grads` then looks at the fused gradients.
inline void expect_split_backward_bitwise(const models::ModelConfig& config, int64_t seq,
                                          const std::function<void(const ParameterStore&)>& check_grads) {
  std::vector<int32_t> ids(2 * seq), targets(2 * seq);
  for (int64_t i = 0; i < 2 * seq; ++i)
    ids[i] = static_cast<int32_t>((i * 7 + 3) % 64), targets[i] = static_cast<int32_t>((i * 5 + 1) % 64);
  for (nn::Recompute recompute : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
    auto fused = models::build_model(config, {DType::f32, recompute}),
         split = models::build_model(config, {DType::f32, recompute});
    fused->initialize(3), split->initialize(3);
    fused->params().zero_grads(), split->params().zero_grads();
    fused->forward_backward(ids.data(), targets.data(), 2, seq, 0.1f);
    split->params().begin_grad_step(1);
    std::unique_ptr<models::StageActivations> saved;
    split->forward({ids.data(), targets.data(), 2, seq, 0.1f}, Tensor(), &saved);
    split->backward_input(Tensor(), *saved);
    split->backward_weight(*saved);
    const Tensor a = fused->params().grads(), b = split->params().grads();
    EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), a.bytes())) << nn::recompute_name(recompute);
    check_grads(fused->params());
  }
}

}  // namespace forge::testing
