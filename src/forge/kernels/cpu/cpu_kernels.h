// Declarations of the CPU backend's kernels (one file each in this folder); cpu_table.cpp gathers them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "forge/kernels/support.h"

namespace forge::cpu {

// Every op of the list (op_list.h): the kernel and its support predicate, which the kernel runs first.
// Conversions and FP8 casts (fp8_cast.cpp) are thin entries over core/dtype.h and fp8/quantize.h, where the
// CPU implementations live because the FP8 layer and its tests use them directly; kv_append is in
// attention_decode.cpp; attention_merge and strided_copy (context parallelism) in context_ops.cpp. Mixture of
// experts: moe_sort.cpp, moe_permute.cpp (permutes and unpermutes), grouped_gemm.cpp.
FORGE_OPS(FORGE_OP_DECLARE_KERNEL)

// The CPU GEMM keeps the compiled oneDNN kernels of its kGemmCacheSize most recently used shapes
// (gemm_onednn.cpp); how many it holds now.
constexpr int64_t kGemmCacheSize = 512;
int64_t gemm_cache_entries();

// A GEMM with a bf16 C (gemm, fp8_gemm): run(q) is the fp32-output kernel, given params q whose C is fp32
// scratch with C's leading dimension (holding the old C widened when beta != 0); each row's cols are then
// rounded into C once, its padding left alone. So a bf16 C is the fp32 result rounded, bitwise.
template <typename Params, typename Run>
void gemm_through_fp32_output(const Params& p, Run run) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>((p.m - 1) * p.ldc + p.n));
  // A plain pointer for the parallel loops: in another thread the thread_local names that thread's buffer.
  float* scratch = buffer.data();
  auto* c = static_cast<uint16_t*>(p.c);
  const bool parallel = p.m * p.n > 16384;
  if (p.beta != 0.0f) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < p.m; ++r)
      convert_bf16_to_f32(c + r * p.ldc, scratch + r * p.ldc, static_cast<size_t>(p.n));
  }
  Params q = p;
  q.c_dtype = DType::f32;
  q.c = scratch;
  run(q);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < p.m; ++r)
    convert_f32_to_bf16(scratch + r * p.ldc, c + r * p.ldc, static_cast<size_t>(p.n));
}

// The deterministic column sums of the norms' and biases' weight gradients: out[j] += the sum over blocks b
// of partial[b * n + j], blocks added in block order for every column, whatever the thread count. Called
// inside a parallel region (an orphaned `omp for`: the column tiles are shared among its threads).
inline void add_block_partials(const float* partial, int64_t blocks, int64_t n, float* out) {
  constexpr int64_t kTile = 64;
#pragma omp for schedule(static)
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t width = std::min(kTile, n - j0);
    float sum[kTile] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float* part = partial + b * n + j0;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) sum[j] += part[j];
    }
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) out[j0 + j] += sum[j];
  }
}

// attention_forward's kernel for a few queries against a longer key/value cache (attention_decode.cpp);
// expects checked parameters with their defaults filled in.
void attention_forward_decode(const ops::AttentionParams& p);

}  // namespace forge::cpu
