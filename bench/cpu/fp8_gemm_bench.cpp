// Cost of the emulated FP8 GEMM against the bf16 GEMM it is built on, same shape, same run: the ratio of
// their GFLOP/s is the emulation's overhead (widening the codes, one GEMM per K-block and a scaling pass per
// block for block scaling, 32-wide slices plus a truncation pass each for the limited accumulator). Layout nt
// (y = x @ W^T), 2*M*N*K FLOP per call over wall time.
#include <benchmark/benchmark.h>

#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"

namespace forge {
namespace {

constexpr int64_t kSize = 1024;

void set_flops(benchmark::State& state, int64_t m, int64_t n, int64_t k) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * m * n * k * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Bf16GemmBaseline(benchmark::State& state) {
  const int64_t m = kSize, n = kSize, k = kSize;
  std::vector<uint16_t> a(m * k, f32_to_bf16_bits(0.5f)), b(n * k, f32_to_bf16_bits(0.25f));
  std::vector<float> c(m * n);
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k, p.ab_dtype = DType::bf16;
  p.a = a.data(), p.lda = k;
  p.b = b.data(), p.ldb = k, p.trans_b = true;
  p.c = c.data(), p.ldc = n;
  ops::gemm(p);  // primitive creation is cached: keep it out of the timing
  for (auto _ : state) {
    ops::gemm(p);
    benchmark::ClobberMemory();
  }
  set_flops(state, m, n, k);
}

// Arguments: block scaling (0 = per tensor), accumulator_bits (0 = exact fp32).
void BM_Fp8GemmEmulated(benchmark::State& state) {
  const int64_t m = kSize, n = kSize, k = kSize, k_blocks = kSize / ops::kFp8BlockSize;
  std::vector<uint8_t> a(m * k, f32_to_e4m3(0.5f)), b(n * k, f32_to_e4m3(0.25f));
  std::vector<float> c(m * n), a_scales(m * k_blocks, 1.0f), b_scales(k_blocks * k_blocks, 1.0f);
  ops::Fp8GemmParams p;
  p.m = m, p.n = n, p.k = k;
  p.a = a.data(), p.lda = k;
  p.b = b.data(), p.ldb = k, p.trans_b = true;
  p.c = c.data(), p.ldc = n;
  if (state.range(0)) {
    p.scaling = ops::Fp8Scaling::block;
    p.a_scales = a_scales.data(), p.b_scales = b_scales.data();
  } else {
    p.a_scale_inv = 0.5f, p.b_scale_inv = 0.25f;
  }
  p.accumulator_bits = static_cast<int>(state.range(1));
  ops::fp8_gemm(p);
  for (auto _ : state) {
    ops::fp8_gemm(p);
    benchmark::ClobberMemory();
  }
  set_flops(state, m, n, k);
  state.SetLabel(std::string(state.range(0) ? "block 1x128 x 128x128" : "per-tensor") +
                 (p.accumulator_bits ? " acc14" : ""));
}

BENCHMARK(BM_Bf16GemmBaseline)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Fp8GemmEmulated)
    ->ArgNames({"block", "acc_bits"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({1, 14})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace forge
