// Appending the new tokens' keys and values to an inference cache on device memory (see ops::KvAppendParams):
// one block per (sequence, token, kv head) row pair, threads along head_dim. Pure copies: bitwise the CPU's.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 128;

__global__ void kv_append_kernel(ops::KvAppendParams p) {
  const int64_t rows = p.batch * p.tokens * p.kv_heads;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t g = r % p.kv_heads, bt = r / p.kv_heads, t = bt % p.tokens, b = bt / p.tokens;
    const float* row = p.qkv + bt * p.qkv_stride;
    const int64_t slot = b * p.batch_stride + g * p.head_stride + (p.position + t) * p.head_dim;
    for (int64_t j = threadIdx.x; j < p.head_dim; j += blockDim.x) {
      p.keys[slot + j] = row[p.k_offset + g * p.head_dim + j];
      p.values[slot + j] = row[p.v_offset + g * p.head_dim + j];
    }
  }
}

}  // namespace

bool supports_kv_append(const ops::KvAppendParams& p, std::string* reason) {
  constexpr const char* op = "kv_append";
  if (p.batch < 0 || p.tokens < 0 || p.kv_heads <= 0 || p.head_dim <= 0 || p.position < 0)
    return detail::refuse(reason, op,
                          "bad shape batch=" + std::to_string(p.batch) + " tokens=" + std::to_string(p.tokens) +
                              " kv_heads=" + std::to_string(p.kv_heads) +
                              " head_dim=" + std::to_string(p.head_dim) + " position=" + std::to_string(p.position));
  if (p.batch * p.tokens * p.kv_heads == 0) return true;
  using detail::pointer_set;
  return pointer_set(p.qkv, op, "qkv", reason) && pointer_set(p.keys, op, "keys", reason) &&
         pointer_set(p.values, op, "values", reason);
}

void kv_append(const ops::KvAppendParams& p) {
  if (std::string why; !supports_kv_append(p, &why)) fail_message(why);
  const int64_t rows = p.batch * p.tokens * p.kv_heads;
  if (rows == 0) return;
  const auto grid = static_cast<unsigned>(rows < 65536 ? rows : 65536);
  kv_append_kernel<<<grid, kThreads, 0, stream()>>>(p);
  FORGE_CUDA_CHECK_LAUNCH("kv_append");
}

}  // namespace forge::cuda
