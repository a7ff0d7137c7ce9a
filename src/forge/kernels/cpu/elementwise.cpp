// Element-wise helpers for the optimizer and gradient handling. sum_squares accumulates in double over
// fixed-size blocks and adds the block sums in order, so the gradient norm is the same bitwise whatever
// the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"
#include "forge/kernels/cpu/simd_exp.h"

namespace forge::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelThreshold = 1 << 15;
constexpr int64_t kSumBlock = 1 << 14;

}  // namespace

// The element-wise ops take any size (n <= 0 does nothing) and dereference only what n covers.
bool supports_add_inplace(Elements, ConstElements, int64_t, std::string*) { return true; }
bool supports_scale_inplace(float*, float, int64_t, std::string*) { return true; }
bool supports_softcap_inplace(float*, float cap, int64_t, std::string* reason) {
  return cap > 0.0f || ops::refuse(reason, "softcap_inplace: cap {} must be positive", cap);
}
bool supports_sum_squares(const float*, int64_t, std::string*) { return true; }
bool supports_sum_squares_accumulate(const float*, int64_t, double* total, std::string* reason) {
  return total != nullptr || ops::refuse(reason, "sum_squares_accumulate: total is null");
}

void add_inplace(Elements y, ConstElements x, int64_t n) {
  visit(y, [&](auto* out) {
    visit(x, [&](const auto* in) {
#pragma omp parallel for simd schedule(static) if (n > kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) store_float(out, i, load_float(out, i) + load_float(in, i));
    });
  });
}

void scale_inplace(float* x, float s, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelThreshold)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void softcap_inplace(float* x, float cap, int64_t n) {
  if (std::string why; !supports_softcap_inplace(x, cap, n, &why)) fail("{}", why);
  const float inverse = 1.0f / cap;
#pragma omp parallel for schedule(static) if (n > kParallelThreshold)
  for (int64_t i = 0; i < n; ++i) x[i] = cap * simd_tanh(x[i] * inverse);
}

double sum_squares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t blocks = (n + kSumBlock - 1) / kSumBlock;
  std::vector<double> partial(blocks);
#pragma omp parallel for schedule(static) if (n > kParallelThreshold)
  for (int64_t b = 0; b < blocks; ++b) {
    const float* block = x + b * kSumBlock;
    const int64_t size = std::min(kSumBlock, n - b * kSumBlock);
    double sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < size; ++i) sum += double{block[i]} * block[i];
    partial[b] = sum;
  }
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

void sum_squares_accumulate(const float* x, int64_t n, double* total) {
  if (std::string why; !supports_sum_squares_accumulate(x, n, total, &why)) fail("{}", why);
  *total += sum_squares(x, n);
}

}  // namespace forge::cpu
