// RMSNorm forward and the two halves of its backward on device memory. forward and backward_input run one
// block per row and reduce the row with warp shuffles. backward_weight sums over rows without atomics: blocks
// of kRowsPerBlock rows write per-column partials, and a second kernel adds the partials of each column in
// block order, the same order as the CPU kernel (cpu/rmsnorm.cpp), so the result is deterministic.
//
// Products that g++ contracts into FMAs in the CPU kernel are written as explicit __fmaf_rn / __fmul_rn
// here, which also keeps the results independent of nvcc's own contraction choices.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::load_element;
using detail::store_element;

// Rows per partial sum in backward_weight, as in the CPU kernel (fixed, so the summation order is fixed).
constexpr int64_t kRowsPerBlock = 32;
constexpr int kColumnThreads = 256;
// Few threads per block in the final reduction: it has only dim threads in all, best spread over many SMs.
constexpr int kReduceThreads = 64;
constexpr int64_t kMaxGrid = 0x7fffffff;

bool shape_ok(const ops::RmsNormParams& p, const char* op, std::string* reason) {
  // Gemma's 1 + w scale runs on CPUs only so far.
  if (p.weight_offset != 0.0f)
    return detail::refuse(reason, op, "a weight offset (Gemma's 1 + w) is not implemented on CUDA; run on the CPU");
  if (p.rows >= 0 && p.dim > 0) return true;
  return detail::refuse(reason, op, "bad shape rows=" + std::to_string(p.rows) + " dim=" + std::to_string(p.dim));
}

// Threads per row: about eight elements each, a whole number of warps, between one warp and 512 threads.
// A function of dim alone, so the reduction order (and the result) never depends on anything else.
int row_threads(int64_t dim) {
  const int64_t warps = (dim + 8 * detail::kWarpSize - 1) / (8 * detail::kWarpSize);
  return static_cast<int>(std::clamp<int64_t>(warps, 1, 16)) * detail::kWarpSize;
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::min(rows, kMaxGrid)); }

// x and y may be the same array (as on the CPU): no __restrict__ on them. Each element is read for the sum,
// then read and written by one thread after the barrier.
template <typename X, typename Y>
__global__ void forward_kernel(const X* x, const float* __restrict__ weight, float eps, int64_t rows,
                               int64_t dim, Y* y, float* __restrict__ rstd_out) {
  __shared__ float warp_sums[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const X* xr = x + row * dim;
    Y* yr = y + row * dim;
    float sum = 0;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float v = load_element(xr, j);
      sum = __fmaf_rn(v, v, sum);
    }
    sum = detail::block_sum(sum, warp_sums);
    // The _rn intrinsics pin IEEE division and square root even if fast-math flags are ever added.
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum, static_cast<float>(dim)), eps)));
    if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[row] = rstd;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
      store_element(yr, j, __fmul_rn(weight[j], __fmul_rn(load_element(xr, j), rstd)));
  }
}

// dx_j = r w_j dy_j - x_j r^3 / dim * sum_k dy_k w_k x_k (see cpu/rmsnorm.cpp). dx may overwrite dy or x in
// place, as on the CPU.
template <typename X, typename DY, typename DX>
__global__ void backward_input_kernel(const X* x, const float* __restrict__ weight, const DY* dy,
                                      const float* __restrict__ rstd_in, int64_t rows, int64_t dim, DX* dx) {
  __shared__ float warp_sums[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const X* xr = x + row * dim;
    const DY* dyr = dy + row * dim;
    DX* dxr = dx + row * dim;
    const float rstd = rstd_in[row];
    float dot = 0;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
      dot = __fmaf_rn(__fmul_rn(load_element(dyr, j), weight[j]), load_element(xr, j), dot);
    dot = detail::block_sum(dot, warp_sums);
    const float coef =
        __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(dot, rstd), rstd), rstd), static_cast<float>(dim));
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
      store_element(dxr, j,
                    __fmaf_rn(__fmul_rn(rstd, weight[j]), load_element(dyr, j),
                              -__fmul_rn(coef, load_element(xr, j))));
  }
}

// Row block b = blockIdx.x of kRowsPerBlock rows, one column per thread (column block blockIdx.y):
// partial[b][j] = sum_r dy_rj x_rj rstd_r, rows in order. Consecutive threads read consecutive columns, so
// every row's loads are coalesced.
template <typename X, typename DY>
__global__ void weight_partials_kernel(const X* __restrict__ x, const DY* __restrict__ dy,
                                       const float* __restrict__ rstd, int64_t rows, int64_t dim,
                                       float* __restrict__ partial) {
  const int64_t j = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const int64_t begin = int64_t{blockIdx.x} * kRowsPerBlock;
  const int64_t end = begin + kRowsPerBlock < rows ? begin + kRowsPerBlock : rows;
  float acc = 0;
  for (int64_t r = begin; r < end; ++r)
    acc = __fmaf_rn(__fmul_rn(load_element(dy, r * dim + j), load_element(x, r * dim + j)), rstd[r], acc);
  partial[int64_t{blockIdx.x} * dim + j] = acc;
}

__global__ void weight_reduce_kernel(const float* __restrict__ partial, int64_t blocks, int64_t dim,
                                     float* __restrict__ dweight) {
  const int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float sum = 0;
  // The additions are sequential by design; unrolling lets the loads of later partials start early.
#pragma unroll 8
  for (int64_t b = 0; b < blocks; ++b) sum = __fadd_rn(sum, partial[b * dim + j]);
  dweight[j] = __fadd_rn(dweight[j], sum);
}

}  // namespace

bool supports_rmsnorm_forward(const ops::RmsNormParams& p, std::string* reason) {
  constexpr const char* op = "rmsnorm_forward";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  using detail::pointer_set;
  return pointer_set(p.x.get(), op, "x", reason) && pointer_set(p.weight, op, "weight", reason) &&
         pointer_set(p.y.get(), op, "y", reason);  // rstd is optional (inference keeps none)
}

bool supports_rmsnorm_backward_input(const ops::RmsNormParams& p, std::string* reason) {
  constexpr const char* op = "rmsnorm_backward_input";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  using detail::pointer_set;
  return pointer_set(p.x.get(), op, "x", reason) && pointer_set(p.weight, op, "weight", reason) &&
         pointer_set(p.dy.get(), op, "dy", reason) && pointer_set(p.rstd, op, "rstd", reason) &&
         pointer_set(p.dx.get(), op, "dx", reason);
}

bool supports_rmsnorm_backward_weight(const ops::RmsNormParams& p, std::string* reason) {
  constexpr const char* op = "rmsnorm_backward_weight";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  using detail::pointer_set;
  if (!(pointer_set(p.x.get(), op, "x", reason) && pointer_set(p.dy.get(), op, "dy", reason) &&
        pointer_set(p.rstd, op, "rstd", reason) && pointer_set(p.dweight, op, "dweight", reason)))
    return false;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t column_blocks = (p.dim + kColumnThreads - 1) / kColumnThreads;
  if (column_blocks > 65535 || blocks > kMaxGrid)
    return detail::refuse(reason, op,
                          "shape rows=" + std::to_string(p.rows) + " dim=" + std::to_string(p.dim) +
                              " exceeds the kernel's grid (dim at most " + std::to_string(65535 * kColumnThreads) +
                              ")");
  return true;
}

void rmsnorm_forward(const ops::RmsNormParams& p) {
  if (std::string why; !supports_rmsnorm_forward(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  visit(p.x, [&](const auto* x) {
    visit(p.y, [&](auto* y) {
      forward_kernel<<<row_grid(p.rows), row_threads(p.dim), 0, stream()>>>(x, p.weight, p.eps, p.rows,
                                                                            p.dim, y, p.rstd);
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("rmsnorm_forward");
}

void rmsnorm_backward_input(const ops::RmsNormParams& p) {
  if (std::string why; !supports_rmsnorm_backward_input(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  visit(p.x, [&](const auto* x) {
    visit(p.dy, [&](const auto* dy) {
      visit(p.dx, [&](auto* dx) {
        backward_input_kernel<<<row_grid(p.rows), row_threads(p.dim), 0, stream()>>>(x, p.weight, dy, p.rstd,
                                                                                     p.rows, p.dim, dx);
      });
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("rmsnorm_backward_input");
}

void rmsnorm_backward_weight(const ops::RmsNormParams& p) {
  if (std::string why; !supports_rmsnorm_backward_weight(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t column_blocks = (p.dim + kColumnThreads - 1) / kColumnThreads;
  detail::StreamScratch partial(static_cast<size_t>(blocks * p.dim) * sizeof(float));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(column_blocks));
  visit(p.x, [&](const auto* x) {
    visit(p.dy, [&](const auto* dy) {
      weight_partials_kernel<<<grid, kColumnThreads, 0, stream()>>>(x, dy, p.rstd, p.rows, p.dim,
                                                                    partial.as<float>());
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("rmsnorm_backward_weight");
  weight_reduce_kernel<<<detail::grid_blocks(p.dim, kReduceThreads, kMaxGrid), kReduceThreads, 0, stream()>>>(
      partial.as<float>(), blocks, p.dim, p.dweight);
  FORGE_CUDA_CHECK_LAUNCH("rmsnorm_backward_weight");
}

}  // namespace forge::cuda
