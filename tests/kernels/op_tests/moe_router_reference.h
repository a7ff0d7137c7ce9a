// The MoE router's double-precision reference (ops::moe_router_forward's math, selection included), shared by
// the op tests (op_tests/moe_router.h) and the tests of the modules built on the router
// (tests/nn/moe_test.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"

namespace forge::op_tests::moe_router {

struct Case {
  int64_t tokens, experts, top_k, groups, topk_groups;
  ops::MoeScore score;
  bool normalize;
  float scaling;
  bool bias;
  int64_t seq_len;
  float balance_scale;
  bool aux;  // the micro-batch balance loss (aux_loss), with aux_scale in backward
  float aux_scale;
  std::string name() const {
    // fmt, not "t" + std::to_string(...): GCC 12 warns falsely (-Wrestrict) on literal + temporary string.
    return fmt::format("t{}_e{}_k{}_g{}of{}{}{}{}{}{}", tokens, experts, top_k, groups, topk_groups,
                       score == ops::MoeScore::sigmoid ? "_sigmoid" : "_softmax", normalize ? "_norm" : "",
                       bias ? "_bias" : "", seq_len > 0 ? fmt::format("_seq{}", seq_len) : "",
                       aux ? "_aux" : "");
  }
  bool finite_differences() const { return tokens * experts <= 200; }
};

struct Reference {
  std::vector<int32_t> ids;
  std::vector<double> weights, scores, sums, fractions, losses;
  std::vector<double> aux_fractions;  // [experts] (aux)
  double aux_loss = 0;
};

inline double score_of(ops::MoeScore score, const double* z, int64_t e, int64_t experts) {
  if (score == ops::MoeScore::sigmoid) return 1.0 / (1.0 + std::exp(-z[e]));
  double max = z[0], sum = 0;
  for (int64_t i = 1; i < experts; ++i) max = std::max(max, z[i]);
  for (int64_t i = 0; i < experts; ++i) sum += std::exp(z[i] - max);
  return std::exp(z[e] - max) / sum;
}

// The router in double. fixed_ids (not null): use these experts instead of selecting (for finite differences,
// which differentiate the piecewise-smooth function on one piece).
inline Reference reference(const Case& c, const std::vector<double>& z, const std::vector<double>& bias,
                           const std::vector<int32_t>* fixed_ids = nullptr) {
  const int64_t E = c.experts, K = c.top_k;
  Reference r;
  r.ids.resize(c.tokens * K), r.weights.resize(c.tokens * K), r.scores.resize(c.tokens * E);
  for (int64_t t = 0; t < c.tokens; ++t) {
    double* s = &r.scores[t * E];
    for (int64_t e = 0; e < E; ++e) s[e] = score_of(c.score, &z[t * E], e, E);
    std::vector<double> choice(E);
    for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + (c.bias ? bias[e] : 0.0);
    std::vector<bool> usable(E, true);
    if (c.groups > 1) {
      const int64_t size = E / c.groups;
      std::vector<double> group_score(c.groups);
      for (int64_t g = 0; g < c.groups; ++g) {
        std::vector<double> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
        std::sort(members.rbegin(), members.rend());
        group_score[g] = members[0] + members[1];
      }
      std::vector<bool> kept(c.groups, false);
      for (int64_t pick = 0; pick < c.topk_groups; ++pick) {
        int64_t best = -1;
        for (int64_t g = 0; g < c.groups; ++g)
          if (!kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
        kept[best] = true;
      }
      for (int64_t e = 0; e < E; ++e) usable[e] = kept[e / size];
    }
    double sum = 0;
    for (int64_t j = 0; j < K; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (usable[e] && (best < 0 || choice[e] > choice[best])) best = e;
      if (fixed_ids) best = (*fixed_ids)[t * K + j];
      usable[best] = false;
      r.ids[t * K + j] = static_cast<int32_t>(best);
      sum += s[best];
    }
    for (int64_t j = 0; j < K; ++j)
      r.weights[t * K + j] =
          (c.normalize ? s[r.ids[t * K + j]] / (sum + 1e-20) : s[r.ids[t * K + j]]) * c.scaling;
  }
  if (c.seq_len == 0 && !c.aux) return r;
  r.sums.resize(c.tokens);
  for (int64_t t = 0; t < c.tokens; ++t)
    for (int64_t e = 0; e < E; ++e) r.sums[t] += r.scores[t * E + e];
  // sum_i f_i P_i of the T tokens from `first`, f into fractions [E].
  const auto balance = [&](int64_t first, int64_t T, double* fractions) {
    std::vector<double> mean_score(E, 0.0);
    for (int64_t t = first; t < first + T; ++t) {
      for (int64_t e = 0; e < E; ++e)
        mean_score[e] += r.scores[t * E + e] / r.sums[t] / static_cast<double>(T);
      for (int64_t j = 0; j < K; ++j) fractions[r.ids[t * K + j]] += double(E) / double(K * T);
    }
    double loss = 0;
    for (int64_t e = 0; e < E; ++e) loss += fractions[e] * mean_score[e];
    return loss;
  };
  if (c.seq_len > 0) {
    const int64_t T = c.seq_len, sequences = c.tokens / T;
    r.fractions.assign(sequences * E, 0.0), r.losses.assign(sequences, 0.0);
    for (int64_t q = 0; q < sequences; ++q) r.losses[q] = balance(q * T, T, &r.fractions[q * E]);
  }
  if (c.aux && c.tokens > 0) {
    r.aux_fractions.assign(E, 0.0);
    r.aux_loss = balance(0, c.tokens, r.aux_fractions.data());
  }
  return r;
}

}  // namespace forge::op_tests::moe_router
