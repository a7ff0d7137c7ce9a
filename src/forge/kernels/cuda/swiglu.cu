// SwiGLU on the fused gate|up projection output, on device memory (see cpu/swiglu.cpp): per row, gate is
// columns [0, ffn) and up is [ffn, 2 ffn); out = silu(g) * u with silu(g) = g * sigmoid(g).
// Backward: d/dg silu(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))); dgate_up is overwritten.
// fp32 or bf16 tensors (SwigluParams::dtype): bf16 widened on load, rounded once on store with the CPU's
// integer recipe (float_to_bf16), so both backends write the same bits.
//
// The exponential is the CPU kernel's simd_exp (cpu/simd_exp.h) rather than CUDA's expf: the same
// polynomial, clamps and FMA pattern g++ gives the CPU loop, so the backends agree to the last bit in
// almost every element instead of differing by the two libraries' few-ulp errors.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

// sigmoid(g) = 1 / (1 + exp(-g)), with exp as simd_exp computes it: exp(x) = p * 2^k, and 1 + p * 2^k fused
// (g++ contracts the CPU kernel's 1.0f + simd_exp(-g) the same way). simd_exp returns 0 below x = -87
// (sigmoid exactly 1) and clamps x above 88 (sigmoid about 5.9e-39 instead of underflowing).
__device__ __forceinline__ float sigmoid_like_cpu(float g) {
  const detail::ExpParts e = detail::exp_parts_like_cpu(-g);
  return __fdiv_rn(1.0f, __fmaf_rn(e.underflow ? 0.0f : e.p, e.scale, 1.0f));
}

using detail::load_element;
using detail::store_element;

template <typename T>
__global__ void forward_kernel(const T* __restrict__ gate_up, int64_t rows, int64_t ffn, T* __restrict__ out) {
  const int64_t n = rows * ffn, stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t index = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; index < n; index += stride) {
    const int64_t r = index / ffn, j = index - r * ffn;
    const T* gate = gate_up + r * 2 * ffn;
    const float g = load_element(gate, j), u = load_element(gate, ffn + j);
    store_element(out, index, __fmul_rn(__fmul_rn(g, sigmoid_like_cpu(g)), u));
  }
}

// dgate_up may overwrite gate_up in place (as on the CPU): a thread reads its g and u before writing their
// gradients, and no other thread touches them.
template <typename T>
__global__ void backward_kernel(const T* gate_up, const T* __restrict__ dout, int64_t rows, int64_t ffn,
                                T* dgate_up) {
  const int64_t n = rows * ffn, stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t index = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; index < n; index += stride) {
    const int64_t r = index / ffn, j = index - r * ffn;
    const T* gate = gate_up + r * 2 * ffn;
    T* dgate = dgate_up + r * 2 * ffn;
    const float g = load_element(gate, j), u = load_element(gate, ffn + j), d = load_element(dout, index);
    const float sigmoid = sigmoid_like_cpu(g);
    const float silu = __fmul_rn(g, sigmoid);
    // d * u * sigmoid * (1 + g * (1 - sigmoid)), left to right, the last factor fused as in the CPU kernel.
    store_element(dgate, j,
          __fmul_rn(__fmul_rn(__fmul_rn(d, u), sigmoid), __fmaf_rn(g, __fsub_rn(1.0f, sigmoid), 1.0f)));
    store_element(dgate, ffn + j, __fmul_rn(d, silu));
  }
}

bool shape_ok(const ops::SwigluParams& p, const char* op, std::string* reason) {
  // GeGLU (Gemma) runs on the CPU only so far.
  if (p.activation != ops::GluActivation::silu)
    return detail::refuse(reason, op, "only the silu gate (SwiGLU) is implemented on CUDA; GeGLU runs on CPUs");
  if (p.dtype != DType::f32 && p.dtype != DType::bf16)
    return detail::refuse(reason, op, "tensors must be fp32 or bf16");
  if (p.rows >= 0 && p.ffn > 0) return true;
  return detail::refuse(reason, op, "bad shape rows=" + std::to_string(p.rows) + " ffn=" + std::to_string(p.ffn));
}

}  // namespace

bool supports_swiglu_forward(const ops::SwigluParams& p, std::string* reason) {
  constexpr const char* op = "swiglu_forward";
  if (!shape_ok(p, op, reason)) return false;
  return p.rows == 0 ||
         (detail::pointer_set(p.gate_up, op, "gate_up", reason) && detail::pointer_set(p.out, op, "out", reason));
}

bool supports_swiglu_backward(const ops::SwigluParams& p, std::string* reason) {
  constexpr const char* op = "swiglu_backward";
  if (!shape_ok(p, op, reason)) return false;
  return p.rows == 0 || (detail::pointer_set(p.gate_up, op, "gate_up", reason) &&
                         detail::pointer_set(p.dout, op, "dout", reason) &&
                         detail::pointer_set(p.dgate_up, op, "dgate_up", reason));
}

void swiglu_forward(const ops::SwigluParams& p) {
  if (std::string why; !supports_swiglu_forward(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  const unsigned blocks = detail::grid_blocks(p.rows * p.ffn, kThreads);
  if (p.dtype == DType::bf16)
    forward_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<const uint16_t*>(p.gate_up), p.rows, p.ffn,
                                                      static_cast<uint16_t*>(p.out));
  else
    forward_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<const float*>(p.gate_up), p.rows, p.ffn,
                                                      static_cast<float*>(p.out));
  FORGE_CUDA_CHECK_LAUNCH("swiglu_forward");
}

void swiglu_backward(const ops::SwigluParams& p) {
  if (std::string why; !supports_swiglu_backward(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  const unsigned blocks = detail::grid_blocks(p.rows * p.ffn, kThreads);
  if (p.dtype == DType::bf16)
    backward_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<const uint16_t*>(p.gate_up),
                                                       static_cast<const uint16_t*>(p.dout), p.rows, p.ffn,
                                                       static_cast<uint16_t*>(p.dgate_up));
  else
    backward_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<const float*>(p.gate_up),
                                                       static_cast<const float*>(p.dout), p.rows, p.ffn,
                                                       static_cast<float*>(p.dgate_up));
  FORGE_CUDA_CHECK_LAUNCH("swiglu_backward");
}

}  // namespace forge::cuda
