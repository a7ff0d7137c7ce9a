// MLA on the GPU against the same module on the CPU: forward, both backward halves and the cached inference
// over the compressed latent cache, with fp32 and bf16 GEMM operands. Under the device emulation
// (device_backends.h) every op's parameters must pass the CUDA backend's predicates and no host code may
// touch device memory; the results are then the CPU kernels' (bound 1e-3 relative, 0 in practice). On a GPU
// attention runs bf16 tensor-core products whatever the GEMMs' dtype (kernels/cuda/attention.cu): q, k, v and
// the probabilities rounded to bf16 (2^-9 relative each) moved every result by 2-3.5e-3 relative on an H200
// (fp32 and bf16 alike), so the bound there is 1e-2.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "device_backends.h"
#include "forge/kernels/rope_tables.h"
#include "forge/nn/mla_attention.h"
#include "op_harness.h"

namespace forge::nn::mla_attention_cuda_test {
namespace {

constexpr int64_t kBatch = 2, kSeq = 9, kPositions = 16;

MlaShape shape() {
  MlaShape s;
  s.hidden = 64, s.heads = 4, s.q_lora_rank = 24, s.kv_lora_rank = 32;
  s.qk_nope_head_dim = 16, s.qk_rope_head_dim = 8, s.v_head_dim = 12;
  s.rope_interleave = true;
  s.softmax_scale = 0.2f;
  return s;
}

struct MlaRun {
  std::vector<float> y, dx, grads, cached;
};

std::vector<float> host(const Tensor& t) {
  Tensor h = t.to(Device::cpu);
  return {h.f32(), h.f32() + h.numel()};
}
Tensor on(Device device, const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
  return t.to(device);
}

MlaRun run_mla(Device device, DType dtype) {
  const MlaShape s = shape();
  ParameterStore store;
  MlaParams ids;
  const std::string p = "model.layers.0.self_attn.";
  ids.q_a = store.add(p + "q_a_proj.weight", {s.q_lora_rank, s.hidden}, true, Init::normal, 0.2f);
  ids.q_a_norm = store.add(p + "q_a_layernorm.weight", {s.q_lora_rank}, false, Init::ones);
  ids.q_b = store.add(p + "q_b_proj.weight", {s.q_dim(), s.q_lora_rank}, true, Init::normal, 0.2f);
  ids.kv_a = store.add(p + "kv_a_proj_with_mqa.weight", {s.kv_a_dim(), s.hidden}, true, Init::normal, 0.2f);
  ids.kv_a_norm = store.add(p + "kv_a_layernorm.weight", {s.kv_lora_rank}, false, Init::ones);
  ids.kv_b = store.add(p + "kv_b_proj.weight", {s.kv_dim(), s.kv_lora_rank}, true, Init::normal, 0.2f);
  ids.o = store.add(p + "o_proj.weight", {s.hidden, s.out_dim()}, true, Init::normal, 0.2f);
  store.allocate(dtype == DType::bf16, true, device);
  store.initialize(5);
  if (store.has_bf16()) store.refresh_bf16();
  RopeTable rope;
  rope.positions = kPositions, rope.half_dim = s.qk_rope_head_dim / 2;
  Tensor cos = Tensor::empty({kPositions, rope.half_dim}, DType::f32);
  Tensor sin = Tensor::empty({kPositions, rope.half_dim}, DType::f32);
  RopeScaling yarn;
  yarn.kind = RopeScaling::Kind::yarn, yarn.factor = 4, yarn.original_max_position_embeddings = 4;
  yarn.mscale = 1, yarn.mscale_all_dim = 0.8;
  rope_tables(kPositions, s.qk_rope_head_dim, 10000.0, yarn, cos.f32(), sin.f32());
  rope.cos = cos.to(device), rope.sin = sin.to(device);
  ComputeOptions options;
  options.gemm_dtype = dtype, options.device = device;
  MlaAttention mla(&store, ids, s, &rope, options);

  const int64_t rows = kBatch * kSeq;
  Tensor x = on(device, testing::random_floats(rows * s.hidden, 1), {rows, s.hidden});
  Tensor dy = on(device, testing::random_floats(rows * s.hidden, 2), {rows, s.hidden});
  MlaRun r;
  store.zero_grads();
  MlaAttention::Saved saved;
  r.y = host(mla.forward(x, kBatch, kSeq, saved, false));
  r.dx = host(mla.backward_input(dy, kBatch, kSeq, saved));
  mla.backward_weight(saved);
  r.grads = host(store.grads());
  // The same sequence through the cache: a prefill of 5 tokens, then 4 decoding steps.
  KvCache cache(1, kBatch, kPositions, 1, s.kv_a_dim(), device);
  const std::vector<float> xs = host(x);
  for (int64_t at = 0; at < kSeq;) {
    const int64_t tokens = at == 0 ? 5 : 1;
    std::vector<float> chunk;
    for (int64_t b = 0; b < kBatch; ++b)
      chunk.insert(chunk.end(), xs.begin() + (b * kSeq + at) * s.hidden,
                   xs.begin() + (b * kSeq + at + tokens) * s.hidden);
    const std::vector<float> y = host(
        mla.forward_cached(on(device, chunk, {kBatch * tokens, s.hidden}), kBatch, tokens, cache.layer(0)));
    cache.advance(tokens);
    r.cached.insert(r.cached.end(), y.begin(), y.end());
    at += tokens;
  }
  return r;
}

double relative(const std::vector<float>& got, const std::vector<float>& want) {
  return testing::relative_error(got, std::vector<double>(want.begin(), want.end()));
}

class MlaOnDevice : public DeviceBackendTest {};

TEST_P(MlaOnDevice, MatchesTheCpu) {
  const double bound = emulated() ? 1e-3 : 1e-2;
  for (DType dtype : {DType::f32, DType::bf16}) {
    const MlaRun cpu = run_mla(Device::cpu, dtype), gpu = run_mla(Device::cuda, dtype);
    EXPECT_LT(relative(gpu.y, cpu.y), bound) << dtype_name(dtype);
    EXPECT_LT(relative(gpu.dx, cpu.dx), bound) << dtype_name(dtype);
    EXPECT_LT(relative(gpu.grads, cpu.grads), bound) << dtype_name(dtype);
    EXPECT_LT(relative(gpu.cached, cpu.cached), bound) << dtype_name(dtype);
  }
}

FORGE_INSTANTIATE_DEVICE_BACKENDS(MlaOnDevice);

}  // namespace
}  // namespace forge::nn::mla_attention_cuda_test
