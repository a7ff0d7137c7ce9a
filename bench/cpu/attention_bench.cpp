// Flash attention at the training shape (batch 4, seq 512, 8 heads, 4 kv heads, head_dim 64, causal), with
// q/k/v strided inside one fused qkv tensor and dq/dk/dv inside one fused dqkv tensor, as in training.
// GFLOP/s count causal FLOPs only: forward 2 * 2 * B * H * T * T * Dh / 2 (QK^T and PV over the lower
// triangle), backward 2.5x that. The peer in the same run is a square fp32 oneDNN GEMM (the machine's
// practical peak on the same threads).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "forge/core/tensor.h"
#include "forge/kernels/ops.h"

namespace forge {
namespace {

struct AttentionBuffers {
  int64_t batch, seq, heads, kv_heads, head_dim;
  Tensor qkv, out, lse, dout, dqkv;  // forge's allocator: 64-byte aligned like every activation
  ops::AttentionParams params;

  AttentionBuffers(int64_t b, int64_t t, int64_t h, int64_t kv, int64_t d)
      : batch(b), seq(t), heads(h), kv_heads(kv), head_dim(d) {
    const int64_t width = (h + 2 * kv) * d, tokens = b * t;
    qkv = Tensor::empty({tokens, width}, DType::f32);
    dout = Tensor::empty({tokens, h * d}, DType::f32);
    out = Tensor::zeros({tokens, h * d}, DType::f32);
    lse = Tensor::zeros({b, h, t}, DType::f32);
    dqkv = Tensor::zeros({tokens, width}, DType::f32);
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (int64_t i = 0; i < qkv.numel(); ++i) qkv.f32()[i] = dist(gen);
    for (int64_t i = 0; i < dout.numel(); ++i) dout.f32()[i] = dist(gen);
    auto& p = params;
    p.batch = b, p.seq = t, p.heads = h, p.kv_heads = kv, p.head_dim = d;
    p.q = qkv.f32(), p.k = qkv.f32() + h * d, p.v = qkv.f32() + (h + kv) * d;
    p.q_stride = p.k_stride = p.v_stride = width;
    p.out = out.f32(), p.out_stride = h * d, p.lse = lse.f32();
    p.scale = 1.0f / std::sqrt(float(d));
    p.causal = true;
    p.dout = dout.f32(), p.dout_stride = h * d;
    p.dq = dqkv.f32(), p.dk = dqkv.f32() + h * d, p.dv = dqkv.f32() + (h + kv) * d;
    p.dq_stride = p.dk_stride = p.dv_stride = width;
  }
  double forward_flops() const { return 2.0 * 2.0 * batch * heads * double(seq) * seq * head_dim / 2.0; }
};

void BM_AttentionForward(benchmark::State& state) {
  AttentionBuffers buffers(4, state.range(0), 8, 4, 64);
  for (auto _ : state) {
    ops::attention_forward(buffers.params);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(buffers.forward_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionForward)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AttentionBackward(benchmark::State& state) {
  AttentionBuffers buffers(4, state.range(0), 8, 4, 64);
  ops::attention_forward(buffers.params);
  for (auto _ : state) {
    ops::attention_backward(buffers.params);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.5 * buffers.forward_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionBackward)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();

// Packed documents (document masks), as nn::Attention runs them: each sequence of seq tokens holds documents
// of range(1) tokens, and the kernel runs once per document over its own keys. The peer is the unmasked
// kernel over the same total length (BM_AttentionForward / BM_AttentionBackward at that seq): with documents
// of length L the work falls to L / seq of it.
void run_documents(AttentionBuffers& buffers, int64_t length, bool backward) {
  const ops::AttentionParams& whole = buffers.params;
  const int64_t h = buffers.heads, qd = h * buffers.head_dim;
  for (int64_t b = 0; b < buffers.batch; ++b)
    for (int64_t t = 0; t < buffers.seq; t += length) {
      const int64_t row = b * buffers.seq + t, n = std::min(length, buffers.seq - t);
      ops::AttentionParams p = whole;
      p.batch = 1, p.seq = n;
      p.q = whole.q + row * whole.q_stride, p.k = whole.k + row * whole.k_stride,
      p.v = whole.v + row * whole.v_stride;
      p.out = whole.out + row * qd, p.lse = whole.lse + row * h;
      p.dout = whole.dout + row * qd;
      p.dq = whole.dq + row * whole.dq_stride, p.dk = whole.dk + row * whole.dk_stride;
      p.dv = whole.dv + row * whole.dv_stride;
      if (backward)
        ops::attention_backward(p);
      else
        ops::attention_forward(p);
    }
}

void BM_AttentionDocumentsForward(benchmark::State& state) {
  AttentionBuffers buffers(4, state.range(0), 8, 4, 64);
  for (auto _ : state) {
    run_documents(buffers, state.range(1), false);
    benchmark::ClobberMemory();
  }
  state.counters["documents"] = static_cast<double>(4 * state.range(0) / state.range(1));
}
BENCHMARK(BM_AttentionDocumentsForward)->Args({2048, 256})->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AttentionDocumentsBackward(benchmark::State& state) {
  AttentionBuffers buffers(4, state.range(0), 8, 4, 64);
  run_documents(buffers, state.range(1), false);
  for (auto _ : state) {
    run_documents(buffers, state.range(1), true);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_AttentionDocumentsBackward)->Args({2048, 256})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AttentionForward)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AttentionBackward)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

// Peer: C = A B, fp32, 1024^3 (about the forward's FLOP count, 2x).
void BM_AttentionPeerGemm(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor a = Tensor::zeros({n, n}, DType::f32), b = Tensor::zeros({n, n}, DType::f32),
         c = Tensor::zeros({n, n}, DType::f32);
  ops::GemmParams p;
  p.m = p.n = p.k = n;
  p.a = a.f32(), p.b = b.f32(), p.c = c.f32();
  p.lda = p.ldb = p.ldc = n;
  ops::gemm(p);  // primitive creation is cached: keep it out of the timing
  for (auto _ : state) {
    ops::gemm(p);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * n * n * n * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionPeerGemm)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace forge
