// The data-movement ops of attention across a context-parallel group on device memory (see
// ops::AttentionMergeParams, ops::StridedCopyParams). attention_merge: one thread per (b, h, t) row, its
// weights in double as on the CPU, so the merge is bitwise the CPU's up to exp/log's last-ulp rounding.
// strided_copy: one thread per element (grid-stride); pure copies and single additions, bitwise the CPU's.
#include <cmath>
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::load_element;
using detail::store_element;

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? b : 65535);
}

__global__ void attention_merge_kernel(ops::AttentionMergeParams p) {
  const int64_t rows = p.batch * p.heads * p.seq, width = p.heads * p.v_dim;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = r % p.seq, h = (r / p.seq) % p.heads, b = r / (p.seq * p.heads);
    const double old_lse = p.lse[r], new_lse = p.lse_b[r];
    if (isinf(new_lse) && new_lse < 0) continue;
    const double m = old_lse > new_lse ? old_lse : new_lse;
    const double total = m + log(exp(old_lse - m) + exp(new_lse - m));
    const float w_old = static_cast<float>(exp(old_lse - total)),
                w_new = static_cast<float>(exp(new_lse - total));
    float* o = p.out + (b * p.seq + t) * width + h * p.v_dim;
    const float* ob = p.out_b + (b * p.seq + t) * width + h * p.v_dim;
    for (int64_t i = 0; i < p.v_dim; ++i) o[i] = w_old * o[i] + w_new * ob[i];
    p.lse[r] = static_cast<float>(total);
  }
}

// Elements as floats, from and to fp32 or bf16 (rounded once, as the CPU's).
template <typename Src, typename Dst>
__global__ void strided_copy_kernel(ops::StridedCopyParams p, const Src* src, Dst* dst) {
  const int64_t n = p.shape[0] * p.shape[1] * p.shape[2];
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = e % p.shape[2], j = (e / p.shape[2]) % p.shape[1], i = e / (p.shape[2] * p.shape[1]);
    const float x = load_element(src, i * p.src_stride[0] + j * p.src_stride[1] + k * p.src_stride[2]);
    const int64_t y = i * p.dst_stride[0] + j * p.dst_stride[1] + k * p.dst_stride[2];
    store_element(dst, y, p.accumulate ? load_element(dst, y) + x : x);
  }
}

}  // namespace

bool supports_attention_merge(const ops::AttentionMergeParams& p, std::string* reason) {
  constexpr const char* op = "attention_merge";
  if (p.batch < 0 || p.seq < 0 || p.heads < 0 || p.v_dim < 0)
    return detail::refuse(reason, op,
                          "bad shape batch=" + std::to_string(p.batch) + " seq=" + std::to_string(p.seq) +
                              " heads=" + std::to_string(p.heads) + " v_dim=" + std::to_string(p.v_dim));
  if (p.batch * p.seq * p.heads * p.v_dim == 0) return true;
  using detail::pointer_set;
  return pointer_set(p.out, op, "out", reason) && pointer_set(p.lse, op, "lse", reason) &&
         pointer_set(p.out_b, op, "out_b", reason) && pointer_set(p.lse_b, op, "lse_b", reason);
}

void attention_merge(const ops::AttentionMergeParams& p) {
  if (std::string why; !supports_attention_merge(p, &why)) fail_message(why);
  const int64_t rows = p.batch * p.heads * p.seq;
  if (rows == 0 || p.v_dim == 0) return;
  attention_merge_kernel<<<blocks_for(rows), kThreads, 0, stream()>>>(p);
  FORGE_CUDA_CHECK_LAUNCH("attention_merge");
}

bool supports_strided_copy(const ops::StridedCopyParams& p, std::string* reason) {
  constexpr const char* op = "strided_copy";
  if (p.shape[0] < 0 || p.shape[1] < 0 || p.shape[2] < 0)
    return detail::refuse(reason, op,
                          "bad shape " + std::to_string(p.shape[0]) + "x" + std::to_string(p.shape[1]) + "x" +
                              std::to_string(p.shape[2]));
  if (p.shape[0] * p.shape[1] * p.shape[2] == 0) return true;
  using detail::pointer_set;
  return pointer_set(p.src.get(), op, "src", reason) && pointer_set(p.dst.get(), op, "dst", reason);
}

void strided_copy(const ops::StridedCopyParams& p) {
  if (std::string why; !supports_strided_copy(p, &why)) fail_message(why);
  const int64_t n = p.shape[0] * p.shape[1] * p.shape[2];
  if (n == 0) return;
  visit(p.src, [&](const auto* src) {
    visit(p.dst, [&](auto* dst) {
      strided_copy_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(p, src, dst);
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("strided_copy");
}

}  // namespace forge::cuda
