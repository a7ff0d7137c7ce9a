// oneDNN GEMM throughput at the shapes a small LLaMA trains with (hidden 512, ffn 1408, 2048 tokens per
// micro-batch) in the three training layouts, plus a large square GEMM that approximates the machine's
// peak. Reported as GFLOP/s (2*M*N*K per call) over wall time, since oneDNN runs multi-threaded.
#include <benchmark/benchmark.h>

#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"

namespace forge {
namespace {

enum Layout : int64_t { nt, nn, tn };

// Arguments: M, N, K, layout, dtype (0 = fp32, 1 = bf16).
void BM_Gemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const auto layout = static_cast<Layout>(state.range(3));
  const DType dtype = state.range(4) ? DType::bf16 : DType::f32;
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k, p.ab_dtype = dtype;
  p.trans_a = layout == tn, p.trans_b = layout == nt;
  p.lda = p.trans_a ? m : k;
  p.ldb = p.trans_b ? k : n;
  p.ldc = n;
  p.beta = layout == tn ? 1.0f : 0.0f;  // weight gradients accumulate
  std::vector<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n, 0.0f);
  std::vector<uint16_t> a16(a.size(), f32_to_bf16_bits(0.5f)), b16(b.size(), f32_to_bf16_bits(0.25f));
  p.a = dtype == DType::bf16 ? static_cast<const void*>(a16.data()) : a.data();
  p.b = dtype == DType::bf16 ? static_cast<const void*>(b16.data()) : b.data();
  p.c = c.data();
  ops::gemm(p);  // primitive creation is cached: keep it out of the timing
  for (auto _ : state) {
    ops::gemm(p);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * m * n * k * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  static const char* kLayoutNames[] = {"nt", "nn", "tn"};
  state.SetLabel(std::string(kLayoutNames[layout]) + (dtype == DType::bf16 ? " bf16" : " fp32"));
}

void training_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"M", "N", "K", "layout", "bf16"});
  for (int64_t bf16 : {0, 1}) {
    b->Args({2048, 1536, 512, nt, bf16});  // forward, fused qkv / gate_up projection
    b->Args({2048, 512, 1408, nn, bf16});  // backward_input through the down projection
    b->Args({1536, 512, 2048, tn, bf16});  // weight gradient of the qkv / gate_up projection
    b->Args({512, 1408, 2048, tn, bf16});  // weight gradient of the down projection
    b->Args({2048, 8192, 512, nt, bf16});  // output projection (logits) at vocab 8192
  }
}

void peak_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"M", "N", "K", "layout", "bf16"});
  b->Args({4096, 4096, 4096, nn, 0});
  b->Args({4096, 4096, 4096, nn, 1});
}

BENCHMARK(BM_Gemm)->Apply(training_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gemm)->Name("BM_GemmPeak")->Apply(peak_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace forge
