// Rotary position embedding in place on device memory, Hugging Face Llama convention (see cpu/rope.cpp): dims
// i and i + d/2 of a head form a pair, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); the inverse (backward)
// rotates by -angle; interleaved (DeepSeek-V3), dims 2i and 2i + 1 pair instead. One thread per pair:
// consecutive threads take consecutive i, so the loads of x1, x2 and of the cos/sin rows are coalesced.
// Elements outside the rotated heads (e.g. v in a fused q|k|v buffer) are never touched.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::load_element;
using detail::store_element;

constexpr int kThreads = 256;

// a*c - b*s and b*c + a*s with the FMA pattern g++ gives the CPU kernel (the first product fused, the second
// rounded), so both backends usually agree bitwise.
template <typename T>
__global__ void rope_kernel(T* x, const float* __restrict__ cos_table,
                            const float* __restrict__ sin_table, int64_t pairs, int64_t seq, int64_t heads,
                            int64_t head_dim, int64_t token_stride, int64_t position_offset, float sign,
                            bool interleaved) {
  const int64_t half = head_dim / 2;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t index = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; index < pairs; index += stride) {
    const int64_t i = index % half;
    const int64_t token_head = index / half;
    const int64_t h = token_head % heads, token = token_head / heads;
    const int64_t table_row = (position_offset + token % seq) * half;
    T* x1 = x + token * token_stride + h * head_dim + (interleaved ? 2 * i : i);
    T* x2 = x1 + (interleaved ? 1 : half);
    const float a = load_element(x1, 0), b = load_element(x2, 0), c = cos_table[table_row + i];
    const float s = sign * sin_table[table_row + i];
    store_element(x1, 0, __fmaf_rn(a, c, -__fmul_rn(b, s)));
    store_element(x2, 0, __fmaf_rn(b, c, __fmul_rn(a, s)));
  }
}

}  // namespace

bool supports_rope(const ops::RopeParams& p, std::string* reason) {
  constexpr const char* op = "rope";
  using detail::refuse;
  if (p.head_dim <= 0 || p.head_dim % 2 != 0)
    return refuse(reason, op, "head_dim must be even and positive, got " + std::to_string(p.head_dim));
  if (p.batch < 0 || p.seq < 0 || p.heads < 0)
    return refuse(reason, op,
                  "bad shape batch=" + std::to_string(p.batch) + " seq=" + std::to_string(p.seq) +
                      " heads=" + std::to_string(p.heads));
  if (p.token_stride < p.heads * p.head_dim)
    return refuse(reason, op,
                  "token_stride " + std::to_string(p.token_stride) +
                      " < heads * head_dim = " + std::to_string(p.heads * p.head_dim));
  if (p.position_offset < 0)
    return refuse(reason, op, "negative position_offset " + std::to_string(p.position_offset));
  if (p.batch * p.seq * p.heads * (p.head_dim / 2) == 0) return true;
  return detail::pointer_set(p.x.get(), op, "x", reason) && detail::pointer_set(p.cos, op, "cos", reason) &&
         detail::pointer_set(p.sin, op, "sin", reason);
}

void rope(const ops::RopeParams& p) {
  if (std::string why; !supports_rope(p, &why)) fail_message(why);
  const int64_t pairs = p.batch * p.seq * p.heads * (p.head_dim / 2);
  if (pairs == 0) return;
  // The inverse rotation is the same with sin negated (exact: a sign flip).
  const float sign = p.inverse ? -1.0f : 1.0f;
  visit(p.x, [&](auto* x) {
    rope_kernel<<<detail::grid_blocks(pairs, kThreads), kThreads, 0, stream()>>>(
        x, p.cos, p.sin, pairs, p.seq, p.heads, p.head_dim, p.token_stride, p.position_offset, sign,
        p.interleaved);
  });
  FORGE_CUDA_CHECK_LAUNCH("rope");
}

}  // namespace forge::cuda
