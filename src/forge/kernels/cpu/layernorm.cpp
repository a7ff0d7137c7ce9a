// LayerNorm forward and the two halves of its backward (PyTorch's nn.LayerNorm: biased variance, eps inside
// the square root). Rows are independent, so forward and backward_input parallelise over rows.
// backward_weight sums over rows as rmsnorm.cpp does: fixed-size row blocks reduce into partials, and the
// partials are added in block order, so the result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

// Rows per partial sum in backward_weight: fixed (not per thread) so the summation order is fixed.
constexpr int64_t kRowsPerBlock = 32;
// Below this many elements (a decoding step's few rows) a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 14;

bool shape_ok(const ops::LayerNormParams& p, const char* op, std::string* reason) {
  if (p.rows >= 0 && p.dim > 0) return true;
  return ops::refuse(reason, "{}: bad shape rows={} dim={}", op, p.rows, p.dim);
}

}  // namespace

bool supports_layernorm_forward(const ops::LayerNormParams& p, std::string* reason) {
  constexpr const char* op = "layernorm_forward";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  // bias, mean and rstd are optional (no bias; inference keeps no statistics).
  return ops::pointer_set(p.x, op, "x", reason) && ops::pointer_set(p.weight, op, "weight", reason) &&
         ops::pointer_set(p.y, op, "y", reason);
}

bool supports_layernorm_backward_input(const ops::LayerNormParams& p, std::string* reason) {
  constexpr const char* op = "layernorm_backward_input";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  return ops::pointer_set(p.x, op, "x", reason) && ops::pointer_set(p.weight, op, "weight", reason) &&
         ops::pointer_set(p.dy, op, "dy", reason) && ops::pointer_set(p.mean, op, "mean", reason) &&
         ops::pointer_set(p.rstd, op, "rstd", reason) && ops::pointer_set(p.dx, op, "dx", reason);
}

bool supports_layernorm_backward_weight(const ops::LayerNormParams& p, std::string* reason) {
  constexpr const char* op = "layernorm_backward_weight";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  return ops::pointer_set(p.x, op, "x", reason) && ops::pointer_set(p.dy, op, "dy", reason) &&
         ops::pointer_set(p.mean, op, "mean", reason) && ops::pointer_set(p.rstd, op, "rstd", reason) &&
         ops::pointer_set(p.dweight, op, "dweight", reason);  // dbias is optional
}

void layernorm_forward(const ops::LayerNormParams& p) {
  if (std::string why; !supports_layernorm_forward(p, &why)) fail("{}", why);
  const int64_t dim = p.dim;
  const float* weight = p.weight;
  const float* bias = p.bias;
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static) if (p.rows * dim > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * dim;
    float* y = p.y + r * dim;
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < dim; ++j) sum += x[j];
    const float mean = sum * inv_dim;
    float squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < dim; ++j) squares += (x[j] - mean) * (x[j] - mean);
    const float rstd = 1.0f / std::sqrt(squares * inv_dim + p.eps);
    if (p.mean) p.mean[r] = mean;
    if (p.rstd) p.rstd[r] = rstd;
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) y[j] = (x[j] - mean) * rstd * weight[j] + bias[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) y[j] = (x[j] - mean) * rstd * weight[j];
    }
  }
}

// With xhat_j = (x_j - mean) r and g_j = dy_j w_j, y_j = w_j xhat_j + b_j gives
// dx_j = r (g_j - mean_k(g_k) - xhat_j mean_k(g_k xhat_k)).
void layernorm_backward_input(const ops::LayerNormParams& p) {
  if (std::string why; !supports_layernorm_backward_input(p, &why)) fail("{}", why);
  const int64_t dim = p.dim;
  const float* weight = p.weight;
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static) if (p.rows * dim > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * dim;
    const float* dy = p.dy + r * dim;
    float* dx = p.dx + r * dim;
    const float mean = p.mean[r], rstd = p.rstd[r];
    float g_sum = 0, gx_sum = 0;
#pragma omp simd reduction(+ : g_sum, gx_sum)
    for (int64_t j = 0; j < dim; ++j) {
      const float g = dy[j] * weight[j];
      g_sum += g;
      gx_sum += g * ((x[j] - mean) * rstd);
    }
    const float g_mean = g_sum * inv_dim, gx_mean = gx_sum * inv_dim;
#pragma omp simd
    for (int64_t j = 0; j < dim; ++j) {
      const float xhat = (x[j] - mean) * rstd;
      dx[j] = rstd * (dy[j] * weight[j] - g_mean - xhat * gx_mean);
    }
  }
}

// dweight_j += sum_r dy_rj xhat_rj, dbias_j += sum_r dy_rj.
void layernorm_backward_weight(const ops::LayerNormParams& p) {
  if (std::string why; !supports_layernorm_backward_weight(p, &why)) fail("{}", why);
  const int64_t dim = p.dim;
  const bool with_bias = p.dbias != nullptr;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks == 0) return;
  // Block b's partials: dweight's at [b * dim], dbias's at [(blocks + b) * dim].
  std::vector<float> partial((with_bias ? 2 : 1) * blocks * dim);
  float* partial_weight = partial.data();
  float* partial_bias = with_bias ? partial.data() + blocks * dim : nullptr;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      float* acc_w = partial_weight + b * dim;
      const int64_t end = std::min(p.rows, (b + 1) * kRowsPerBlock);
      for (int64_t r = b * kRowsPerBlock; r < end; ++r) {
        const float* x = p.x + r * dim;
        const float* dy = p.dy + r * dim;
        const float mean = p.mean[r], rstd = p.rstd[r];
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) acc_w[j] += dy[j] * ((x[j] - mean) * rstd);
        if (with_bias) {
          float* acc_b = partial_bias + b * dim;
#pragma omp simd
          for (int64_t j = 0; j < dim; ++j) acc_b[j] += dy[j];
        }
      }
    }
    add_block_partials(partial_weight, blocks, dim, p.dweight);
    if (with_bias) add_block_partials(partial_bias, blocks, dim, p.dbias);
  }
}

}  // namespace forge::cpu
