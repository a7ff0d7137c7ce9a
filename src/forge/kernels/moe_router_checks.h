// The parameter checks of the MoE router ops (ops::MoeRouterParams) that every backend shares, written
// without fmt so that CUDA translation units include them too. Each returns the one-line refusal, or "" when
// the parameters are fine.
#pragma once

#include <string>

#include "forge/kernels/ops.h"

namespace forge::ops {

inline std::string moe_router_problem(const MoeRouterParams& p, const char* op, bool backward) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  const std::string name = std::string(op) + ": ";
  if (!(p.tokens >= 0 && p.experts > 0 && p.top_k > 0 && p.top_k <= p.experts))
    return name + "bad shape tokens=" + str(p.tokens) + " experts=" + str(p.experts) +
           " top_k=" + str(p.top_k);
  if (!(p.groups > 0 && p.experts % p.groups == 0))
    return name + str(p.groups) + " groups do not divide " + str(p.experts) + " experts";
  if (p.groups > 1 && p.experts / p.groups < 2)
    return name + "groups of " + str(p.experts / p.groups) + " expert; a group's score needs two";
  if (!(p.topk_groups > 0 && p.topk_groups <= p.groups))
    return name + "topk_groups " + str(p.topk_groups) + " outside [1, groups = " + str(p.groups) + "]";
  if (p.top_k > p.topk_groups * (p.experts / p.groups))
    return name + "top_k " + str(p.top_k) + " > the " + str(p.topk_groups * (p.experts / p.groups)) +
           " experts of the " + str(p.topk_groups) + " kept groups";
  if (p.seq_len < 0 || (p.seq_len > 0 && p.tokens % p.seq_len != 0))
    return name + str(p.tokens) + " tokens are not whole sequences of seq_len " + str(p.seq_len);
  const bool balance = backward ? p.balance_scale != 0.0f : p.seq_len > 0;
  if (balance && p.seq_len == 0) return name + "balance_scale without seq_len (no sequences to balance over)";
  const bool aux = backward ? p.aux_scale != 0.0f : p.aux_loss != nullptr;
  if (p.tokens == 0) return {};
  if (!backward && !(p.logits && p.expert_ids && p.weights && p.scores))
    return name + "logits, expert_ids, weights and scores must be set";
  if (backward && !(p.scores && p.expert_ids && p.dweights && p.dlogits))
    return name + "scores, expert_ids, dweights and dlogits must be set";
  if (balance && !(p.score_sums && p.expert_fraction && (backward || p.balance_loss)))
    return name + "the balance loss needs score_sums, expert_fraction" +
           (backward ? "" : " and balance_loss");
  if (aux && !(p.score_sums && p.aux_fraction))
    return name + "the micro-batch balance loss (aux_loss) needs score_sums and aux_fraction";
  return {};
}

inline std::string moe_bias_update_problem(int64_t experts, float rate) {
  if (experts > 0 && rate >= 0 && rate < 1e30f) return {};
  return "moe_bias_update: bad experts=" + std::to_string(experts) + " or rate=" + std::to_string(rate);
}

}  // namespace forge::ops
