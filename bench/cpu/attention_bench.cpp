// Flash attention at the training shape (batch 4, seq 512, 8 heads, 4 kv heads, head_dim 64, causal),
// q/k/v strided inside a fused qkv buffer as in training. GFLOP/s count causal FLOPs only:
// forward 2 * 2 * B * H * T * T * Dh / 2 (QK^T and PV over the lower triangle), backward 2.5x that.
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "forge/kernels/ops.h"

namespace {

struct AttentionBuffers {
  int64_t batch, seq, heads, kv_heads, head_dim;
  std::vector<float> qkv, out, lse, dout, dqkv;
  forge::ops::AttentionParams params;

  AttentionBuffers(int64_t b, int64_t t, int64_t h, int64_t kv, int64_t d)
      : batch(b), seq(t), heads(h), kv_heads(kv), head_dim(d) {
    const int64_t width = (h + 2 * kv) * d, tokens = b * t;
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    qkv.resize(tokens * width);
    dout.resize(tokens * h * d);
    for (auto& x : qkv) x = dist(gen);
    for (auto& x : dout) x = dist(gen);
    out.resize(tokens * h * d);
    lse.resize(b * h * t);
    dqkv.resize(tokens * width);
    auto& p = params;
    p.batch = b, p.seq = t, p.heads = h, p.kv_heads = kv, p.head_dim = d;
    p.q = qkv.data(), p.k = qkv.data() + h * d, p.v = qkv.data() + (h + kv) * d;
    p.q_stride = p.k_stride = p.v_stride = width;
    p.out = out.data(), p.out_stride = h * d, p.lse = lse.data();
    p.scale = 1.0f / std::sqrt(float(d));
    p.causal = true;
    p.dout = dout.data(), p.dout_stride = h * d;
    p.dq = dqkv.data(), p.dk = dqkv.data() + h * d, p.dv = dqkv.data() + (h + kv) * d;
    p.dq_stride = p.dk_stride = p.dv_stride = width;
  }
  double forward_flops() const { return 2.0 * 2.0 * batch * heads * double(seq) * seq * head_dim / 2.0; }
};

void BM_AttentionForward(benchmark::State& state) {
  AttentionBuffers buffers(4, state.range(0), 8, 4, 64);
  for (auto _ : state) {
    forge::ops::attention_forward(buffers.params);
    benchmark::DoNotOptimize(buffers.out.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(buffers.forward_flops() * 1e-9 * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionForward)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AttentionBackward(benchmark::State& state) {
  AttentionBuffers buffers(4, state.range(0), 8, 4, 64);
  forge::ops::attention_forward(buffers.params);
  for (auto _ : state) {
    forge::ops::attention_backward(buffers.params);
    benchmark::DoNotOptimize(buffers.dqkv.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.5 * buffers.forward_flops() * 1e-9 * state.iterations(),
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionBackward)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
