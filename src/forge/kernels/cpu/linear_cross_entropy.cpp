// Output projection fused with softmax cross-entropy, chunked over the vocabulary so that the
// [rows, vocab] logits need not exist whole. Forward keeps a running max and sum of exponentials per row
// (online softmax) across chunks. Backward recomputes each chunk's logits (or, with keep_logits, finds them
// where forward left them), turns them into dlogits = (softmax - onehot) * grad_scale in place and feeds them
// to two GEMMs:
//   dhidden (+)= dlogits @ W[chunk]        (NN; the first chunk overwrites)
//   dweight[chunk] += dlogits^T @ hidden  (TN)
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/simd_exp.h"

namespace forge::cpu {
namespace {

int64_t chunk_width(const ops::LinearCrossEntropyParams& p) { return std::min(p.vocab_chunk, p.vocab); }
int64_t global_vocab(const ops::LinearCrossEntropyParams& p) {
  return p.global_vocab > 0 ? p.global_vocab : p.vocab_start + p.vocab;
}
// Columns of [first, first + width) (local) that are real tokens, not padding.
int64_t real_width(const ops::LinearCrossEntropyParams& p, int64_t first, int64_t width) {
  return std::clamp<int64_t>(global_vocab(p) - p.vocab_start - first, 0, width);
}

bool supports(const ops::LinearCrossEntropyParams& p, const char* what, std::string* reason) {
  using ops::refuse;
  if (p.rows < 0 || p.dim <= 0 || p.vocab <= 0 || p.vocab_chunk <= 0)
    return refuse(reason, "{}: bad shape rows={} dim={} vocab={} vocab_chunk={}", what, p.rows, p.dim,
                  p.vocab, p.vocab_chunk);
  if (p.gemm_dtype != DType::f32 && p.gemm_dtype != DType::bf16)
    return refuse(reason, "{}: gemm_dtype must be fp32 or bf16", what);
  if (p.workspace == nullptr) return refuse(reason, "{}: workspace is required", what);
  if (!(p.softcap >= 0.0f)) return refuse(reason, "{}: softcap {} must be >= 0", what, p.softcap);
  // A range may lie wholly in the padding (a tiny vocabulary split far): it then contributes nothing.
  if (p.vocab_start < 0) return refuse(reason, "{}: negative vocabulary start {}", what, p.vocab_start);
  return true;
}

// The parameters (the predicate), then the targets (data).
void check(const ops::LinearCrossEntropyParams& p, const char* what) {
  if (std::string why; !supports(p, what, &why)) fail("{}", why);
  for (int64_t r = 0; r < p.rows; ++r)
    if (p.targets[r] >= global_vocab(p))
      fail("{}: target {} at row {} is outside the vocabulary [0, {})", what, p.targets[r], r,
           global_vocab(p));
}

// Where chunk `first`'s logits go in the workspace.
float* chunk_area(const ops::LinearCrossEntropyParams& p, int64_t first) {
  return p.workspace + ops::linear_cross_entropy_chunk_offset(p, first);
}

// Element `offset` of a GEMM operand stored in gemm_dtype.
const void* element(const void* base, DType dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * static_cast<int64_t>(dtype_size(dtype));
}

// Soft-capping (p.softcap > 0): z = softcap * tanh(z / softcap) over a chunk's logits.
void cap_logits(const ops::LinearCrossEntropyParams& p, int64_t width, float* logits) {
  if (p.softcap <= 0.0f) return;
  const float cap = p.softcap, inverse = 1.0f / cap;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p.rows * width; ++i) logits[i] = cap * simd_tanh(logits[i] * inverse);
}

// logits[rows, width] = hidden @ W[first : first + width]^T, soft-capped when the head caps.
void chunk_logits(const ops::LinearCrossEntropyParams& p, int64_t first, int64_t width, float* logits) {
  ops::GemmParams g;
  g.m = p.rows, g.n = width, g.k = p.dim;
  g.a = p.hidden_gemm, g.lda = p.dim;
  g.b = element(p.weight_gemm, p.gemm_dtype, first * p.dim), g.ldb = p.dim, g.trans_b = true;
  g.ab_dtype = p.gemm_dtype;
  g.c = logits, g.ldc = width;
  cpu::gemm(g);
  cap_logits(p, width, logits);
}

}  // namespace

bool supports_linear_cross_entropy_forward(const ops::LinearCrossEntropyParams& p, std::string* reason) {
  return supports(p, "linear_cross_entropy_forward", reason);
}
bool supports_linear_cross_entropy_backward(const ops::LinearCrossEntropyParams& p, std::string* reason) {
  return supports(p, "linear_cross_entropy_backward", reason);
}

void linear_cross_entropy_forward(const ops::LinearCrossEntropyParams& p) {
  check(p, "linear_cross_entropy_forward");
  if (p.rows == 0) return;
  const int64_t chunk = chunk_width(p);
  std::vector<float> running_max(p.rows, -std::numeric_limits<float>::infinity());
  std::vector<float> running_sum(p.rows, 0.0f), target_logit(p.rows, 0.0f);
  for (int64_t first = 0; first < p.vocab; first += chunk) {
    const int64_t width = std::min(chunk, p.vocab - first), real = real_width(p, first, width);
    if (real == 0) break;  // padding from here on
    float* logits = chunk_area(p, first);
    chunk_logits(p, first, width, logits);
    const int64_t global_first = p.vocab_start + first;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* row = logits + r * width;
      float chunk_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : chunk_max)
      for (int64_t j = 0; j < real; ++j) chunk_max = std::max(chunk_max, row[j]);
      const float new_max = std::max(running_max[r], chunk_max);
      float sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < real; ++j) sum += simd_exp(row[j] - new_max);
      // Rescale what earlier chunks summed relative to their (smaller or equal) max.
      const float rescale = running_sum[r] == 0.0f ? 0.0f : std::exp(running_max[r] - new_max);
      running_sum[r] = running_sum[r] * rescale + sum;
      running_max[r] = new_max;
      const int32_t target = p.targets[r];
      if (target >= global_first && target < global_first + real)
        target_logit[r] = row[target - global_first];
    }
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    // A range of padding only (possible with tiny vocabularies split far) has lse = -inf: exp gives 0.
    p.lse[r] = running_sum[r] > 0 ? running_max[r] + std::log(running_sum[r])
                                  : -std::numeric_limits<float>::infinity();
    p.loss[r] = p.targets[r] < 0 ? 0.0f : p.lse[r] - target_logit[r];
    if (p.target_logit) p.target_logit[r] = target_logit[r];
    if (p.max_logit) p.max_logit[r] = running_max[r];  // -inf for a range of padding only
  }
}

void linear_cross_entropy_backward(const ops::LinearCrossEntropyParams& p) {
  check(p, "linear_cross_entropy_backward");
  if (p.rows == 0) return;
  const int64_t chunk = chunk_width(p);
  const bool bf16 = p.gemm_dtype == DType::bf16;
  // bf16 GEMMs need bf16 dlogits: they live after the fp32 logits in the workspace.
  uint16_t* dlogits_bf16 =
      reinterpret_cast<uint16_t*>(p.workspace + ops::linear_cross_entropy_logits_floats(p));
  for (int64_t first = 0; first < p.vocab; first += chunk) {
    const int64_t width = std::min(chunk, p.vocab - first), real = real_width(p, first, width);
    if (real == 0) {  // padding: no gradient, but dhidden must still be written when nothing was
      if (first == 0) std::fill(p.dhidden, p.dhidden + p.rows * p.dim, 0.0f);
      break;
    }
    float* dlogits = chunk_area(p, first);
    if (!p.keep_logits) chunk_logits(p, first, width, dlogits);
    const int64_t global_first = p.vocab_start + first;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      float* row = dlogits + r * width;
      const int32_t target = p.targets[r];
      if (target < 0) {
        std::fill(row, row + width, 0.0f);
        continue;
      }
      const float lse = p.lse[r], scale = p.grad_scale;
      const bool here = target >= global_first && target < global_first + real;
      if (p.softcap > 0.0f) {
        // d(capped)/d(logit) = 1 - tanh^2 = 1 - (capped / softcap)^2, applied to softmax - onehot.
        const float inverse = 1.0f / p.softcap;
        const float target_capped = here ? row[target - global_first] * inverse : 0.0f;
#pragma omp simd
        for (int64_t j = 0; j < real; ++j) {
          const float t = row[j] * inverse;
          const float d = simd_exp(row[j] - lse) * scale * (1.0f - t * t);
          row[j] = std::abs(d) < std::numeric_limits<float>::min() ? 0.0f : d;
        }
        if (here) row[target - global_first] -= scale * (1.0f - target_capped * target_capped);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < real; ++j) {
          // Flush what would be denormal: it changes nothing and would slow both GEMMs dramatically.
          const float d = simd_exp(row[j] - lse) * scale;
          row[j] = std::abs(d) < std::numeric_limits<float>::min() ? 0.0f : d;
        }
        if (here) row[target - global_first] -= scale;
      }
      std::fill(row + real, row + width, 0.0f);
    }
    const void* a = dlogits;
    if (bf16) {
      convert_f32_to_bf16(dlogits, dlogits_bf16, static_cast<size_t>(p.rows * width));
      a = dlogits_bf16;
    }
    ops::GemmParams input;
    input.m = p.rows, input.n = p.dim, input.k = width;
    input.a = a, input.lda = width;
    input.b = element(p.weight_gemm, p.gemm_dtype, first * p.dim), input.ldb = p.dim;
    input.ab_dtype = p.gemm_dtype;
    input.c = p.dhidden, input.ldc = p.dim;
    input.beta = first == 0 ? 0.0f : 1.0f;
    cpu::gemm(input);

    if (!p.dweight) continue;  // a frozen head
    ops::GemmParams weight;
    weight.m = width, weight.n = p.dim, weight.k = p.rows;
    weight.a = a, weight.lda = width, weight.trans_a = true;
    weight.b = p.hidden_gemm, weight.ldb = p.dim;
    weight.ab_dtype = p.gemm_dtype;
    weight.c = p.dweight + first * p.dim, weight.ldc = p.dim;
    weight.beta = 1.0f;
    cpu::gemm(weight);
  }
}

}  // namespace forge::cpu

namespace forge::ops {

namespace {
constexpr int64_t kChunkAlign = 64;  // floats: 256 bytes, the most a GEMM's output alignment is told
int64_t kept_chunk_floats(const LinearCrossEntropyParams& p) {
  return (p.rows * std::min(p.vocab_chunk, p.vocab) + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
}
}  // namespace

int64_t linear_cross_entropy_chunk_offset(const LinearCrossEntropyParams& p, int64_t first) {
  if (!p.keep_logits) return 0;
  const int64_t chunk = std::min(p.vocab_chunk, p.vocab);
  return (first + chunk - 1) / chunk * kept_chunk_floats(p);  // first = vocab: past the last block
}

int64_t linear_cross_entropy_logits_floats(const LinearCrossEntropyParams& p) {
  return p.keep_logits ? linear_cross_entropy_chunk_offset(p, p.vocab)
                       : p.rows * std::min(p.vocab_chunk, p.vocab);
}

int64_t linear_cross_entropy_workspace_floats(const LinearCrossEntropyParams& p) {
  const int64_t chunk = p.rows * std::min(p.vocab_chunk, p.vocab);
  const int64_t logits = linear_cross_entropy_logits_floats(p);
  // One chunk of bf16 dlogits takes half a float per element, rounded up.
  return p.gemm_dtype == DType::bf16 ? logits + (chunk + 1) / 2 : logits;
}

}  // namespace forge::ops
