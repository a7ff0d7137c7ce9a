// m_grouped_gemm / k_grouped_gemm on the GPU (ops.h, GroupedGemmParams): a host loop over the groups (the
// offsets are host memory), each non-empty group one cuBLASLt matmul through cuda::gemm (gemm_cublaslt.cpp)
// on its contiguous segment, queued on stream() one after another. Empty groups launch nothing, except under
// k_grouped with beta != 1, where C_g = beta * C_g: a small kernel (zeros for beta = 0, never reading C).
//
// Each distinct group size is a shape of its own to cuda::gemm, which makes and caches a plan for it (one
// heuristic query per new size). A DeepGEMM-style kernel that takes the offsets on the device would launch
// once; this is the simple, obviously correct first version.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

// C [m, n] (leading dimension ldc) = beta * C in fp32; a bf16 C widened and rounded to nearest even once (NaN
// stays a quiet NaN, as core/dtype.h). beta = 0 writes zeros without reading.
__global__ void scale_matrix_kernel(void* c, bool bf16, int64_t m, int64_t n, int64_t ldc, float beta) {
  const int64_t total = m * n, stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t index = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; index < total; index += stride) {
    const int64_t i = index / n, j = index - i * n;
    if (!bf16) {
      float* x = static_cast<float*>(c) + i * ldc + j;
      *x = beta == 0.0f ? 0.0f : __fmul_rn(*x, beta);
      continue;
    }
    uint16_t* x = static_cast<uint16_t*>(c) + i * ldc + j;
    if (beta == 0.0f) {
      *x = 0;
      continue;
    }
    const uint32_t bits = __float_as_uint(__fmul_rn(__uint_as_float(static_cast<uint32_t>(*x) << 16), beta));
    *x = (bits & 0x7fffffffu) > 0x7f800000u
             ? static_cast<uint16_t>((bits >> 16) | 0x40u)
             : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

// The shared rules (ops::supports_grouped_gemm), then what cuBLASLt needs of C: element-aligned.
bool supports(const char* op, bool k_grouped, const ops::GroupedGemmParams& p, std::string* reason) {
  if (!ops::supports_grouped_gemm(op, k_grouped, p, reason)) return false;
  const size_t esize = p.c_dtype == DType::bf16 ? 2 : 4;
  if (reinterpret_cast<uintptr_t>(p.c) % esize != 0)
    return detail::refuse(reason, op, "c is not aligned to its " + std::to_string(esize) + "-byte elements");
  return true;
}

}  // namespace

bool supports_m_grouped_gemm(const ops::GroupedGemmParams& p, std::string* reason) {
  return supports("m_grouped_gemm", false, p, reason);
}
bool supports_k_grouped_gemm(const ops::GroupedGemmParams& p, std::string* reason) {
  return supports("k_grouped_gemm", true, p, reason);
}

void m_grouped_gemm(const ops::GroupedGemmParams& p) {
  if (std::string why; !supports_m_grouped_gemm(p, &why)) fail_message(why);
  ops::check_grouped_gemm_offsets("m_grouped_gemm", false, p);
  for (int64_t g = 0; g < p.groups; ++g)
    if (p.offsets[g + 1] > p.offsets[g]) cuda::gemm(ops::m_grouped_gemm_group(p, g));
}

void k_grouped_gemm(const ops::GroupedGemmParams& p) {
  if (std::string why; !supports_k_grouped_gemm(p, &why)) fail_message(why);
  ops::check_grouped_gemm_offsets("k_grouped_gemm", true, p);
  for (int64_t g = 0; g < p.groups; ++g) {
    const ops::GemmParams q = ops::k_grouped_gemm_group(p, g);
    if (q.k > 0) {
      cuda::gemm(q);
    } else if (p.beta != 1.0f) {
      scale_matrix_kernel<<<detail::grid_blocks(p.m * p.n, kThreads), kThreads, 0, stream()>>>(
          q.c, p.c_dtype == DType::bf16, p.m, p.n, p.ldc, p.beta);
      FORGE_CUDA_CHECK_LAUNCH("k_grouped_gemm");
    }
  }
}

}  // namespace forge::cuda
