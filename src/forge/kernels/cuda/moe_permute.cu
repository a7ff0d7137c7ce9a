// moe_permute / moe_unpermute and their backward passes on device memory (ops.h, MoePermuteParams,
// MoeUnpermuteParams; cpu/moe_permute.cpp). One block per output row (grid-stride over rows), its threads
// over hidden: gathers only, each output element written by one thread, a token's top_k rows summed in
// increasing j, so no atomics and the same bits every run. dweights: one block per assignment, a fixed-order
// block sum.
//
// Indices are data on the device: checking them would wait for it, so a kernel reads and writes nothing for
// an index out of range (the row of an out-of-range source stays unwritten, a bad row_of counts as dropped)
// where the CPU fails with one line. source -1 is a padding row, not out of range: its row becomes zeros.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::load_element;
using detail::store_element;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxBlocks)); }

template <typename X, typename Out>
__global__ void permute_kernel(const int32_t* __restrict__ source, int64_t rows, int64_t assignments,
                               int64_t top_k, int64_t hidden, const X* __restrict__ x, int64_t x_stride,
                               Out* __restrict__ out) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t a = source[r];
    Out* dst = out + r * hidden;
    if (a == -1) {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) store_element(dst, i, 0.0f);
      continue;
    }
    if (a < 0 || a >= assignments) continue;
    const X* src = x + (a / top_k) * x_stride;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) store_element(dst, i, load_element(src, i));
  }
}

template <typename Dout, typename Dx>
__global__ void permute_backward_kernel(const int32_t* __restrict__ row_of, int64_t tokens, int64_t top_k,
                                        int64_t rows, int64_t hidden, const Dout* __restrict__ dout,
                                        Dx* __restrict__ dx, int64_t dx_stride) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      float sum = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t row = row_of[t * top_k + j];
        if (row >= 0 && row < rows) sum = __fadd_rn(sum, load_element(dout, int64_t{row} * hidden + i));
      }
      store_element(dx, t * dx_stride + i, sum);
    }
  }
}

template <typename Y, typename Out>
__global__ void unpermute_kernel(const int32_t* __restrict__ row_of, const float* __restrict__ weights,
                                 int64_t tokens, int64_t top_k, int64_t rows, int64_t hidden,
                                 const Y* __restrict__ y, Out* __restrict__ out, int64_t out_stride) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      float sum = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t row = row_of[t * top_k + j];
        if (row >= 0 && row < rows)
          sum = __fmaf_rn(weights[t * top_k + j], load_element(y, int64_t{row} * hidden + i), sum);
      }
      store_element(out, t * out_stride + i, sum);
    }
  }
}

template <typename Dout, typename Dy>
__global__ void unpermute_backward_dy_kernel(const int32_t* __restrict__ source,
                                             const float* __restrict__ weights, int64_t rows,
                                             int64_t assignments, int64_t top_k, int64_t hidden,
                                             const Dout* __restrict__ dout, int64_t dout_stride,
                                             Dy* __restrict__ dy) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t a = source[r];
    if (a == -1) {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) store_element(dy, r * hidden + i, 0.0f);
      continue;
    }
    if (a < 0 || a >= assignments) continue;
    const float w = weights[a];
    const Dout* d = dout + (a / top_k) * dout_stride;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
      store_element(dy, r * hidden + i, __fmul_rn(w, load_element(d, i)));
  }
}

template <typename Dout, typename Y>
__global__ void unpermute_backward_dweights_kernel(const int32_t* __restrict__ row_of, int64_t assignments,
                                                   int64_t top_k, int64_t rows, int64_t hidden,
                                                   const Dout* __restrict__ dout, int64_t dout_stride,
                                                   const Y* __restrict__ y, float* __restrict__ dweights) {
  __shared__ float warp_sums[kThreads / detail::kWarpSize];
  for (int64_t a = blockIdx.x; a < assignments; a += gridDim.x) {
    const int32_t row = row_of[a];  // uniform across the block
    if (row < 0 || row >= rows) {
      if (threadIdx.x == 0) dweights[a] = 0.0f;
      continue;
    }
    const Dout* d = dout + (a / top_k) * dout_stride;
    const Y* yr = y + int64_t{row} * hidden;
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
      sum = __fmaf_rn(load_element(d, i), load_element(yr, i), sum);
    sum = detail::block_sum(sum, warp_sums);
    if (threadIdx.x == 0) dweights[a] = sum;
  }
}

bool shape_ok(const char* op, int64_t tokens, int64_t top_k, int64_t hidden, int64_t rows,
              std::string* reason) {
  if (tokens < 0 || top_k <= 0 || hidden <= 0 || rows < 0)
    return detail::refuse(reason, op,
                          "bad shape tokens=" + std::to_string(tokens) + " top_k=" + std::to_string(top_k) +
                              " hidden=" + std::to_string(hidden) + " rows=" + std::to_string(rows));
  // Padding may take rows past tokens * top_k (ops::moe_sorted_rows_bound); row_of indexes them as int32.
  if (rows > 0x7fffffff)
    return detail::refuse(reason, op, "rows " + std::to_string(rows) + " does not fit the int32 row indices");
  return true;
}

bool stride_ok(const char* op, const char* name, int64_t stride, int64_t hidden, std::string* reason) {
  if (stride == 0 || stride >= hidden) return true;
  return detail::refuse(
      reason, op,
      std::string(name) + " " + std::to_string(stride) + " is smaller than hidden " + std::to_string(hidden));
}

int64_t or_hidden(int64_t stride, int64_t hidden) { return stride > 0 ? stride : hidden; }

}  // namespace

bool supports_moe_permute(const ops::MoePermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_permute";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "x_stride", p.x_stride, p.hidden, reason))
    return false;
  return p.rows == 0 ||
         (detail::pointer_set(p.source, op, "source", reason) && detail::pointer_set(p.x, op, "x", reason) &&
          detail::pointer_set(p.out, op, "out", reason));
}

bool supports_moe_permute_backward(const ops::MoePermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_permute_backward";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "dx_stride", p.dx_stride, p.hidden, reason))
    return false;
  return p.tokens == 0 || (detail::pointer_set(p.row_of, op, "row_of", reason) &&
                           detail::pointer_set(p.dx, op, "dx", reason) &&
                           (p.rows == 0 || detail::pointer_set(p.dout, op, "dout", reason)));
}

bool supports_moe_unpermute(const ops::MoeUnpermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_unpermute";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "out_stride", p.out_stride, p.hidden, reason))
    return false;
  return p.tokens == 0 || (detail::pointer_set(p.row_of, op, "row_of", reason) &&
                           detail::pointer_set(p.weights, op, "weights", reason) &&
                           detail::pointer_set(p.out, op, "out", reason) &&
                           (p.rows == 0 || detail::pointer_set(p.y, op, "y", reason)));
}

bool supports_moe_unpermute_backward(const ops::MoeUnpermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_unpermute_backward";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "dout_stride", p.dout_stride, p.hidden, reason))
    return false;
  if (p.rows > 0 && p.dy &&
      !(detail::pointer_set(p.source, op, "source", reason) &&
        detail::pointer_set(p.weights, op, "weights", reason) &&
        detail::pointer_set(p.dout, op, "dout", reason)))
    return false;
  if (p.tokens > 0 && p.dweights &&
      !(detail::pointer_set(p.row_of, op, "row_of", reason) &&
        detail::pointer_set(p.dout, op, "dout", reason) &&
        (p.rows == 0 || detail::pointer_set(p.y, op, "y", reason))))
    return false;
  return true;
}

void moe_permute(const ops::MoePermuteParams& p) {
  if (std::string why; !supports_moe_permute(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  visit(p.x, [&](const auto* x) {
    visit(p.out, [&](auto* out) {
      permute_kernel<<<row_blocks(p.rows), kThreads, 0, stream()>>>(
          p.source, p.rows, p.tokens * p.top_k, p.top_k, p.hidden, x, or_hidden(p.x_stride, p.hidden), out);
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("moe_permute");
}

void moe_permute_backward(const ops::MoePermuteParams& p) {
  if (std::string why; !supports_moe_permute_backward(p, &why)) fail_message(why);
  if (p.tokens == 0) return;
  visit(p.dout, [&](const auto* dout) {
    visit(p.dx, [&](auto* dx) {
      permute_backward_kernel<<<row_blocks(p.tokens), kThreads, 0, stream()>>>(
          p.row_of, p.tokens, p.top_k, p.rows, p.hidden, dout, dx, or_hidden(p.dx_stride, p.hidden));
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("moe_permute_backward");
}

void moe_unpermute(const ops::MoeUnpermuteParams& p) {
  if (std::string why; !supports_moe_unpermute(p, &why)) fail_message(why);
  if (p.tokens == 0) return;
  visit(p.y, [&](const auto* y) {
    visit(p.out, [&](auto* out) {
      unpermute_kernel<<<row_blocks(p.tokens), kThreads, 0, stream()>>>(
          p.row_of, p.weights, p.tokens, p.top_k, p.rows, p.hidden, y, out,
          or_hidden(p.out_stride, p.hidden));
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("moe_unpermute");
}

void moe_unpermute_backward(const ops::MoeUnpermuteParams& p) {
  if (std::string why; !supports_moe_unpermute_backward(p, &why)) fail_message(why);
  const int64_t assignments = p.tokens * p.top_k, dout_stride = or_hidden(p.dout_stride, p.hidden);
  if (p.dy && p.rows > 0) {
    visit(p.dout, [&](const auto* dout) {
      visit(p.dy, [&](auto* dy) {
        unpermute_backward_dy_kernel<<<row_blocks(p.rows), kThreads, 0, stream()>>>(
            p.source, p.weights, p.rows, assignments, p.top_k, p.hidden, dout, dout_stride, dy);
      });
    });
    FORGE_CUDA_CHECK_LAUNCH("moe_unpermute_backward");
  }
  if (p.dweights && assignments > 0) {
    visit(p.dout, [&](const auto* dout) {
      visit(p.y, [&](const auto* y) {
        unpermute_backward_dweights_kernel<<<row_blocks(assignments), kThreads, 0, stream()>>>(
            p.row_of, assignments, p.top_k, p.rows, p.hidden, dout, dout_stride, y, p.dweights);
      });
    });
    FORGE_CUDA_CHECK_LAUNCH("moe_unpermute_backward");
  }
}

}  // namespace forge::cuda
