// Decoding throughput with the KV cache against recomputing the whole context for every token (how
// generation worked before the cache), on a small LLaMA of the default job's shape
// (configs/llama-default.json: hidden 128, 6 layers, 8 heads, 4 kv heads, head_dim 16, vocabulary 2048; 1.6M
// parameters). One iteration produces the logits of one new token at a context of range(0) tokens; tokens/s
// is the rate of iterations. The ratio of the two at the same context is the point.
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include "forge/kernels/ops.h"
#include "forge/models/llama/llama_model.h"

namespace forge {
using namespace forge::models;
namespace {

LlamaConfig default_model() {
  LlamaConfig c;
  c.hidden_size = 128, c.intermediate_size = 352, c.num_hidden_layers = 6, c.num_attention_heads = 8;
  c.num_key_value_heads = 4, c.head_dim = 16, c.vocab_size = 2048, c.max_position_embeddings = 512;
  return c;
}

std::vector<int32_t> context_ids(int64_t n) {
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % 2048);
  return ids;
}

DType dtype_of(int64_t arg) { return arg == 0 ? DType::f32 : DType::bf16; }

// One decode step at position context - 1 against a cache holding the context - 1 earlier tokens; the step's
// position is rolled back after each iteration so every iteration sees the same context.
void BM_DecodeWithKvCache(benchmark::State& state) {
  const int64_t context = state.range(0);
  LlamaModel model(default_model(), {dtype_of(state.range(1)), nn::Recompute::none});
  model.initialize(1);
  const std::vector<int32_t> ids = context_ids(context);
  KvCache cache = model.make_cache(1, context);
  model.forward_cached(ids.data(), 1, context - 1, cache);
  for (auto _ : state) {
    Tensor logits = model.forward_cached(ids.data() + context - 1, 1, 1, cache);
    benchmark::DoNotOptimize(logits.f32()[0]);
    cache.truncate(context - 1);
  }
  state.counters["tokens/s"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
}

// The same token without a cache: the whole context through the model, logits of every position.
void BM_DecodeByFullRecompute(benchmark::State& state) {
  const int64_t context = state.range(0);
  LlamaModel model(default_model(), {dtype_of(state.range(1)), nn::Recompute::none});
  model.initialize(1);
  const std::vector<int32_t> ids = context_ids(context);
  for (auto _ : state) {
    Tensor logits = model.logits(ids.data(), 1, context);
    benchmark::DoNotOptimize(logits.f32()[0]);
  }
  state.counters["tokens/s"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
}

// The attention of one decode step alone at a LLaMA-3-8B layer's shape (32 heads, 8 kv heads, head_dim 128)
// against a cache of range(0) tokens: memory-bound, so the figure of merit is the rate at which it reads
// the cached keys and values (GB/s), to set beside the machine's memory bandwidth. range(1) picks the cache
// layout: 1 = each kv head's positions together (KvCache's), 0 = all heads side by side per position.
void BM_AttentionDecodeStep(benchmark::State& state) {
  const int64_t context = state.range(0), heads = 32, kv_heads = 8, dim = 128;
  const bool head_major = state.range(1) == 1;
  Tensor q = Tensor::zeros({heads * dim}, DType::f32), out = Tensor::zeros({heads * dim}, DType::f32);
  Tensor k = Tensor::empty({context, kv_heads * dim}, DType::f32),
         v = Tensor::empty({context, kv_heads * dim}, DType::f32);
  for (int64_t i = 0; i < k.numel(); ++i) k.f32()[i] = v.f32()[i] = static_cast<float>(i % 97) * 0.01f;
  for (int64_t i = 0; i < q.numel(); ++i) q.f32()[i] = static_cast<float>(i % 13) * 0.1f;
  ops::AttentionParams p;
  p.batch = 1, p.seq = 1, p.heads = heads, p.kv_heads = kv_heads, p.head_dim = dim;
  p.q = q.f32(), p.q_stride = heads * dim, p.k = k.f32(), p.v = v.f32();
  p.k_stride = p.v_stride = head_major ? dim : kv_heads * dim;
  p.k_head_stride = p.v_head_stride = head_major ? context * dim : dim;
  p.kv_seq = context, p.q_offset = context - 1;
  p.out = out.f32(), p.out_stride = heads * dim, p.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  for (auto _ : state) {
    ops::attention_forward(p);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(k.bytes() + v.bytes()) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionDecodeStep)
    ->ArgsProduct({{4096}, {1, 0}})
    ->ArgNames({"context", "head_major"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Args: context, dtype (0 fp32, 1 bf16).
BENCHMARK(BM_DecodeWithKvCache)->ArgsProduct({{256}, {0, 1}})->ArgNames({"context", "bf16"})->UseRealTime();
BENCHMARK(BM_DecodeByFullRecompute)
    ->ArgsProduct({{256}, {0, 1}})
    ->ArgNames({"context", "bf16"})
    ->UseRealTime();

}  // namespace
}  // namespace forge
