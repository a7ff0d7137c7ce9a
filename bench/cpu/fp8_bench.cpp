// FP8 quantisation kernels in GB/s (bytes each call must read and write at least once: the fp32 input, the
// FP8 outputs, the block scales), next to a memcpy of the fp32 input in the same run as the memory-bound
// peer. Argument: the side n of an n x n fp32 matrix: 4096 (64 MiB, well beyond the caches, the number
// that matters) and 256 (cache-resident, for a quick check of the kernels' compute bound).
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "forge/fp8/quantize.h"

namespace forge::fp8 {
namespace {

struct Data {
  int64_t n;
  std::vector<float> x;
  std::vector<uint8_t> q, q_t;
  std::vector<float> scale_inv;
  explicit Data(int64_t side)
      : n(side), x(side * side), q(side * side), q_t(side * side), scale_inv(side * num_blocks(side)) {
    for (int64_t i = 0; i < side * side; ++i) x[i] = static_cast<float>(i % 1999 - 999) * 0.013f;
  }
  double elements() const { return static_cast<double>(n * n); }
};

void bytes_per_call(benchmark::State& state, double bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(bytes * static_cast<double>(state.iterations())));
}

void BM_Fp8Memcpy(benchmark::State& state) {
  Data d(state.range(0));
  std::vector<float> y(d.x.size());
  for (auto _ : state) {
    std::memcpy(y.data(), d.x.data(), d.x.size() * sizeof(float));
    benchmark::ClobberMemory();
  }
  bytes_per_call(state, 8 * d.elements());
}

void BM_Fp8QuantizeAmax(benchmark::State& state) {
  Data d(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(quantize(d.x.data(), d.n * d.n, 3.0f, DType::e4m3, d.q.data()));
  bytes_per_call(state, 5 * d.elements());
}

void BM_Fp8CastTransposeAmax(benchmark::State& state) {
  Data d(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(
        cast_transpose(d.x.data(), d.n, d.n, 3.0f, DType::e4m3, d.q.data(), d.q_t.data()));
  bytes_per_call(state, 6 * d.elements());
}

void BM_Fp8Quantize1x128(benchmark::State& state) {
  Data d(state.range(0));
  for (auto _ : state) {
    quantize_1x128(d.x.data(), d.n, d.n, DType::e4m3, true, d.q.data(), d.scale_inv.data());
    benchmark::ClobberMemory();
  }
  bytes_per_call(state, 5 * d.elements() + 4.0 * static_cast<double>(d.scale_inv.size()));
}

void BM_Fp8Quantize1x128Transposed(benchmark::State& state) {
  Data d(state.range(0));
  for (auto _ : state) {
    quantize_1x128_transposed(d.x.data(), d.n, d.n, DType::e4m3, true, d.q_t.data(), d.scale_inv.data());
    benchmark::ClobberMemory();
  }
  bytes_per_call(state, 5 * d.elements() + 4.0 * static_cast<double>(d.scale_inv.size()));
}

void BM_Fp8Quantize128x128(benchmark::State& state) {
  Data d(state.range(0));
  for (auto _ : state) {
    quantize_128x128(d.x.data(), d.n, d.n, DType::e4m3, true, d.q.data(), d.scale_inv.data());
    benchmark::ClobberMemory();
  }
  bytes_per_call(state, 5 * d.elements());
}

BENCHMARK(BM_Fp8Memcpy)->ArgName("n")->Arg(4096)->Arg(256)->UseRealTime();
BENCHMARK(BM_Fp8QuantizeAmax)->ArgName("n")->Arg(4096)->Arg(256)->UseRealTime();
BENCHMARK(BM_Fp8CastTransposeAmax)->ArgName("n")->Arg(4096)->Arg(256)->UseRealTime();
BENCHMARK(BM_Fp8Quantize1x128)->ArgName("n")->Arg(4096)->Arg(256)->UseRealTime();
BENCHMARK(BM_Fp8Quantize1x128Transposed)->ArgName("n")->Arg(4096)->Arg(256)->UseRealTime();

// What the block recipe's Linear does per activation and gradient: both tile layouts from one read of x.
void BM_Fp8Quantize1x128WithTranspose(benchmark::State& state) {
  Data d(state.range(0));
  std::vector<float> scale_inv_t(d.scale_inv.size());
  for (auto _ : state) {
    quantize_1x128_with_transpose(d.x.data(), d.n, d.n, DType::e4m3, true, d.q.data(), d.scale_inv.data(),
                                  d.q_t.data(), scale_inv_t.data());
    benchmark::ClobberMemory();
  }
  // Reads x (4 bytes), writes both codes (2 bytes) and both scale tensors.
  bytes_per_call(state, 6 * d.elements() + 8.0 * static_cast<double>(d.scale_inv.size()));
}
BENCHMARK(BM_Fp8Quantize1x128WithTranspose)->ArgName("n")->Arg(4096)->Arg(256)->UseRealTime();
BENCHMARK(BM_Fp8Quantize128x128)->ArgName("n")->Arg(4096)->Arg(256)->UseRealTime();

}  // namespace
}  // namespace forge::fp8
