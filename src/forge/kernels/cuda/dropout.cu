// Dropout on device memory (see cpu/dropout.cpp): one thread per four columns of a row, the mask drawn from
// kernels/dropout_mask.h, the functions the CPU kernel calls, so both backends drop the same elements and
// write the same bits (the kept values scaled by 1 / (1 - rate) in one IEEE multiply).
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"
#include "forge/kernels/dropout_mask.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void dropout_kernel(const T* x, T* y, ops::DropoutParams p, float scale) {
  const int64_t quads = (p.cols + 3) / 4, n = p.rows * quads, stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t index = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; index < n; index += stride) {
    const int64_t r = index / quads, q = index - r * quads;
    const int64_t local = p.row_begin + r, at = local % p.seq;
    const int64_t position = p.positions ? p.positions[at] : at;
    const philox::Words words = ops::dropout_words(p.seed, p.stream, p.first_sample + local / p.seq, position, q);
    for (int k = 0; k < 4 && 4 * q + k < p.cols; ++k) {
      const int64_t i = r * p.cols + 4 * q + k;
      detail::store_element(y, i, ops::dropout_keeps(words.v[k], p.rate) ? __fmul_rn(detail::load_element(x, i), scale)
                                                                         : 0.0f);
    }
  }
}

}  // namespace

bool supports_dropout(const ops::DropoutParams& p, std::string* reason) {
  constexpr const char* op = "dropout";
  if (p.dtype != DType::f32 && p.dtype != DType::bf16) return detail::refuse(reason, op, "tensors must be fp32 or bf16");
  if (!(p.rate >= 0.0f && p.rate < 1.0f)) return detail::refuse(reason, op, "rate must be in [0, 1)");
  if (p.rows < 0 || p.cols <= 0 || p.seq <= 0 || p.row_begin < 0 || p.first_sample < 0)
    return detail::refuse(reason, op,
                          "bad shape rows=" + std::to_string(p.rows) + " cols=" + std::to_string(p.cols) +
                              " seq=" + std::to_string(p.seq) + " row_begin=" + std::to_string(p.row_begin) +
                              " first_sample=" + std::to_string(p.first_sample));
  return p.rows == 0 || (detail::pointer_set(p.x, op, "x", reason) && detail::pointer_set(p.y, op, "y", reason));
}

void dropout(const ops::DropoutParams& p) {
  if (std::string why; !supports_dropout(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  const float scale = 1.0f / (1.0f - p.rate);
  const unsigned blocks = detail::grid_blocks(p.rows * ((p.cols + 3) / 4), kThreads);
  if (p.dtype == DType::bf16)
    dropout_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<const uint16_t*>(p.x), static_cast<uint16_t*>(p.y),
                                                      p, scale);
  else
    dropout_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<const float*>(p.x), static_cast<float*>(p.y), p,
                                                      scale);
  FORGE_CUDA_CHECK_LAUNCH("dropout");
}

}  // namespace forge::cuda
