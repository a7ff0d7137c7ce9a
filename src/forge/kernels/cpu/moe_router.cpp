// Mixture-of-experts routing (ops::MoeRouterParams: DeepSeek-V3's sigmoid, group-limited top-k router, its
// sequence-wise balance loss and the classic micro-batch one) and the auxiliary-loss-free bias update.
//
// Backward, per token t with chosen experts e_j and upstream dw_j (c = scaling):
//   through the weights: w_j = c s_j / S with S = sum_j s_{e_j} + 1e-20 (normalize), so
//     dL/ds_{e_i} = c (dw_i / S - sum_j dw_j s_{e_j} / S^2);  without normalize dL/ds_{e_i} = c dw_i.
//   through the balance loss of t's group of T tokens (its sequence, T = seq_len; or the micro-batch,
//   T = tokens), with that group's f and n_t = sum_e s[t, e]:
//     d/ds[t, e] sum_i f_i P_i = (f_e / n_t - sum_i f_i s[t, i] / n_t^2) / T.
//   then through the score function: sigmoid ds/dz = s (1 - s); softmax dz_e = s_e (g_e - sum_i g_i s_i).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/moe_router_checks.h"

namespace forge::cpu {
namespace {

bool refuse_with(const std::string& problem, std::string* reason) {
  if (problem.empty()) return true;
  if (reason) *reason = problem;
  return false;
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// Scores, selection and weights of token t.
// One thread's scratch, allocated once per parallel region rather than per token.
struct RouteScratch {
  std::vector<float> choice, group_score;
  std::vector<char> usable, kept;
  explicit RouteScratch(const ops::MoeRouterParams& p)
      : choice(p.experts), group_score(p.groups), usable(p.experts), kept(p.groups) {}
};

void route_token(const ops::MoeRouterParams& p, int64_t t, RouteScratch& scratch) {
  std::vector<float>& choice = scratch.choice;
  std::vector<char>& usable = scratch.usable;
  const int64_t experts = p.experts, k = p.top_k;
  const float* z = p.logits + t * experts;
  float* s = p.scores + t * experts;
  if (p.score == ops::MoeScore::sigmoid) {
    for (int64_t e = 0; e < experts; ++e) s[e] = sigmoid(z[e]);
  } else {
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < experts; ++e) max = std::max(max, z[e]);
    float sum = 0;
    for (int64_t e = 0; e < experts; ++e) sum += (s[e] = std::exp(z[e] - max));
    for (int64_t e = 0; e < experts; ++e) s[e] /= sum;
  }
  for (int64_t e = 0; e < experts; ++e) choice[e] = s[e] + (p.bias ? p.bias[e] : 0.0f);

  std::fill(usable.begin(), usable.end(), 1);
  if (p.groups > 1) {
    const int64_t size = experts / p.groups;
    std::vector<float>& group_score = scratch.group_score;
    for (int64_t g = 0; g < p.groups; ++g) {
      float first = -std::numeric_limits<float>::infinity(), second = first;
      for (int64_t e = g * size; e < (g + 1) * size; ++e) {
        if (choice[e] > first)
          second = first, first = choice[e];
        else if (choice[e] > second)
          second = choice[e];
      }
      group_score[g] = first + second;
    }
    std::vector<char>& kept = scratch.kept;
    std::fill(kept.begin(), kept.end(), 0);
    for (int64_t pick = 0; pick < p.topk_groups; ++pick) {
      int64_t best = -1;
      for (int64_t g = 0; g < p.groups; ++g)
        if (!kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
      kept[best] = 1;
    }
    for (int64_t e = 0; e < experts; ++e) usable[e] = kept[e / size];
  }

  int32_t* ids = p.expert_ids + t * k;
  float* w = p.weights + t * k;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e)
      if (usable[e] && (best < 0 || choice[e] > choice[best])) best = e;
    usable[best] = 0;
    ids[j] = static_cast<int32_t>(best);
  }
  float sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += (w[j] = s[ids[j]]);
  for (int64_t j = 0; j < k; ++j) w[j] = (p.normalize ? w[j] / (sum + 1e-20f) : w[j]) * p.scaling;
  if (p.seq_len > 0 || p.aux_loss) {
    float n = 0;
    for (int64_t e = 0; e < experts; ++e) n += s[e];
    p.score_sums[t] = n;
  }
}

// sum_i f_i P_i of the group of T tokens from `first`, its f into fraction [experts] (reads score_sums).
float balance_of(const ops::MoeRouterParams& p, int64_t first, int64_t T, float* f) {
  const int64_t experts = p.experts, k = p.top_k;
  std::vector<double> counts(experts, 0.0), mean_score(experts, 0.0);
  for (int64_t t = first; t < first + T; ++t) {
    const float* s = p.scores + t * experts;
    const float n = p.score_sums[t];
    for (int64_t e = 0; e < experts; ++e) mean_score[e] += s[e] / n;
    for (int64_t j = 0; j < k; ++j) counts[p.expert_ids[t * k + j]] += 1;
  }
  double loss = 0;
  for (int64_t e = 0; e < experts; ++e) {
    f[e] = static_cast<float>(static_cast<double>(experts) / static_cast<double>(k * T) * counts[e]);
    loss += double{f[e]} * (mean_score[e] / static_cast<double>(T));
  }
  return static_cast<float>(loss);
}

// g[e] += scale / T * d/ds[t, e] sum_i f_i P_i of token t's group (f, T), s = its scores, n = their sum.
void add_balance_grad(float* g, const float* s, float n, const float* f, float scale, int64_t T,
                      int64_t experts) {
  const float c = scale / static_cast<float>(T);
  float fs = 0;
  for (int64_t e = 0; e < experts; ++e) fs += f[e] * s[e];
  for (int64_t e = 0; e < experts; ++e) g[e] += c * (f[e] / n - fs / (n * n));
}

}  // namespace

bool supports_moe_router_forward(const ops::MoeRouterParams& p, std::string* reason) {
  return refuse_with(ops::moe_router_problem(p, "moe_router_forward", false), reason);
}
bool supports_moe_router_backward(const ops::MoeRouterParams& p, std::string* reason) {
  return refuse_with(ops::moe_router_problem(p, "moe_router_backward", true), reason);
}

void moe_router_forward(const ops::MoeRouterParams& p) {
  if (std::string why; !supports_moe_router_forward(p, &why)) fail("{}", why);
#pragma omp parallel
  {
    RouteScratch scratch(p);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.tokens; ++t) route_token(p, t, scratch);
    if (p.seq_len > 0) {
#pragma omp for schedule(static)
      for (int64_t q = 0; q < p.tokens / p.seq_len; ++q)
        p.balance_loss[q] = balance_of(p, q * p.seq_len, p.seq_len, p.expert_fraction + q * p.experts);
    }
  }
  if (p.aux_loss && p.tokens > 0) p.aux_loss[0] = balance_of(p, 0, p.tokens, p.aux_fraction);
  if (p.aux_loss && p.tokens == 0) std::fill_n(p.aux_fraction, p.experts, 0.0f);
}

void moe_router_backward(const ops::MoeRouterParams& p) {
  if (std::string why; !supports_moe_router_backward(p, &why)) fail("{}", why);
  const int64_t experts = p.experts, k = p.top_k;
  const bool balance = p.balance_scale != 0.0f, aux = p.aux_scale != 0.0f;
#pragma omp parallel
  {
    std::vector<float> g(experts);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.tokens; ++t) {
      const float* s = p.scores + t * experts;
      const int32_t* ids = p.expert_ids + t * k;
      const float* dw = p.dweights + t * k;
      std::fill(g.begin(), g.end(), 0.0f);
      if (p.normalize) {
        float sum = 0, weighted = 0;
        for (int64_t j = 0; j < k; ++j) sum += s[ids[j]];
        sum += 1e-20f;
        for (int64_t j = 0; j < k; ++j) weighted += dw[j] * s[ids[j]];
        for (int64_t j = 0; j < k; ++j) g[ids[j]] += p.scaling * (dw[j] / sum - weighted / (sum * sum));
      } else {
        for (int64_t j = 0; j < k; ++j) g[ids[j]] += p.scaling * dw[j];
      }
      if (balance)
        add_balance_grad(g.data(), s, p.score_sums[t], p.expert_fraction + (t / p.seq_len) * experts,
                         p.balance_scale, p.seq_len, experts);
      if (aux) add_balance_grad(g.data(), s, p.score_sums[t], p.aux_fraction, p.aux_scale, p.tokens, experts);
      float* dz = p.dlogits + t * experts;
      if (p.score == ops::MoeScore::sigmoid) {
        for (int64_t e = 0; e < experts; ++e) dz[e] = g[e] * s[e] * (1.0f - s[e]);
      } else {
        float gs = 0;
        for (int64_t e = 0; e < experts; ++e) gs += g[e] * s[e];
        for (int64_t e = 0; e < experts; ++e) dz[e] = s[e] * (g[e] - gs);
      }
    }
  }
}

bool supports_moe_bias_update(float*, const double*, int64_t experts, float rate, bool, std::string* reason) {
  return refuse_with(ops::moe_bias_update_problem(experts, rate), reason);
}

void moe_bias_update(float* bias, const double* load, int64_t experts, float rate, bool zero_mean) {
  if (std::string why; !supports_moe_bias_update(bias, load, experts, rate, zero_mean, &why)) fail("{}", why);
  double total = 0;
  for (int64_t e = 0; e < experts; ++e) total += load[e];
  const double mean = total / static_cast<double>(experts);
  std::vector<float> update(experts);
  float update_mean = 0;
  for (int64_t e = 0; e < experts; ++e) {
    update[e] = mean > load[e] ? rate : mean < load[e] ? -rate : 0.0f;
    update_mean += update[e];
  }
  update_mean /= static_cast<float>(experts);
  for (int64_t e = 0; e < experts; ++e) bias[e] += zero_mean ? update[e] - update_mean : update[e];
}

}  // namespace forge::cpu
