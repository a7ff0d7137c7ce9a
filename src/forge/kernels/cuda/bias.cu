// A bias over the rows of a matrix on device memory (see cpu/bias.cpp). bias_add is element-wise;
// bias_backward sums columns over rows without atomics: blocks of kRowsPerBlock rows write per-column
// partials, and a second kernel adds each column's partials in block order, the CPU kernel's order, so the
// result is deterministic (and bitwise the CPU's: additions only, no contraction to differ in).
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::load_element;
using detail::store_element;

constexpr int kThreads = 256;
constexpr int64_t kRowsPerBlock = 32;
constexpr int kColumnThreads = 256;
constexpr int kReduceThreads = 64;
constexpr int64_t kMaxGrid = 0x7fffffff;

template <typename T>
__global__ void add_kernel(T* y, int64_t ld, const float* __restrict__ bias, int64_t rows, int64_t n) {
  const int64_t count = rows * n, stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t index = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; index < count; index += stride) {
    const int64_t r = index / n, j = index - r * n;
    store_element(y, r * ld + j, __fadd_rn(load_element(y, r * ld + j), bias[j]));
  }
}

// Row block blockIdx.x, one column per thread (column block blockIdx.y): partial[b][j] = sum_r dy_rj, rows
// in order.
template <typename T>
__global__ void partials_kernel(const T* __restrict__ dy, int64_t ld, int64_t rows, int64_t n,
                                float* __restrict__ partial) {
  const int64_t j = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t begin = int64_t{blockIdx.x} * kRowsPerBlock;
  const int64_t end = begin + kRowsPerBlock < rows ? begin + kRowsPerBlock : rows;
  float acc = 0;
  for (int64_t r = begin; r < end; ++r) acc = __fadd_rn(acc, load_element(dy, r * ld + j));
  partial[int64_t{blockIdx.x} * n + j] = acc;
}

__global__ void reduce_kernel(const float* __restrict__ partial, int64_t blocks, int64_t n,
                              float* __restrict__ dbias) {
  const int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float sum = 0;
#pragma unroll 8
  for (int64_t b = 0; b < blocks; ++b) sum = __fadd_rn(sum, partial[b * n + j]);
  dbias[j] = __fadd_rn(dbias[j], sum);
}

bool shape_ok(const ops::BiasParams& p, const char* op, const char* matrix, int64_t ld, std::string* reason) {
  if (p.rows < 0 || p.n < 0)
    return detail::refuse(reason, op,
                          "bad shape rows=" + std::to_string(p.rows) + " n=" + std::to_string(p.n));
  if (ld != 0 && ld < p.n)
    return detail::refuse(
        reason, op,
        std::string(matrix) + "_ld " + std::to_string(ld) + " is smaller than n " + std::to_string(p.n));
  return true;
}

}  // namespace

bool supports_bias_add(const ops::BiasParams& p, std::string* reason) {
  constexpr const char* op = "bias_add";
  if (!shape_ok(p, op, "y", p.y_ld, reason)) return false;
  using detail::pointer_set;
  return p.rows * p.n == 0 ||
         (pointer_set(p.y.get(), op, "y", reason) && pointer_set(p.bias, op, "bias", reason));
}

bool supports_bias_backward(const ops::BiasParams& p, std::string* reason) {
  constexpr const char* op = "bias_backward";
  if (!shape_ok(p, op, "dy", p.dy_ld, reason)) return false;
  if (p.rows * p.n == 0) return true;
  using detail::pointer_set;
  if (!(pointer_set(p.dy.get(), op, "dy", reason) && pointer_set(p.dbias, op, "dbias", reason))) return false;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t column_blocks = (p.n + kColumnThreads - 1) / kColumnThreads;
  if (column_blocks > 65535 || blocks > kMaxGrid)
    return detail::refuse(reason, op,
                          "shape rows=" + std::to_string(p.rows) + " n=" + std::to_string(p.n) +
                              " exceeds the kernel's grid (n at most " +
                              std::to_string(65535 * kColumnThreads) + ")");
  return true;
}

void bias_add(const ops::BiasParams& p) {
  if (std::string why; !supports_bias_add(p, &why)) fail_message(why);
  if (p.rows * p.n == 0) return;
  visit(p.y, [&](auto* y) {
    add_kernel<<<detail::grid_blocks(p.rows * p.n, kThreads), kThreads, 0, stream()>>>(
        y, p.y_ld > 0 ? p.y_ld : p.n, p.bias, p.rows, p.n);
  });
  FORGE_CUDA_CHECK_LAUNCH("bias_add");
}

void bias_backward(const ops::BiasParams& p) {
  if (std::string why; !supports_bias_backward(p, &why)) fail_message(why);
  if (p.rows * p.n == 0) return;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t column_blocks = (p.n + kColumnThreads - 1) / kColumnThreads;
  detail::StreamScratch partial(static_cast<size_t>(blocks * p.n) * sizeof(float));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(column_blocks));
  visit(p.dy, [&](const auto* dy) {
    partials_kernel<<<grid, kColumnThreads, 0, stream()>>>(dy, p.dy_ld > 0 ? p.dy_ld : p.n, p.rows, p.n,
                                                           partial.as<float>());
  });
  FORGE_CUDA_CHECK_LAUNCH("bias_backward");
  reduce_kernel<<<detail::grid_blocks(p.n, kReduceThreads, kMaxGrid), kReduceThreads, 0, stream()>>>(
      partial.as<float>(), blocks, p.n, p.dbias);
  FORGE_CUDA_CHECK_LAUNCH("bias_backward");
}

}  // namespace forge::cuda
