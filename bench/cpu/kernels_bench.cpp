// Memory-bound kernels in GB/s (bytes each call must read and write at least once) and the fused linear
// cross-entropy in GFLOP/s, at a small LLaMA's training shape: 2048 tokens, hidden 512, ffn 1408,
// 8 heads of 64, vocabulary 8192.
#include <benchmark/benchmark.h>

#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "forge/kernels/rope_tables.h"

namespace forge {
namespace {

constexpr int64_t kRows = 2048, kDim = 512, kFfn = 1408, kHeadDim = 64, kVocab = 8192;

// Deterministic values in [start, start + scale).
std::vector<float> filled(int64_t n, float start, float scale = 1.0f) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = start + scale * static_cast<float>(i % 997) / 997.0f;
  return v;
}

void bytes_per_call(benchmark::State& state, double bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(bytes * static_cast<double>(state.iterations())));
}

struct RmsNormData {
  std::vector<float> x = filled(kRows * kDim, -0.5f), w = filled(kDim, 0.9f),
                     y = std::vector<float>(kRows * kDim), rstd = std::vector<float>(kRows),
                     dy = filled(kRows * kDim, -0.3f), dx = std::vector<float>(kRows * kDim),
                     dw = std::vector<float>(kDim);
  ops::RmsNormParams params() {
    ops::RmsNormParams p;
    p.rows = kRows, p.dim = kDim, p.x = x.data(), p.weight = w.data(), p.y = y.data(), p.rstd = rstd.data();
    p.dy = dy.data(), p.dx = dx.data(), p.dweight = dw.data();
    return p;
  }
};

void BM_RmsNormForward(benchmark::State& state) {
  RmsNormData d;
  auto p = d.params();
  for (auto _ : state) ops::rmsnorm_forward(p);
  bytes_per_call(state, 2.0 * kRows * kDim * sizeof(float));  // read x, write y
}

void BM_RmsNormBackwardInput(benchmark::State& state) {
  RmsNormData d;
  auto p = d.params();
  ops::rmsnorm_forward(p);
  for (auto _ : state) ops::rmsnorm_backward_input(p);
  bytes_per_call(state, 3.0 * kRows * kDim * sizeof(float));  // read x, dy, write dx
}

void BM_RmsNormBackwardWeight(benchmark::State& state) {
  RmsNormData d;
  auto p = d.params();
  ops::rmsnorm_forward(p);
  for (auto _ : state) ops::rmsnorm_backward_weight(p);
  bytes_per_call(state, 2.0 * kRows * kDim * sizeof(float));  // read x, dy
}

void BM_SwigluForward(benchmark::State& state) {
  auto gate_up = filled(kRows * 2 * kFfn, -4.0f, 8.0f);
  std::vector<float> out(kRows * kFfn);
  ops::SwigluParams p;
  p.rows = kRows, p.ffn = kFfn, p.gate_up = gate_up.data(), p.out = out.data();
  for (auto _ : state) ops::swiglu_forward(p);
  bytes_per_call(state, 3.0 * kRows * kFfn * sizeof(float));  // read gate, up, write out
}

void BM_SwigluBackward(benchmark::State& state) {
  auto gate_up = filled(kRows * 2 * kFfn, -4.0f, 8.0f), dout = filled(kRows * kFfn, 0.1f);
  std::vector<float> dgate_up(kRows * 2 * kFfn);
  ops::SwigluParams p;
  p.rows = kRows, p.ffn = kFfn, p.gate_up = gate_up.data(), p.dout = dout.data(),
  p.dgate_up = dgate_up.data();
  for (auto _ : state) ops::swiglu_backward(p);
  bytes_per_call(state, 5.0 * kRows * kFfn * sizeof(float));  // read gate, up, dout, write dgate, dup
}

// Hidden dropout at rate 0.1 over a micro-batch's [rows, dim] branch output, in place (as the decoder layer
// applies it); its Philox blocks are computed, not read.
void BM_Dropout(benchmark::State& state) {
  auto x = filled(kRows * kDim, -1.0f);
  ops::DropoutParams p;
  p.rows = kRows, p.cols = kDim, p.x = x.data(), p.y = x.data(), p.rate = 0.1f, p.seed = 1;
  p.first_sample = 0, p.seq = 256;
  for (auto _ : state) ops::dropout(p);
  bytes_per_call(state, 2.0 * kRows * kDim * sizeof(float));  // read and write x
}

// q (8 heads) rotated in place inside a fused qkv row with 2 kv heads, as the attention layer does it.
void BM_Rope(benchmark::State& state) {
  const int64_t heads = kDim / kHeadDim, token_stride = kDim + 2 * 2 * kHeadDim;
  auto qkv = filled(kRows * token_stride, -1.0f);
  std::vector<float> cos(kRows * kHeadDim / 2), sin(cos.size());
  rope_tables(kRows, kHeadDim, 10000.0, RopeScaling{}, cos.data(), sin.data());
  ops::RopeParams p;
  p.batch = 1, p.seq = kRows, p.heads = heads, p.head_dim = kHeadDim, p.token_stride = token_stride;
  p.x = qkv.data(), p.cos = cos.data(), p.sin = sin.data();
  for (auto _ : state) ops::rope(p);
  bytes_per_call(state, 2.0 * kRows * kDim * sizeof(float));  // read and write q
}

// Arguments: parameter count, bf16 shadow (0/1).
void BM_AdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  const bool shadow = state.range(1) != 0;
  auto param = filled(n, -0.2f), grad = filled(n, -0.01f), m = filled(n, 0.0f), v = filled(n, 0.0f);
  std::vector<uint16_t> param_bf16(shadow ? n : 0);
  ops::AdamWParams p;
  p.n = n, p.param = param.data(), p.grad = grad.data(), p.exp_avg = m.data(), p.exp_avg_sq = v.data();
  p.param_bf16 = shadow ? param_bf16.data() : nullptr;
  p.lr = 1e-4f, p.weight_decay = 0.1f;
  for (auto _ : state) {
    ops::adamw(p);
    ++p.step;
  }
  // read param, grad, m, v; write param, m, v (+ the bf16 shadow)
  bytes_per_call(state, 7.0 * n * sizeof(float) + (shadow ? 2.0 * n : 0.0));
}

// The loss head at kRows x kDim x kVocab: normalised hidden states and a freshly initialised head (std ~0.02)
// give logits of order one.
struct CrossEntropySetup {
  std::vector<float> hidden = filled(kRows * kDim, -1.0f, 2.0f),
                     weight = filled(kVocab * kDim, -0.035f, 0.07f);
  std::vector<uint16_t> hidden16, weight16;
  std::vector<int32_t> targets;
  std::vector<float> lse, loss, dhidden, dweight, workspace;
  ops::LinearCrossEntropyParams p;

  CrossEntropySetup(bool bf16, bool keep_logits)
      : hidden16(hidden.size()),
        weight16(weight.size()),
        targets(kRows),
        lse(kRows),
        loss(kRows),
        dhidden(kRows * kDim),
        dweight(kVocab * kDim) {
    convert_f32_to_bf16(hidden.data(), hidden16.data(), hidden.size());
    convert_f32_to_bf16(weight.data(), weight16.data(), weight.size());
    for (int64_t r = 0; r < kRows; ++r) targets[r] = static_cast<int32_t>((r * 31) % kVocab);
    p.rows = kRows, p.dim = kDim, p.vocab = kVocab, p.gemm_dtype = bf16 ? DType::bf16 : DType::f32;
    p.keep_logits = keep_logits;
    p.hidden_gemm = bf16 ? static_cast<const void*>(hidden16.data()) : hidden.data();
    p.weight_gemm = bf16 ? static_cast<const void*>(weight16.data()) : weight.data();
    p.targets = targets.data(), p.lse = lse.data(), p.loss = loss.data(), p.grad_scale = 1.0f / kRows;
    p.dhidden = dhidden.data(), p.dweight = dweight.data();
    workspace.resize(ops::linear_cross_entropy_workspace_floats(p));
    p.workspace = workspace.data();
  }
};

// Arguments: backward (0/1), bf16 (0/1). FLOPs count the GEMMs: forward one (logits), backward three
// (recomputed logits, dhidden, dweight), 2*rows*vocab*dim each.
void BM_LinearCrossEntropy(benchmark::State& state) {
  const bool backward = state.range(0) != 0, bf16 = state.range(1) != 0;
  CrossEntropySetup s(bf16, /*keep_logits=*/false);
  ops::linear_cross_entropy_forward(s.p);
  for (auto _ : state) {
    if (backward) {
      ops::linear_cross_entropy_backward(s.p);
    } else {
      ops::linear_cross_entropy_forward(s.p);
    }
  }
  const double flops = (backward ? 3.0 : 1.0) * 2.0 * kRows * kVocab * kDim;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(backward ? "backward" : "forward") + (bf16 ? " bf16" : " fp32"));
}

// A training step's loss head: forward then backward on the same workspace, with the logits kept between them
// (keep = 1: three GEMMs) or computed again in backward (keep = 0: four). GFLOP/s counts the three GEMMs a
// model step needs (2*rows*vocab*dim each), so the time saved shows as a higher rate.
void BM_LinearCrossEntropyStep(benchmark::State& state) {
  const bool keep = state.range(0) != 0, bf16 = state.range(1) != 0;
  CrossEntropySetup s(bf16, keep);
  for (auto _ : state) {
    ops::linear_cross_entropy_forward(s.p);
    ops::linear_cross_entropy_backward(s.p);
  }
  state.counters["GFLOP/s"] = benchmark::Counter(3.0 * 2.0 * kRows * kVocab * kDim * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(keep ? "logits kept" : "logits recomputed") + (bf16 ? " bf16" : " fp32"));
}

BENCHMARK(BM_RmsNormForward)->UseRealTime();
BENCHMARK(BM_RmsNormBackwardInput)->UseRealTime();
BENCHMARK(BM_RmsNormBackwardWeight)->UseRealTime();
BENCHMARK(BM_SwigluForward)->UseRealTime();
BENCHMARK(BM_SwigluBackward)->UseRealTime();
BENCHMARK(BM_Dropout)->UseRealTime();
BENCHMARK(BM_Rope)->UseRealTime();
BENCHMARK(BM_AdamW)->ArgNames({"n", "bf16_shadow"})->Args({1 << 22, 0})->Args({1 << 22, 1})->UseRealTime();
BENCHMARK(BM_LinearCrossEntropy)
    ->ArgNames({"backward", "bf16"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinearCrossEntropyStep)
    ->ArgNames({"keep", "bf16"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace forge
