// Gated linear units on the fused gate|up projection output: out = act(g) * u.
// SwiGLU: silu(g) = g * sigmoid(g), d/dg silu(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
// GeGLU: the tanh GELU and its derivative as gelu.cpp computes them (gelu_math.h).
#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/gelu_math.h"
#include "forge/kernels/cpu/simd_exp.h"

namespace forge::cpu {
namespace {

// Below this many elements (a decoding step's few rows) a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 14;

bool supports(const ops::SwigluParams& p, const char* what, std::string* reason) {
  if (p.activation != ops::GluActivation::silu && p.activation != ops::GluActivation::gelu_tanh)
    return ops::refuse(reason, "{}: unknown activation {}", what, static_cast<int>(p.activation));
  if (p.rows >= 0 && p.ffn > 0) return true;
  return ops::refuse(reason, "{}: bad shape rows={} ffn={}", what, p.rows, p.ffn);
}

void geglu_forward(const ops::SwigluParams& p) {
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* gate = p.gate_up + r * 2 * ffn;
    const float* up = gate + ffn;
    float* out = p.out + r * ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) out[j] = gelu_tanh(gate[j]) * up[j];
  }
}

void geglu_backward(const ops::SwigluParams& p) {
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* gate = p.gate_up + r * 2 * ffn;
    const float* up = gate + ffn;
    const float* dout = p.dout + r * ffn;
    float* dgate = p.dgate_up + r * 2 * ffn;
    float* dup = dgate + ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) {
      const float g = gate[j], u = up[j], d = dout[j];
      dgate[j] = d * u * gelu_tanh_derivative(g);
      dup[j] = d * gelu_tanh(g);
    }
  }
}

}  // namespace

bool supports_swiglu_forward(const ops::SwigluParams& p, std::string* reason) {
  return supports(p, "swiglu_forward", reason);
}
bool supports_swiglu_backward(const ops::SwigluParams& p, std::string* reason) {
  return supports(p, "swiglu_backward", reason);
}

void swiglu_forward(const ops::SwigluParams& p) {
  if (std::string why; !supports_swiglu_forward(p, &why)) fail("{}", why);
  if (p.activation == ops::GluActivation::gelu_tanh) return geglu_forward(p);
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* gate = p.gate_up + r * 2 * ffn;
    const float* up = gate + ffn;
    float* out = p.out + r * ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) {
      const float g = gate[j];
      const float sigmoid = 1.0f / (1.0f + simd_exp(-g));
      out[j] = g * sigmoid * up[j];
    }
  }
}

void swiglu_backward(const ops::SwigluParams& p) {
  if (std::string why; !supports_swiglu_backward(p, &why)) fail("{}", why);
  if (p.activation == ops::GluActivation::gelu_tanh) return geglu_backward(p);
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* gate = p.gate_up + r * 2 * ffn;
    const float* up = gate + ffn;
    const float* dout = p.dout + r * ffn;
    float* dgate = p.dgate_up + r * 2 * ffn;
    float* dup = dgate + ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) {
      const float g = gate[j], u = up[j], d = dout[j];
      const float sigmoid = 1.0f / (1.0f + simd_exp(-g));
      const float silu = g * sigmoid;
      dgate[j] = d * u * sigmoid * (1.0f + g * (1.0f - sigmoid));
      dup[j] = d * silu;
    }
  }
}

}  // namespace forge::cpu
