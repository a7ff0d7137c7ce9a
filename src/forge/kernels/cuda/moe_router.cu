// Mixture-of-experts routing on device memory (ops::MoeRouterParams; the math is written out in
// cpu/moe_router.cpp): one thread per token for the scores, the group-limited top-k and the weights, one
// block per group of tokens for a balance loss (a sequence, or the micro-batch's one group for aux_loss), one
// thread per token for the backward. Routing is a small part of a MoE layer's time (tokens x experts work
// beside the experts' GEMMs), so the kernels are simple rather than fast; every sum runs in the CPU kernel's
// order.
#include <cmath>
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"
#include "forge/kernels/moe_router_checks.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 128;
// The per-thread masks below: experts in 32-bit words, groups in one 64-bit word, chosen ids in registers.
constexpr int64_t kMaxExperts = 1024, kMaxGroups = 64, kMaxTopK = 32;

__device__ float choice_of(const ops::MoeRouterParams& p, const float* s, int64_t e) {
  return s[e] + (p.bias ? p.bias[e] : 0.0f);
}

__global__ void route_kernel(ops::MoeRouterParams p) {
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (t >= p.tokens) return;
  const int64_t experts = p.experts, k = p.top_k;
  const float* z = p.logits + t * experts;
  float* s = p.scores + t * experts;
  if (p.score == ops::MoeScore::sigmoid) {
    for (int64_t e = 0; e < experts; ++e) s[e] = 1.0f / (1.0f + expf(-z[e]));
  } else {
    float max = -INFINITY, sum = 0;
    for (int64_t e = 0; e < experts; ++e) max = fmaxf(max, z[e]);
    for (int64_t e = 0; e < experts; ++e) sum += (s[e] = expf(z[e] - max));
    for (int64_t e = 0; e < experts; ++e) s[e] /= sum;
  }
  if (p.seq_len > 0 || p.aux_loss) {
    float n = 0;
    for (int64_t e = 0; e < experts; ++e) n += s[e];
    p.score_sums[t] = n;
  }

  uint64_t kept = ~uint64_t{0};
  const int64_t size = experts / p.groups;
  if (p.groups > 1) {
    uint64_t taken = 0;
    for (int64_t pick = 0; pick < p.topk_groups; ++pick) {
      int64_t best = -1;
      float best_score = 0;
      for (int64_t g = 0; g < p.groups; ++g) {
        if (taken >> g & 1) continue;
        float first = -INFINITY, second = -INFINITY;
        for (int64_t e = g * size; e < (g + 1) * size; ++e) {
          const float c = choice_of(p, s, e);
          if (c > first)
            second = first, first = c;
          else if (c > second)
            second = c;
        }
        const float score = first + second;
        if (best < 0 || score > best_score) best = g, best_score = score;
      }
      taken |= uint64_t{1} << best;
    }
    kept = taken;
  }

  uint32_t used[kMaxExperts / 32] = {};
  int32_t* ids = p.expert_ids + t * k;
  float* w = p.weights + t * k;
  float sum = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    float best_choice = 0;
    for (int64_t e = 0; e < experts; ++e) {
      if ((used[e / 32] >> (e % 32) & 1) || !(kept >> (e / size) & 1)) continue;
      const float c = choice_of(p, s, e);
      if (best < 0 || c > best_choice) best = e, best_choice = c;
    }
    used[best / 32] |= uint32_t{1} << (best % 32);
    ids[j] = static_cast<int32_t>(best);
    sum += (w[j] = s[best]);
  }
  for (int64_t j = 0; j < k; ++j) w[j] = (p.normalize ? w[j] / (sum + 1e-20f) : w[j]) * p.scaling;
}

// One block per group q of T tokens (fraction [groups, experts], loss [groups]): thread e (and e + blockDim,
// ...) owns expert e's count and mean normalised score.
__global__ void balance_kernel(ops::MoeRouterParams p, int64_t T, float* fraction, float* loss_out) {
  __shared__ double terms[kThreads];
  const int64_t q = blockIdx.x, experts = p.experts, k = p.top_k;
  double partial = 0;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    double count = 0, mean_score = 0;
    for (int64_t t = q * T; t < (q + 1) * T; ++t) {
      mean_score += p.scores[t * experts + e] / p.score_sums[t];
      for (int64_t j = 0; j < k; ++j) count += p.expert_ids[t * k + j] == e ? 1.0 : 0.0;
    }
    const float f = static_cast<float>(static_cast<double>(experts) / static_cast<double>(k * T) * count);
    fraction[q * experts + e] = f;
    partial += double{f} * (mean_score / static_cast<double>(T));
  }
  terms[threadIdx.x] = partial;
  __syncthreads();
  if (threadIdx.x == 0) {
    double loss = 0;
    for (int i = 0; i < blockDim.x; ++i) loss += terms[i];
    loss_out[q] = static_cast<float>(loss);
  }
}

// The score gradient g[e] of token t (see cpu/moe_router.cpp); fs, fs_aux: sum_i f_i s[t, i] of its
// sequence's f and of the micro-batch's.
__device__ float score_grad(const ops::MoeRouterParams& p, int64_t t, int64_t e, float sum, float weighted,
                            float fs, float fs_aux) {
  const int32_t* ids = p.expert_ids + t * p.top_k;
  const float* dw = p.dweights + t * p.top_k;
  float g = 0;
  for (int64_t j = 0; j < p.top_k; ++j)
    if (ids[j] == e) g += p.scaling * (p.normalize ? dw[j] / sum - weighted / (sum * sum) : dw[j]);
  const float n = p.balance_scale != 0.0f || p.aux_scale != 0.0f ? p.score_sums[t] : 1.0f;
  if (p.balance_scale != 0.0f) {
    const float* f = p.expert_fraction + (t / p.seq_len) * p.experts;
    const float scale = p.balance_scale / static_cast<float>(p.seq_len);
    g += scale * (f[e] / n - fs / (n * n));
  }
  if (p.aux_scale != 0.0f) {
    const float scale = p.aux_scale / static_cast<float>(p.tokens);
    g += scale * (p.aux_fraction[e] / n - fs_aux / (n * n));
  }
  return g;
}

__global__ void backward_kernel(ops::MoeRouterParams p) {
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (t >= p.tokens) return;
  const int64_t experts = p.experts, k = p.top_k;
  const float* s = p.scores + t * experts;
  const int32_t* ids = p.expert_ids + t * k;
  float sum = 0, weighted = 0, fs = 0, fs_aux = 0;
  for (int64_t j = 0; j < k; ++j) sum += s[ids[j]];
  sum += 1e-20f;
  for (int64_t j = 0; j < k; ++j) weighted += p.dweights[t * k + j] * s[ids[j]];
  if (p.balance_scale != 0.0f) {
    const float* f = p.expert_fraction + (t / p.seq_len) * experts;
    for (int64_t e = 0; e < experts; ++e) fs += f[e] * s[e];
  }
  if (p.aux_scale != 0.0f)
    for (int64_t e = 0; e < experts; ++e) fs_aux += p.aux_fraction[e] * s[e];
  float* dz = p.dlogits + t * experts;
  if (p.score == ops::MoeScore::sigmoid) {
    for (int64_t e = 0; e < experts; ++e)
      dz[e] = score_grad(p, t, e, sum, weighted, fs, fs_aux) * s[e] * (1.0f - s[e]);
    return;
  }
  float gs = 0;
  for (int64_t e = 0; e < experts; ++e) gs += score_grad(p, t, e, sum, weighted, fs, fs_aux) * s[e];
  for (int64_t e = 0; e < experts; ++e) dz[e] = s[e] * (score_grad(p, t, e, sum, weighted, fs, fs_aux) - gs);
}

__global__ void bias_update_kernel(float* bias, const double* load, int64_t experts, float rate,
                                   bool zero_mean) {
  if (threadIdx.x != 0) return;
  double total = 0;
  for (int64_t e = 0; e < experts; ++e) total += load[e];
  const double mean = total / static_cast<double>(experts);
  float update_mean = 0;
  for (int64_t e = 0; e < experts; ++e) update_mean += mean > load[e] ? rate : mean < load[e] ? -rate : 0.0f;
  update_mean /= static_cast<float>(experts);
  for (int64_t e = 0; e < experts; ++e) {
    const float update = mean > load[e] ? rate : mean < load[e] ? -rate : 0.0f;
    bias[e] += zero_mean ? update - update_mean : update;
  }
}

bool cuda_limits(const ops::MoeRouterParams& p, const char* op, bool backward, std::string* reason) {
  if (const std::string problem = ops::moe_router_problem(p, op, backward); !problem.empty()) {
    if (reason) *reason = problem;
    return false;
  }
  if (p.experts > kMaxExperts || p.groups > kMaxGroups || p.top_k > kMaxTopK)
    return detail::refuse(reason, op,
                          "experts=" + std::to_string(p.experts) + " groups=" + std::to_string(p.groups) +
                              " top_k=" + std::to_string(p.top_k) + " beyond the CUDA router's " +
                              std::to_string(kMaxExperts) + " / " + std::to_string(kMaxGroups) + " / " +
                              std::to_string(kMaxTopK));
  return true;
}

}  // namespace

bool supports_moe_router_forward(const ops::MoeRouterParams& p, std::string* reason) {
  return cuda_limits(p, "moe_router_forward", false, reason);
}
bool supports_moe_router_backward(const ops::MoeRouterParams& p, std::string* reason) {
  return cuda_limits(p, "moe_router_backward", true, reason);
}

void moe_router_forward(const ops::MoeRouterParams& p) {
  if (std::string why; !supports_moe_router_forward(p, &why)) fail_message(why);
  if (p.tokens == 0) {
    if (p.aux_loss)
      FORGE_CUDA_CHECK(
          cudaMemsetAsync(p.aux_fraction, 0, static_cast<size_t>(p.experts) * sizeof(float), stream()));
    return;
  }
  route_kernel<<<detail::grid_blocks(p.tokens, kThreads, int64_t{1} << 30), kThreads, 0, stream()>>>(p);
  FORGE_CUDA_CHECK_LAUNCH("moe_router_forward");
  if (p.seq_len > 0) {
    balance_kernel<<<static_cast<unsigned>(p.tokens / p.seq_len), kThreads, 0, stream()>>>(
        p, p.seq_len, p.expert_fraction, p.balance_loss);
    FORGE_CUDA_CHECK_LAUNCH("moe_router_forward");
  }
  if (p.aux_loss) {
    balance_kernel<<<1, kThreads, 0, stream()>>>(p, p.tokens, p.aux_fraction, p.aux_loss);
    FORGE_CUDA_CHECK_LAUNCH("moe_router_forward");
  }
}

void moe_router_backward(const ops::MoeRouterParams& p) {
  if (std::string why; !supports_moe_router_backward(p, &why)) fail_message(why);
  if (p.tokens == 0) return;
  backward_kernel<<<detail::grid_blocks(p.tokens, kThreads, int64_t{1} << 30), kThreads, 0, stream()>>>(p);
  FORGE_CUDA_CHECK_LAUNCH("moe_router_backward");
}

bool supports_moe_bias_update(float*, const double*, int64_t experts, float rate, bool, std::string* reason) {
  const std::string problem = ops::moe_bias_update_problem(experts, rate);
  if (!problem.empty() && reason) *reason = problem;
  return problem.empty();
}

void moe_bias_update(float* bias, const double* load, int64_t experts, float rate, bool zero_mean) {
  if (std::string why; !supports_moe_bias_update(bias, load, experts, rate, zero_mean, &why))
    fail_message(why);
  bias_update_kernel<<<1, 1, 0, stream()>>>(bias, load, experts, rate, zero_mean);
  FORGE_CUDA_CHECK_LAUNCH("moe_bias_update");
}

}  // namespace forge::cuda
