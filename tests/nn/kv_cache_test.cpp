// The KV cache and the layers' inference path: one layer's cached forward, fed token by token or in chunks,
// reproduces the training forward over the whole sequence, its keys land in the cache after RoPE, and the
// cache's bookkeeping refuses what does not fit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "forge/kernels/rope_tables.h"
#include "nn/layer_stack.h"
#include "op_harness.h"

namespace forge::nn::kv_cache_test {
namespace {
using namespace testing_layers;

struct OneLayer {
  ParameterStore store;
  std::vector<DecoderLayer> layers;
  RopeTable rope;
  AttentionShape attention{32, 4, 2, 8};
  OneLayer(DType dtype, int64_t positions) {
    LayerShape shape;
    shape.attention = attention, shape.ffn = 48;
    const LayerIds ids = register_layer(store, 0, shape, 0.2f, 1);
    store.allocate(dtype == DType::bf16);
    store.initialize(3);
    rope.positions = positions, rope.half_dim = attention.head_dim / 2;
    rope.cos = Tensor::empty({positions, rope.half_dim}, DType::f32);
    rope.sin = Tensor::empty({positions, rope.half_dim}, DType::f32);
    rope_tables(positions, attention.head_dim, 10000.0, RopeScaling{}, rope.cos.f32(), rope.sin.f32());
    layers.push_back(make_layer(store, ids, shape, &rope, {dtype, Recompute::none}));
  }
};

Tensor rows_of(const Tensor& x, int64_t batch, int64_t seq, int64_t begin, int64_t count) {
  const int64_t width = x.dim(1);
  Tensor out = Tensor::empty({batch * count, width}, DType::f32);
  for (int64_t b = 0; b < batch; ++b)
    std::memcpy(out.f32() + b * count * width, x.f32() + (b * seq + begin) * width,
                count * width * sizeof(float));
  return out;
}

class CachedLayer : public ::testing::TestWithParam<DType> {};

TEST_P(CachedLayer, ChunksReproduceTheFullForward) {
  const int64_t batch = 2, seq = 30;
  OneLayer s(GetParam(), 40);
  Tensor x = Tensor::empty({batch * seq, 32}, DType::f32);
  const auto values = testing::random_floats(x.numel(), 1);
  std::memcpy(x.f32(), values.data(), x.bytes());
  DecoderLayer::Saved saved;
  const Tensor full = s.layers[0].forward(x, batch, seq, saved);
  // fp32: only the attention's summation order differs. bf16: that difference may flip the rounding of an
  // attention output element on its way into the o-projection (2^-9 relative of one term), so the bound is
  // looser (measured up to 2.3e-3 with native AVX512-BF16 / AMX GEMMs, whose accumulation order differs
  // more).
  const double tolerance = GetParam() == DType::f32 ? 2e-6 : 4e-3;

  KvCache cache(1, batch, 40, 2, 8);
  for (int64_t begin = 0; begin < seq;) {
    // A square prompt, then 19 tokens at an offset (flash tiles), then one at a time (the decode kernel).
    const int64_t n = begin < 5 ? 5 : begin < 24 ? 19 : 1;
    Tensor y = s.layers[0].forward_cached(rows_of(x, batch, seq, begin, n), batch, n, cache.layer(0));
    cache.advance(n);
    const Tensor want = rows_of(full, batch, seq, begin, n);
    EXPECT_LT(testing::relative_error(std::vector<float>(y.f32(), y.f32() + y.numel()),
                                      std::vector<double>(want.f32(), want.f32() + want.numel())),
              tolerance)
        << "tokens " << begin << ".." << begin + n - 1;
    begin += n;
  }
  // The cache holds each token's key after RoPE: the k part of the training forward's q|k|v, up to the
  // summation order of the projection's GEMM, which some CPUs' kernels vary with the row count (5, 19, 1
  // here against 60): within a few ulps of the keys' scale.
  const Tensor& qkv = static_cast<const Attention::Saved&>(*saved.mixer).qkv;
  KvLayer layer = cache.layer(0);
  double scale = 0;
  for (int64_t i = 0; i < batch * seq; ++i)
    for (int64_t j = 32; j < 48; ++j) scale = std::max(scale, std::abs(double(qkv.f32()[i * 64 + j])));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t)
      for (int64_t g = 0; g < 2; ++g)
        for (int64_t d = 0; d < 8; ++d)
          ASSERT_NEAR(layer.keys[layer.at(b, g, t) + d], qkv.f32()[(b * seq + t) * 64 + 32 + g * 8 + d],
                      1e-6 * scale)
              << "token " << t << " of sequence " << b;
}

INSTANTIATE_TEST_SUITE_P(GemmDtypes, CachedLayer, ::testing::Values(DType::f32, DType::bf16));

TEST(CachedLayerErrors, CapacityRopeTableAndShape) {
  OneLayer s(DType::f32, 6);
  Tensor x = Tensor::zeros({4, 32}, DType::f32);
  KvCache cache(1, 1, 8, 2, 8);
  s.layers[0].forward_cached(x, 1, 4, cache.layer(0));
  cache.advance(4);
  // Positions 4..7 fit the cache (8) but not the RoPE table (6).
  testing::expect_error_containing([&] { s.layers[0].forward_cached(x, 1, 4, cache.layer(0)); },
                                   {"RoPE table"});
  cache.advance(3);
  testing::expect_error_containing([&] { s.layers[0].forward_cached(x, 1, 4, cache.layer(0)); },
                                   {"KV cache full", "capacity of 8"});
  KvCache wrong(1, 1, 8, 1, 8);  // one kv head, the layer has two
  testing::expect_error_containing([&] { s.layers[0].forward_cached(x, 1, 4, wrong.layer(0)); },
                                   {"kv heads"});
}

TEST(KvCache, LayoutAndBookkeeping) {
  KvCache cache(3, 2, 10, 4, 8);
  EXPECT_EQ(cache.bytes(), 3u * 2 * 2 * 10 * 4 * 8 * sizeof(float));
  KvLayer a = cache.layer(0), b = cache.layer(1);
  EXPECT_EQ(a.values - a.keys, 2 * 4 * 10 * 8);  // [batch, kv_heads, capacity, head_dim]
  EXPECT_EQ(b.keys - a.values, 2 * 4 * 10 * 8);
  EXPECT_EQ(a.at(1, 2, 3), 1 * 4 * 10 * 8 + 2 * 10 * 8 + 3 * 8);
  cache.advance(7);
  EXPECT_EQ(cache.layer(2).length, 7);
  EXPECT_EQ(cache.remaining(), 3);
  EXPECT_THROW(cache.advance(4), Error);
  cache.truncate(2);
  EXPECT_EQ(cache.length(), 2);
  EXPECT_THROW(cache.truncate(5), Error);
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  EXPECT_THROW(cache.layer(3), Error);
  testing::expect_error_containing([] { KvCache(2, 0, 10, 4, 8); }, {"batch 0"});
}

}  // namespace
}  // namespace forge::nn::kv_cache_test
