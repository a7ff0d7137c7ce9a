#include "forge/train/peak.h"

#include <algorithm>
#include <chrono>

#include "forge/core/tensor.h"
#include "forge/kernels/ops.h"

namespace forge::train {

double measure_gemm_peak_gflops(DType dtype, int64_t size, int repetitions) {
  Tensor a = Tensor::zeros({size, size}, dtype), b = Tensor::zeros({size, size}, dtype);
  Tensor c = Tensor::zeros({size, size}, DType::f32);
  ops::GemmParams p;
  p.m = p.n = p.k = size;
  p.a = a.raw(), p.b = b.raw(), p.lda = p.ldb = p.ldc = size, p.trans_b = true;
  p.ab_dtype = dtype, p.c = c.f32();
  ops::gemm(p);  // warm-up: primitive creation, page faults
  double best = 1e30;
  for (int r = 0; r < repetitions; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    ops::gemm(p);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * static_cast<double>(size) * size * size / best / 1e9;
}

}  // namespace forge::train
