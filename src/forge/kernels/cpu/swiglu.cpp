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

// The row loops every gate shares: out = act(g, u) element by element (forward); grad(g, u, d, dg, du) writes
// the gate's and the up projection's gradients (backward). The element functions inline into the simd loops.
template <typename Act>
void glu_forward(const ops::SwigluParams& p, Act act) {
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* gate = p.gate_up + r * 2 * ffn;
    const float* up = gate + ffn;
    float* out = p.out + r * ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) out[j] = act(gate[j], up[j]);
  }
}

template <typename Grad>
void glu_backward(const ops::SwigluParams& p, Grad grad) {
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* gate = p.gate_up + r * 2 * ffn;
    const float* up = gate + ffn;
    const float* dout = p.dout + r * ffn;
    float* dgate = p.dgate_up + r * 2 * ffn;
    float* dup = dgate + ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) grad(gate[j], up[j], dout[j], dgate[j], dup[j]);
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
  if (p.activation == ops::GluActivation::gelu_tanh)
    return glu_forward(p, [](float g, float u) { return gelu_tanh(g) * u; });
  glu_forward(p, [](float g, float u) {
    const float sigmoid = 1.0f / (1.0f + simd_exp(-g));
    return g * sigmoid * u;
  });
}

void swiglu_backward(const ops::SwigluParams& p) {
  if (std::string why; !supports_swiglu_backward(p, &why)) fail("{}", why);
  if (p.activation == ops::GluActivation::gelu_tanh)
    return glu_backward(p, [](float g, float u, float d, float& dg, float& du) {
      dg = d * u * gelu_tanh_derivative(g);
      du = d * gelu_tanh(g);
    });
  glu_backward(p, [](float g, float u, float d, float& dg, float& du) {
    const float sigmoid = 1.0f / (1.0f + simd_exp(-g));
    const float silu = g * sigmoid;
    dg = d * u * sigmoid * (1.0f + g * (1.0f - sigmoid));
    du = d * silu;
  });
}

}  // namespace forge::cpu
