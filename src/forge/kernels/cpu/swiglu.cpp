// Gated linear units on the fused gate|up projection output: out = act(g) * u.
// SwiGLU: silu(g) = g * sigmoid(g), d/dg silu(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
// GeGLU: the tanh GELU and its derivative as gelu.cpp computes them (gelu_math.h).
// fp32 or bf16 tensors (SwigluParams::dtype): bf16 elements are widened on load and rounded once on store.
#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"
#include "forge/kernels/cpu/gelu_math.h"
#include "forge/kernels/cpu/simd_exp.h"

namespace forge::cpu {
namespace {

// Below this many elements (a decoding step's few rows) a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 14;

bool supports(const ops::SwigluParams& p, const char* what, std::string* reason) {
  if (p.activation != ops::GluActivation::silu && p.activation != ops::GluActivation::gelu_tanh)
    return ops::refuse(reason, "{}: unknown activation {}", what, static_cast<int>(p.activation));
  if (p.dtype != DType::f32 && p.dtype != DType::bf16)
    return ops::refuse(reason, "{}: tensors must be fp32 or bf16, not {}", what, dtype_name(p.dtype));
  if (p.rows >= 0 && p.ffn > 0) return true;
  return ops::refuse(reason, "{}: bad shape rows={} ffn={}", what, p.rows, p.ffn);
}

// The row loops every gate shares: out = act(g, u) element by element (forward); grad(g, u, d, dg, du) writes
// the gate's and the up projection's gradients (backward). The element functions inline into the simd loops.
template <typename E, typename Act>
void glu_forward(const ops::SwigluParams& p, Act act) {
  using T = typename E::T;
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* gate = static_cast<const T*>(p.gate_up) + r * 2 * ffn;
    const T* up = gate + ffn;
    T* out = static_cast<T*>(p.out) + r * ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) E::store(out, j, act(E::load(gate, j), E::load(up, j)));
  }
}

// dgate_up may be gate_up (in place): each element's inputs are read before its gradients are written.
template <typename E, typename Grad>
void glu_backward(const ops::SwigluParams& p, Grad grad) {
  using T = typename E::T;
  const int64_t ffn = p.ffn;
#pragma omp parallel for schedule(static) if (p.rows * ffn > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* gate = static_cast<const T*>(p.gate_up) + r * 2 * ffn;
    const T* up = gate + ffn;
    const T* dout = static_cast<const T*>(p.dout) + r * ffn;
    T* dgate = static_cast<T*>(p.dgate_up) + r * 2 * ffn;
    T* dup = dgate + ffn;
#pragma omp simd
    for (int64_t j = 0; j < ffn; ++j) {
      float dg, du;
      grad(E::load(gate, j), E::load(up, j), E::load(dout, j), dg, du);
      E::store(dgate, j, dg);
      E::store(dup, j, du);
    }
  }
}

template <typename E>
void swiglu_forward_as(const ops::SwigluParams& p) {
  if (p.activation == ops::GluActivation::gelu_tanh)
    return glu_forward<E>(p, [](float g, float u) { return gelu_tanh(g) * u; });
  glu_forward<E>(p, [](float g, float u) {
    const float sigmoid = 1.0f / (1.0f + simd_exp(-g));
    return g * sigmoid * u;
  });
}

template <typename E>
void swiglu_backward_as(const ops::SwigluParams& p) {
  if (p.activation == ops::GluActivation::gelu_tanh)
    return glu_backward<E>(p, [](float g, float u, float d, float& dg, float& du) {
      dg = d * u * gelu_tanh_derivative(g);
      du = d * gelu_tanh(g);
    });
  glu_backward<E>(p, [](float g, float u, float d, float& dg, float& du) {
    const float sigmoid = 1.0f / (1.0f + simd_exp(-g));
    const float silu = g * sigmoid;
    dg = d * u * sigmoid * (1.0f + g * (1.0f - sigmoid));
    du = d * silu;
  });
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
  p.dtype == DType::bf16 ? swiglu_forward_as<Bf16>(p) : swiglu_forward_as<F32>(p);
}

void swiglu_backward(const ops::SwigluParams& p) {
  if (std::string why; !supports_swiglu_backward(p, &why)) fail("{}", why);
  p.dtype == DType::bf16 ? swiglu_backward_as<Bf16>(p) : swiglu_backward_as<F32>(p);
}

}  // namespace forge::cpu
