// A bias over the rows of a matrix: bias_add parallelises over rows; bias_backward sums columns over rows as
// rmsnorm.cpp's weight gradient does (fixed 32-row blocks into partials, the partials added in block order),
// so the result does not depend on the thread count.
#include <algorithm>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"

namespace forge::cpu {
namespace {

// Rows per partial sum in bias_backward: fixed (not per thread) so the summation order is fixed.
constexpr int64_t kRowsPerBlock = 32;
constexpr int64_t kParallelElements = 1 << 14;

// Shapes, the leading dimension of the matrix the op reads (`ld`, 0 = n) and, for a non-empty problem, the
// pointers it needs.
bool supports(const ops::BiasParams& p, const char* op, const char* matrix, int64_t ld, std::string* reason) {
  if (p.rows < 0 || p.n < 0) return ops::refuse(reason, "{}: bad shape rows={} n={}", op, p.rows, p.n);
  if (ld != 0 && ld < p.n)
    return ops::refuse(reason, "{}: {}_ld {} is smaller than n {}", op, matrix, ld, p.n);
  return true;
}

template <typename T>
void add_rows(const ops::BiasParams& p, T* y) {
  const int64_t n = p.n, ld = p.y_ld > 0 ? p.y_ld : n;
  const float* bias = p.bias;
#pragma omp parallel for schedule(static) if (p.rows * n > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    auto* row = y + r * ld;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) store_float(row, j, load_float(row, j) + bias[j]);
  }
}

template <typename T>
void sum_rows(const ops::BiasParams& p, const T* dy) {
  const int64_t n = p.n, ld = p.dy_ld > 0 ? p.dy_ld : n;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks == 0 || n == 0) return;
  std::vector<float> partial(blocks * n);
#pragma omp parallel if (p.rows * n > kParallelElements)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      float* acc = partial.data() + b * n;
      const int64_t end = std::min(p.rows, (b + 1) * kRowsPerBlock);
      for (int64_t r = b * kRowsPerBlock; r < end; ++r) {
        const auto* row = dy + r * ld;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) acc[j] += load_float(row, j);
      }
    }
    add_block_partials(partial.data(), blocks, n, p.dbias);
  }
}

}  // namespace

bool supports_bias_add(const ops::BiasParams& p, std::string* reason) {
  constexpr const char* op = "bias_add";
  if (!supports(p, op, "y", p.y_ld, reason)) return false;
  return p.rows * p.n == 0 ||
         (ops::pointer_set(p.y.get(), op, "y", reason) && ops::pointer_set(p.bias, op, "bias", reason));
}

bool supports_bias_backward(const ops::BiasParams& p, std::string* reason) {
  constexpr const char* op = "bias_backward";
  if (!supports(p, op, "dy", p.dy_ld, reason)) return false;
  return p.rows * p.n == 0 ||
         (ops::pointer_set(p.dy.get(), op, "dy", reason) && ops::pointer_set(p.dbias, op, "dbias", reason));
}

void bias_add(const ops::BiasParams& p) {
  if (std::string why; !supports_bias_add(p, &why)) fail("{}", why);
  visit(p.y, [&](auto* y) { add_rows(p, y); });
}

// dbias_j += sum_r dy_rj.
void bias_backward(const ops::BiasParams& p) {
  if (std::string why; !supports_bias_backward(p, &why)) fail("{}", why);
  visit(p.dy, [&](const auto* dy) { sum_rows(p, dy); });
}

}  // namespace forge::cpu
