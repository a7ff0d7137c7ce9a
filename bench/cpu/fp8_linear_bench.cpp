// One Linear's training step — forward, input gradient, weight gradient — per precision, on the CPU: bf16
// (the peer, in the same run) and each FP8 recipe, whose time includes every cast the recipe makes
// (inputs and output gradients in both layouts, amaxes) on top of the emulated FP8 GEMMs; the weight cast
// happens once per optimizer step and is outside the loop, as in training. Reported as the model FLOP
// rate of the three GEMMs (6 x tokens x in x out per step). Shape: 2048 tokens, 1024 -> 1024.
#include <benchmark/benchmark.h>

#include <optional>
#include <vector>

#include "forge/nn/fp8_context.h"
#include "forge/nn/linear.h"

namespace forge::nn {
namespace {

constexpr int64_t kTokens = 2048, kIn = 1024, kOut = 1024;

// Argument: 0 = bf16, 1 = delayed, 2 = current, 3 = block.
void BM_LinearTrainingStep(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0));
  std::optional<Fp8Context> context;
  ComputeOptions options;
  options.gemm_dtype = DType::bf16;
  if (which > 0) {
    Fp8Options f;
    f.recipe.recipe = which == 1 ? fp8::Recipe::delayed : which == 2 ? fp8::Recipe::current : fp8::Recipe::block;
    f.recipe.format = which == 3 ? fp8::Format::e4m3 : fp8::Format::hybrid;
    context.emplace(f);
    options.fp8 = &*context;
  }
  ParameterStore store;
  store.add("w", {kOut, kIn}, true, Init::normal);
  store.allocate(true);
  store.initialize(1);
  Linear linear(&store, {0}, kIn, options);
  if (context) context->seal();
  Tensor x = Tensor::empty({kTokens, kIn}, DType::f32), dy = Tensor::empty({kTokens, kOut}, DType::f32);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = static_cast<float>(i % 1999 - 999) * 1e-3f;
  for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = static_cast<float>(i % 997 - 498) * 1e-7f;
  const Fp8Recording recording(options.fp8, true);
  for (auto _ : state) {
    GemmOperand xo = linear.input(x);
    Tensor y = linear.forward(xo);
    GemmOperand dyo = linear.grad_output(dy);
    Tensor dx = linear.backward_input(dyo);
    linear.backward_weight(dyo, xo);
    benchmark::DoNotOptimize(dx.raw());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(6.0 * kTokens * kIn * kOut * 1e-9 * static_cast<double>(state.iterations()),
                                                 benchmark::Counter::kIsRate);
  state.SetLabel(which == 0 ? "bf16" : which == 1 ? "fp8 delayed" : which == 2 ? "fp8 current" : "fp8 block");
}
BENCHMARK(BM_LinearTrainingStep)->ArgName("precision")->DenseRange(0, 3)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace forge::nn
