// RMSNorm forward and the two halves of its backward. Rows are independent, so forward and
// backward_input parallelise over rows. backward_weight sums over rows: it reduces fixed-size row blocks
// into partials and adds the partials in block order, so the result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"

namespace forge::cpu {
namespace {

// Rows per partial sum in backward_weight: fixed (not per thread) so the summation order is fixed.
constexpr int64_t kRowsPerBlock = 32;
// Below this many elements (a decoding step's few rows) a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 14;

bool supports(const ops::RmsNormParams& p, const char* what, std::string* reason) {
  if (p.rows >= 0 && p.dim > 0) return true;
  return ops::refuse(reason, "{}: bad shape rows={} dim={}", what, p.rows, p.dim);
}

void check(const ops::RmsNormParams& p, const char* what) {
  if (std::string why; !supports(p, what, &why)) fail("{}", why);
}

}  // namespace

bool supports_rmsnorm_forward(const ops::RmsNormParams& p, std::string* reason) {
  return supports(p, "rmsnorm_forward", reason);
}
bool supports_rmsnorm_backward_input(const ops::RmsNormParams& p, std::string* reason) {
  return supports(p, "rmsnorm_backward_input", reason);
}
bool supports_rmsnorm_backward_weight(const ops::RmsNormParams& p, std::string* reason) {
  return supports(p, "rmsnorm_backward_weight", reason);
}

namespace {

template <typename X, typename Y>
void forward_rows(const ops::RmsNormParams& p, const X* x_all, Y* y_all) {
  const int64_t dim = p.dim;
  const float* weight = p.weight;
  const float offset = p.weight_offset;
#pragma omp parallel for schedule(static) if (p.rows * dim > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const X* x = x_all + r * dim;
    Y* y = y_all + r * dim;
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < dim; ++j) sum += load_float(x, j) * load_float(x, j);
    const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(dim) + p.eps);
    if (p.rstd) p.rstd[r] = rstd;
#pragma omp simd
    for (int64_t j = 0; j < dim; ++j) store_float(y, j, (weight[j] + offset) * (load_float(x, j) * rstd));
  }
}

// y_j = w_j x_j r with r = (mean(x^2) + eps)^-1/2 (w_j the weight plus its offset), so
// dx_j = r w_j dy_j - x_j r^3 / dim * sum_k dy_k w_k x_k.
template <typename X, typename DY, typename DX>
void backward_rows(const ops::RmsNormParams& p, const X* x_all, const DY* dy_all, DX* dx_all) {
  const int64_t dim = p.dim;
  const float* weight = p.weight;
  const float offset = p.weight_offset;
#pragma omp parallel for schedule(static) if (p.rows * dim > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const X* x = x_all + r * dim;
    const DY* dy = dy_all + r * dim;
    DX* dx = dx_all + r * dim;
    const float rstd = p.rstd[r];
    float dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < dim; ++j) dot += load_float(dy, j) * (weight[j] + offset) * load_float(x, j);
    const float coef = dot * rstd * rstd * rstd / static_cast<float>(dim);
#pragma omp simd
    for (int64_t j = 0; j < dim; ++j)
      store_float(dx, j, rstd * (weight[j] + offset) * load_float(dy, j) - coef * load_float(x, j));
  }
}

template <typename X, typename DY>
void weight_rows(const ops::RmsNormParams& p, const X* x_all, const DY* dy_all) {
  const int64_t dim = p.dim;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks == 0) return;
  std::vector<float> partial(blocks * dim);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      float* acc = partial.data() + b * dim;
      const int64_t end = std::min(p.rows, (b + 1) * kRowsPerBlock);
      for (int64_t r = b * kRowsPerBlock; r < end; ++r) {
        const X* x = x_all + r * dim;
        const DY* dy = dy_all + r * dim;
        const float rstd = p.rstd[r];
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) acc[j] += load_float(dy, j) * load_float(x, j) * rstd;
      }
    }
    add_block_partials(partial.data(), blocks, dim, p.dweight);
  }
}

}  // namespace

void rmsnorm_forward(const ops::RmsNormParams& p) {
  check(p, "rmsnorm_forward");
  visit(p.x, [&](const auto* x) { visit(p.y, [&](auto* y) { forward_rows(p, x, y); }); });
}

void rmsnorm_backward_input(const ops::RmsNormParams& p) {
  check(p, "rmsnorm_backward_input");
  visit(p.x, [&](const auto* x) {
    visit(p.dy, [&](const auto* dy) { visit(p.dx, [&](auto* dx) { backward_rows(p, x, dy, dx); }); });
  });
}

// dweight_j += sum_r dy_rj x_rj rstd_r.
void rmsnorm_backward_weight(const ops::RmsNormParams& p) {
  check(p, "rmsnorm_backward_weight");
  visit(p.x, [&](const auto* x) { visit(p.dy, [&](const auto* dy) { weight_rows(p, x, dy); }); });
}

}  // namespace forge::cpu
