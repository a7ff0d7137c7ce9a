// LayerNorm forward and the two halves of its backward on device memory (see cpu/layernorm.cpp). forward and
// backward_input run one block per row and reduce the row with warp shuffles (the mean first, then the
// squared deviations from it, as the CPU kernel does). backward_weight sums over rows without atomics: blocks
// of kRowsPerBlock rows write per-column partials, and a second kernel adds the partials of each column in
// block order, the CPU kernel's order, so the result is deterministic.
//
// Products that g++ contracts into FMAs in the CPU kernel are written as explicit __fmaf_rn / __fmul_rn
// here, which also keeps the results independent of nvcc's own contraction choices.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

// Rows per partial sum in backward_weight, as in the CPU kernel (fixed, so the summation order is fixed).
constexpr int64_t kRowsPerBlock = 32;
constexpr int kColumnThreads = 256;
// Few threads per block in the final reduction: it has only dim threads in all, best spread over many SMs.
constexpr int kReduceThreads = 64;
constexpr int64_t kMaxGrid = 0x7fffffff;

bool shape_ok(const ops::LayerNormParams& p, const char* op, std::string* reason) {
  if (p.rows >= 0 && p.dim > 0) return true;
  return detail::refuse(reason, op,
                        "bad shape rows=" + std::to_string(p.rows) + " dim=" + std::to_string(p.dim));
}

// Threads per row: about eight elements each, a whole number of warps, between one warp and 512 threads.
// A function of dim alone, so the reduction order (and the result) never depends on anything else.
int row_threads(int64_t dim) {
  const int64_t warps = (dim + 8 * detail::kWarpSize - 1) / (8 * detail::kWarpSize);
  return static_cast<int>(std::clamp<int64_t>(warps, 1, 16)) * detail::kWarpSize;
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::min(rows, kMaxGrid)); }

// x and y may be the same array (as on the CPU): no __restrict__ on them. Every element is read for the two
// sums, then read and written by one thread after the second barrier.
__global__ void forward_kernel(const float* x, const float* __restrict__ weight,
                               const float* __restrict__ bias, float eps, int64_t rows, int64_t dim, float* y,
                               float* __restrict__ mean_out, float* __restrict__ rstd_out) {
  __shared__ float warp_sums[32];
  const float inv_dim = __fdiv_rn(1.0f, static_cast<float>(dim));
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * dim;
    float* yr = y + row * dim;
    float sum = 0;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) sum = __fadd_rn(sum, xr[j]);
    const float mean = __fmul_rn(detail::block_sum(sum, warp_sums), inv_dim);
    float squares = 0;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float centred = __fsub_rn(xr[j], mean);
      squares = __fmaf_rn(centred, centred, squares);
    }
    squares = detail::block_sum(squares, warp_sums);
    // The _rn intrinsics pin IEEE division and square root even if fast-math flags are ever added.
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fmaf_rn(squares, inv_dim, eps)));
    if (threadIdx.x == 0) {
      if (mean_out != nullptr) mean_out[row] = mean;
      if (rstd_out != nullptr) rstd_out[row] = rstd;
    }
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float xhat = __fmul_rn(__fsub_rn(xr[j], mean), rstd);
      yr[j] = __fmaf_rn(xhat, weight[j], bias != nullptr ? bias[j] : 0.0f);
    }
  }
}

// dx_j = r (g_j - mean_k(g_k) - xhat_j mean_k(g_k xhat_k)) with g = dy w (see cpu/layernorm.cpp). dx may
// overwrite dy or x in place, as on the CPU: each element is read for the sums, then read and written by one
// thread after the barriers.
__global__ void backward_input_kernel(const float* x, const float* __restrict__ weight, const float* dy,
                                      const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                      int64_t rows, int64_t dim, float* dx) {
  __shared__ float warp_sums[32];
  const float inv_dim = __fdiv_rn(1.0f, static_cast<float>(dim));
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * dim;
    const float* dyr = dy + row * dim;
    float* dxr = dx + row * dim;
    const float mean = mean_in[row], rstd = rstd_in[row];
    float g_sum = 0, gx_sum = 0;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float g = __fmul_rn(dyr[j], weight[j]);
      g_sum = __fadd_rn(g_sum, g);
      gx_sum = __fmaf_rn(g, __fmul_rn(__fsub_rn(xr[j], mean), rstd), gx_sum);
    }
    const float g_mean = __fmul_rn(detail::block_sum(g_sum, warp_sums), inv_dim);
    const float gx_mean = __fmul_rn(detail::block_sum(gx_sum, warp_sums), inv_dim);
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float xhat = __fmul_rn(__fsub_rn(xr[j], mean), rstd);
      const float centred_g = __fmaf_rn(dyr[j], weight[j], -g_mean);
      dxr[j] = __fmul_rn(rstd, __fmaf_rn(-xhat, gx_mean, centred_g));
    }
  }
}

// Row block b = blockIdx.x of kRowsPerBlock rows, one column per thread (column block blockIdx.y):
// partial_weight[b][j] = sum_r dy_rj xhat_rj and partial_bias[b][j] = sum_r dy_rj (when asked for), rows in
// order. Consecutive threads read consecutive columns, so every row's loads are coalesced.
__global__ void weight_partials_kernel(const float* __restrict__ x, const float* __restrict__ dy,
                                       const float* __restrict__ mean, const float* __restrict__ rstd,
                                       int64_t rows, int64_t dim, float* __restrict__ partial_weight,
                                       float* __restrict__ partial_bias) {
  const int64_t j = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const int64_t begin = int64_t{blockIdx.x} * kRowsPerBlock;
  const int64_t end = begin + kRowsPerBlock < rows ? begin + kRowsPerBlock : rows;
  float acc_w = 0, acc_b = 0;
  for (int64_t r = begin; r < end; ++r) {
    const float d = dy[r * dim + j];
    acc_w = __fmaf_rn(d, __fmul_rn(__fsub_rn(x[r * dim + j], mean[r]), rstd[r]), acc_w);
    acc_b = __fadd_rn(acc_b, d);
  }
  partial_weight[int64_t{blockIdx.x} * dim + j] = acc_w;
  if (partial_bias != nullptr) partial_bias[int64_t{blockIdx.x} * dim + j] = acc_b;
}

__global__ void weight_reduce_kernel(const float* __restrict__ partial, int64_t blocks, int64_t dim,
                                     float* __restrict__ out) {
  const int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float sum = 0;
  // The additions are sequential by design; unrolling lets the loads of later partials start early.
#pragma unroll 8
  for (int64_t b = 0; b < blocks; ++b) sum = __fadd_rn(sum, partial[b * dim + j]);
  out[j] = __fadd_rn(out[j], sum);
}

}  // namespace

bool supports_layernorm_forward(const ops::LayerNormParams& p, std::string* reason) {
  constexpr const char* op = "layernorm_forward";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  using detail::pointer_set;
  // bias, mean and rstd are optional (no bias; inference keeps no statistics).
  return pointer_set(p.x, op, "x", reason) && pointer_set(p.weight, op, "weight", reason) &&
         pointer_set(p.y, op, "y", reason);
}

bool supports_layernorm_backward_input(const ops::LayerNormParams& p, std::string* reason) {
  constexpr const char* op = "layernorm_backward_input";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  using detail::pointer_set;
  return pointer_set(p.x, op, "x", reason) && pointer_set(p.weight, op, "weight", reason) &&
         pointer_set(p.dy, op, "dy", reason) && pointer_set(p.mean, op, "mean", reason) &&
         pointer_set(p.rstd, op, "rstd", reason) && pointer_set(p.dx, op, "dx", reason);
}

bool supports_layernorm_backward_weight(const ops::LayerNormParams& p, std::string* reason) {
  constexpr const char* op = "layernorm_backward_weight";
  if (!shape_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  using detail::pointer_set;
  if (!(pointer_set(p.x, op, "x", reason) && pointer_set(p.dy, op, "dy", reason) &&
        pointer_set(p.mean, op, "mean", reason) && pointer_set(p.rstd, op, "rstd", reason) &&
        pointer_set(p.dweight, op, "dweight", reason)))  // dbias is optional
    return false;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t column_blocks = (p.dim + kColumnThreads - 1) / kColumnThreads;
  if (column_blocks > 65535 || blocks > kMaxGrid)
    return detail::refuse(reason, op,
                          "shape rows=" + std::to_string(p.rows) + " dim=" + std::to_string(p.dim) +
                              " exceeds the kernel's grid (dim at most " +
                              std::to_string(65535 * kColumnThreads) + ")");
  return true;
}

void layernorm_forward(const ops::LayerNormParams& p) {
  if (std::string why; !supports_layernorm_forward(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  forward_kernel<<<row_grid(p.rows), row_threads(p.dim), 0, stream()>>>(p.x, p.weight, p.bias, p.eps, p.rows,
                                                                        p.dim, p.y, p.mean, p.rstd);
  FORGE_CUDA_CHECK_LAUNCH("layernorm_forward");
}

void layernorm_backward_input(const ops::LayerNormParams& p) {
  if (std::string why; !supports_layernorm_backward_input(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  backward_input_kernel<<<row_grid(p.rows), row_threads(p.dim), 0, stream()>>>(p.x, p.weight, p.dy, p.mean,
                                                                               p.rstd, p.rows, p.dim, p.dx);
  FORGE_CUDA_CHECK_LAUNCH("layernorm_backward_input");
}

void layernorm_backward_weight(const ops::LayerNormParams& p) {
  if (std::string why; !supports_layernorm_backward_weight(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t column_blocks = (p.dim + kColumnThreads - 1) / kColumnThreads;
  const size_t part_bytes = detail::align_bytes(static_cast<size_t>(blocks * p.dim) * sizeof(float));
  detail::StreamScratch partial(p.dbias != nullptr ? 2 * part_bytes : part_bytes);
  float* partial_weight = partial.as<float>();
  float* partial_bias = p.dbias != nullptr ? partial.as<float>(part_bytes) : nullptr;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(column_blocks));
  weight_partials_kernel<<<grid, kColumnThreads, 0, stream()>>>(p.x, p.dy, p.mean, p.rstd, p.rows, p.dim,
                                                                partial_weight, partial_bias);
  FORGE_CUDA_CHECK_LAUNCH("layernorm_backward_weight");
  const unsigned reduce_grid = detail::grid_blocks(p.dim, kReduceThreads, kMaxGrid);
  weight_reduce_kernel<<<reduce_grid, kReduceThreads, 0, stream()>>>(partial_weight, blocks, p.dim,
                                                                     p.dweight);
  FORGE_CUDA_CHECK_LAUNCH("layernorm_backward_weight");
  if (partial_bias != nullptr) {
    weight_reduce_kernel<<<reduce_grid, kReduceThreads, 0, stream()>>>(partial_bias, blocks, p.dim, p.dbias);
    FORGE_CUDA_CHECK_LAUNCH("layernorm_backward_weight");
  }
}

}  // namespace forge::cuda
