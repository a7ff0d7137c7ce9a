// Multi-head latent attention against a double-precision reference written here with explicit loops in
// Hugging Face's semantics (DeepseekV3Attention, as tests/reference/deepseek_v3_twin.py runs it: the latent
// norms at eps 1e-6, interleaved RoPE as HF's permutation to halves followed by rotate_half, YaRN's attention
// factor in the tables and mscale^2 in the softmax scale): the forward in fp32 and bf16 GEMMs, every gradient
// against central finite differences of the reference, the module contract (B then W equals the fused order,
// selective recompute equals none, bitwise), the cached inference over the compressed latent cache against
// the full forward, and a two-rank tensor-parallel split emulated on one process.
#include "forge/nn/mla_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "forge/kernels/rope_tables.h"
#include "forge/nn/decoder_layer.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/mlp.h"
#include "forge/nn/tensor_parallel.h"
#include "op_harness.h"

namespace forge::nn::mla_attention_test {
namespace {

struct Config {
  bool q_lora = true, interleave = true, yarn = false;
  std::string name() const {
    return std::string(q_lora ? "QLora" : "QProj") + (interleave ? "Interleaved" : "Halves") +
           (yarn ? "Yarn" : "Plain");
  }
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name(); }

// The tiny sizes of the brief: hidden 16, 2 heads, nope 4, rope 4, v 6, kv latent 8, q latent 8.
MlaShape tiny_shape(const Config& c) {
  MlaShape s;
  s.hidden = 16, s.heads = 2, s.q_lora_rank = c.q_lora ? 8 : 0, s.kv_lora_rank = 8;
  s.qk_nope_head_dim = 4, s.qk_rope_head_dim = 4, s.v_head_dim = 6;
  s.rope_interleave = c.interleave;
  s.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(s.qk_head_dim())));
  return s;
}

RopeScaling yarn_scaling() {
  RopeScaling y;
  y.kind = RopeScaling::Kind::yarn;
  y.factor = 4, y.original_max_position_embeddings = 4, y.beta_fast = 32, y.beta_slow = 1;
  y.mscale = 1.0, y.mscale_all_dim = 0.8;  // attention factor yarn_mscale(4, 1) / yarn_mscale(4, 0.8) != 1
  return y;
}

// One MLA and its parameters, registered the way the family will (the HF names are the test's own here).
struct Fixture {
  ParameterStore store;
  MlaParams ids;
  MlaShape shape;
  RopeTable rope;
  std::unique_ptr<MlaAttention> mla;
  // With with_layer: a whole decoder layer around it (norms, SwiGLU of 24), the way a family composes MLA.
  int norm1 = -1, norm2 = -1;
  MlpParams mlp;
  std::unique_ptr<DecoderLayer> layer;

  Fixture(const Config& c, ComputeOptions options, int64_t positions = 16, MlaShape s = {},
          bool with_layer = false) {
    shape = s.hidden ? s : tiny_shape(c);
    RopeScaling scaling;
    if (c.yarn) {
      scaling = yarn_scaling();
      const double m = RopeScaling::yarn_mscale(scaling.factor, scaling.mscale_all_dim);
      shape.softmax_scale = static_cast<float>(m * m / std::sqrt(double(shape.qk_head_dim())));
    }
    const std::string p = "model.layers.0.self_attn.";
    const int64_t H = shape.heads;
    if (shape.q_lora_rank > 0) {
      ids.q_a = store.add(p + "q_a_proj.weight", {shape.q_lora_rank, shape.hidden}, true, Init::normal, 0.3f);
      ids.q_a_norm = store.add(p + "q_a_layernorm.weight", {shape.q_lora_rank}, false, Init::ones);
      ids.q_b =
          store.add(p + "q_b_proj.weight", {shape.q_dim(), shape.q_lora_rank}, true, Init::normal, 0.4f);
    } else {
      ids.q = store.add(p + "q_proj.weight", {shape.q_dim(), shape.hidden}, true, Init::normal, 0.3f);
    }
    ids.kv_a = store.add(p + "kv_a_proj_with_mqa.weight", {shape.kv_a_dim(), shape.hidden}, true,
                         Init::normal, 0.3f);
    ids.kv_a_norm = store.add(p + "kv_a_layernorm.weight", {shape.kv_lora_rank}, false, Init::ones);
    ids.kv_b =
        store.add(p + "kv_b_proj.weight", {shape.kv_dim(), shape.kv_lora_rank}, true, Init::normal, 0.4f);
    ids.o = store.add(p + "o_proj.weight", {shape.hidden, H * shape.v_head_dim}, true, Init::normal, 0.3f);
    if (with_layer) {
      norm1 = store.add("model.layers.0.input_layernorm.weight", {shape.hidden}, false, Init::ones);
      norm2 = store.add("model.layers.0.post_attention_layernorm.weight", {shape.hidden}, false, Init::ones);
      mlp.gate =
          store.add("model.layers.0.mlp.gate_proj.weight", {24, shape.hidden}, true, Init::normal, 0.3f);
      mlp.up = store.add("model.layers.0.mlp.up_proj.weight", {24, shape.hidden}, true, Init::normal, 0.3f);
      mlp.down =
          store.add("model.layers.0.mlp.down_proj.weight", {shape.hidden, 24}, true, Init::normal, 0.3f);
    }
    store.allocate(options.gemm_dtype == DType::bf16);
    store.initialize(11);
    for (const auto& info : store.infos())  // norm weights away from 1 so their gradients are exercised
      if (info.shape.size() == 1)
        for (int64_t i = 0; i < info.shape[0]; ++i)
          store.params().f32()[info.offset + i] = 1.0f + 0.05f * (i % 7);
    if (store.has_bf16()) store.refresh_bf16();
    const int64_t dr = shape.qk_rope_head_dim;
    rope.positions = positions, rope.half_dim = dr / 2;
    rope.cos = Tensor::empty({positions, dr / 2}, DType::f32);
    rope.sin = Tensor::empty({positions, dr / 2}, DType::f32);
    rope_tables(positions, dr, 10000.0, scaling, rope.cos.f32(), rope.sin.f32());
    mla = std::make_unique<MlaAttention>(&store, ids, shape, &rope, options);
    if (with_layer)
      layer = std::make_unique<DecoderLayer>(&store, norm1, std::make_unique<MlaAttention>(*mla), norm2,
                                             std::make_unique<Mlp>(&store, mlp, shape.hidden, 24, options),
                                             1e-6f, options);
  }
  std::vector<double> param(int id) const {
    Tensor t = store.param(id);
    return {t.f32(), t.f32() + t.numel()};
  }
};

// The reference's parameters, in double.
struct RefWeights {
  std::vector<double> q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, o;
};

RefWeights ref_weights(const Fixture& f) {
  RefWeights w;
  if (f.shape.q_lora_rank > 0) {
    w.q_a = f.param(f.ids.q_a), w.q_a_norm = f.param(f.ids.q_a_norm), w.q_b = f.param(f.ids.q_b);
  } else {
    w.q = f.param(f.ids.q);
  }
  w.kv_a = f.param(f.ids.kv_a), w.kv_a_norm = f.param(f.ids.kv_a_norm), w.kv_b = f.param(f.ids.kv_b);
  w.o = f.param(f.ids.o);
  return w;
}

std::vector<double*> weight_list(RefWeights& w) {
  return {w.q_a.data(),  w.q_a_norm.data(),  w.q_b.data(),  w.q.data(),
          w.kv_a.data(), w.kv_a_norm.data(), w.kv_b.data(), w.o.data()};
}

// y[out] = W[out, in] x[in]
std::vector<double> matvec(const std::vector<double>& w, const double* x, int64_t out, int64_t in) {
  std::vector<double> y(out, 0.0);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) y[i] += w[i * in + j] * x[j];
  return y;
}

std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<double>& w, double eps) {
  double ms = 0;
  for (double v : x) ms += v * v;
  const double r = 1.0 / std::sqrt(ms / double(x.size()) + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = w[i] * x[i] * r;
  return y;
}

// HF's apply_rotary_pos_emb on one head's rope vector at position t, in HF's output layout: under interleave
// the pairs (2i, 2i+1) first gather to (i, i + d/2), then rotate_half. cos/sin: the module's tables (tested
// against HF elsewhere), widened.
std::vector<double> hf_rope(const double* x, int64_t d, int64_t t, bool interleave, const RopeTable& rope) {
  std::vector<double> y(d), out(d);
  for (int64_t i = 0; i < d; ++i) y[i] = interleave ? (i < d / 2 ? x[2 * i] : x[2 * (i - d / 2) + 1]) : x[i];
  for (int64_t i = 0; i < d / 2; ++i) {
    const double c = rope.cos.f32()[t * (d / 2) + i], s = rope.sin.f32()[t * (d / 2) + i];
    out[i] = y[i] * c - y[i + d / 2] * s;
    out[i + d / 2] = y[i + d / 2] * c + y[i] * s;
  }
  return out;
}

// The reference MLA: x [batch * seq, hidden] -> [batch * seq, hidden].
std::vector<double> reference(const MlaShape& s, const RefWeights& w, const RopeTable& rope,
                              const std::vector<double>& x, int64_t batch, int64_t seq) {
  const int64_t H = s.heads, dn = s.qk_nope_head_dim, dr = s.qk_rope_head_dim, dv = s.v_head_dim;
  const int64_t L = s.kv_lora_rank, qk = dn + dr;
  std::vector<double> y(batch * seq * s.hidden, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    // Per token: queries [H][qk], keys [H][qk], values [H][dv] (HF layout: nope then rope).
    std::vector<std::vector<double>> qs(seq), ks(seq), vs(seq);
    for (int64_t t = 0; t < seq; ++t) {
      const double* xt = x.data() + (b * seq + t) * s.hidden;
      std::vector<double> q;
      if (s.q_lora_rank > 0) {
        auto qa = matvec(w.q_a, xt, s.q_lora_rank, s.hidden);
        auto qn = rms_norm(qa, w.q_a_norm, 1e-6);
        q = matvec(w.q_b, qn.data(), s.q_dim(), s.q_lora_rank);
      } else {
        q = matvec(w.q, xt, s.q_dim(), s.hidden);
      }
      auto ckv = matvec(w.kv_a, xt, L + dr, s.hidden);
      std::vector<double> c(ckv.begin(), ckv.begin() + L);
      auto kv = matvec(w.kv_b, rms_norm(c, w.kv_a_norm, 1e-6).data(), H * (dn + dv), L);
      auto k_rope = hf_rope(ckv.data() + L, dr, t, s.rope_interleave, rope);
      qs[t].resize(H * qk), ks[t].resize(H * qk), vs[t].resize(H * dv);
      for (int64_t h = 0; h < H; ++h) {
        auto q_rope = hf_rope(q.data() + h * qk + dn, dr, t, s.rope_interleave, rope);
        for (int64_t i = 0; i < dn; ++i)
          qs[t][h * qk + i] = q[h * qk + i], ks[t][h * qk + i] = kv[h * (dn + dv) + i];
        for (int64_t i = 0; i < dr; ++i)
          qs[t][h * qk + dn + i] = q_rope[i], ks[t][h * qk + dn + i] = k_rope[i];
        for (int64_t i = 0; i < dv; ++i) vs[t][h * dv + i] = kv[h * (dn + dv) + dn + i];
      }
    }
    for (int64_t t = 0; t < seq; ++t) {
      std::vector<double> out(H * dv, 0.0);
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> score(t + 1);
        double top = -1e300;
        for (int64_t u = 0; u <= t; ++u) {
          double d = 0;
          for (int64_t i = 0; i < qk; ++i) d += qs[t][h * qk + i] * ks[u][h * qk + i];
          score[u] = d * s.softmax_scale;
          top = std::max(top, score[u]);
        }
        double total = 0;
        for (auto& v : score) total += (v = std::exp(v - top));
        for (int64_t u = 0; u <= t; ++u)
          for (int64_t i = 0; i < dv; ++i) out[h * dv + i] += score[u] / total * vs[u][h * dv + i];
      }
      auto yt = matvec(w.o, out.data(), s.hidden, H * dv);
      std::copy(yt.begin(), yt.end(), y.begin() + (b * seq + t) * s.hidden);
    }
  }
  return y;
}

Tensor from_vector(const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
  return t;
}
std::vector<double> doubles(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

constexpr int64_t kBatch = 2, kSeq = 5;

class MlaConfigs : public ::testing::TestWithParam<Config> {};

TEST_P(MlaConfigs, ForwardMatchesDoubleReference) {
  Fixture f(GetParam(), {DType::f32, Recompute::none});
  const int64_t rows = kBatch * kSeq;
  auto xv = testing::random_floats(rows * f.shape.hidden, 1);
  MlaAttention::Saved saved;
  Tensor y = f.mla->forward(from_vector(xv, {rows, f.shape.hidden}), kBatch, kSeq, saved, true);
  auto want = reference(f.shape, ref_weights(f), f.rope, testing::to_double(xv), kBatch, kSeq);
  EXPECT_LT(testing::relative_error(y.f32(), want.data(), want.size()), 2e-6);
}

// Every gradient (the input's and every element of every weight) against central finite differences of the
// double reference, for L = <w, y>. fp32 module against double differences: 1e-4 relative.
TEST_P(MlaConfigs, GradientsMatchFiniteDifferencesOfTheReference) {
  Fixture f(GetParam(), {DType::f32, Recompute::none});
  const int64_t rows = kBatch * kSeq, hidden = f.shape.hidden;
  auto xv = testing::random_floats(rows * hidden, 2);
  auto wv = testing::random_floats(rows * hidden, 3);
  f.store.zero_grads();
  MlaAttention::Saved saved;
  f.mla->forward(from_vector(xv, {rows, hidden}), kBatch, kSeq, saved, true);
  Tensor dx = f.mla->backward_input(from_vector(wv, {rows, hidden}), kBatch, kSeq, saved);
  f.mla->backward_weight(saved);

  const auto w_out = testing::to_double(wv);
  RefWeights base = ref_weights(f);
  const auto x0 = testing::to_double(xv);
  auto dx_num = testing::finite_difference(
      [&](const std::vector<double>& x) {
        return testing::dot(w_out, reference(f.shape, base, f.rope, x, kBatch, kSeq));
      },
      x0);
  EXPECT_LT(testing::relative_error(dx.f32(), dx_num.data(), dx_num.size()), 1e-4) << "input";

  const int ids[] = {f.ids.q_a,  f.ids.q_a_norm,  f.ids.q_b,  f.ids.q,
                     f.ids.kv_a, f.ids.kv_a_norm, f.ids.kv_b, f.ids.o};
  for (int k = 0; k < 8; ++k) {
    if (ids[k] < 0) continue;
    auto g = testing::finite_difference(
        [&](const std::vector<double>& v) {
          RefWeights w = base;
          std::memcpy(weight_list(w)[k], v.data(), v.size() * sizeof(double));
          return testing::dot(w_out, reference(f.shape, w, f.rope, x0, kBatch, kSeq));
        },
        f.param(ids[k]));
    Tensor grad = f.store.grad(ids[k]);
    EXPECT_LT(testing::relative_error(grad.f32(), g.data(), g.size()), 1e-4) << f.store.info(ids[k]).name;
  }
}

INSTANTIATE_TEST_SUITE_P(Mla, MlaConfigs,
                         ::testing::Values(Config{true, true, false}, Config{false, false, false},
                                           Config{true, false, true}, Config{false, true, true}),
                         [](const auto& info) { return info.param.name(); });

// Two micro-batches in flight, as a pipeline schedule keeps them: F1 F2 B2 W2 B1 W1 (fused) and F1 F2 B2 B1
// W2 W1 (split); with and without selective recompute, every gradient bitwise the same.
struct ContractRun {
  Tensor dx1, dx2, grads;
};

// The module's options: GEMMs in `gemm`, activations in `activation` (bf16 needs bf16 GEMMs).
struct Dtypes {
  DType gemm = DType::f32, activation = DType::f32;
};
ComputeOptions options_of(Dtypes d, Recompute recompute = Recompute::none) {
  ComputeOptions o;
  o.gemm_dtype = d.gemm, o.recompute = recompute, o.activation_dtype = d.activation;
  return o;
}
std::string dtypes_name(const ::testing::TestParamInfo<Dtypes>& info) {
  return std::string(dtype_name(info.param.gemm)) + "_activations_" +
         std::string(dtype_name(info.param.activation));
}

ContractRun run_contract(const Config& c, Dtypes dtypes, bool split, bool keep_core) {
  Fixture f(c, options_of(dtypes));
  const int64_t rows = kBatch * kSeq, hidden = f.shape.hidden;
  Tensor x1 = from_vector(testing::random_floats(rows * hidden, 4), {rows, hidden});
  Tensor x2 = from_vector(testing::random_floats(rows * hidden, 5), {rows, hidden});
  Tensor d1 = from_vector(testing::random_floats(rows * hidden, 6), {rows, hidden});
  Tensor d2 = from_vector(testing::random_floats(rows * hidden, 7), {rows, hidden});
  f.store.zero_grads();
  MlaAttention::Saved s1, s2;
  f.mla->forward(x1, kBatch, kSeq, s1, keep_core);
  f.mla->forward(x2, kBatch, kSeq, s2, keep_core);
  ContractRun r;
  r.dx2 = f.mla->backward_input(d2, kBatch, kSeq, s2);
  if (!split) f.mla->backward_weight(s2);
  r.dx1 = f.mla->backward_input(d1, kBatch, kSeq, s1);
  if (split) f.mla->backward_weight(s2);
  f.mla->backward_weight(s1);
  r.grads = f.store.grads().clone();
  return r;
}

class MlaContract : public ::testing::TestWithParam<Dtypes> {};

TEST_P(MlaContract, BackwardInputThenWeightEqualsFusedOrderBitwise) {
  for (const Config& c : {Config{true, true, true}, Config{false, false, false}}) {
    ContractRun fused = run_contract(c, GetParam(), false, true),
                split = run_contract(c, GetParam(), true, true);
    EXPECT_TRUE(bitwise_equal(fused.dx1, split.dx1)) << c.name();
    EXPECT_TRUE(bitwise_equal(fused.dx2, split.dx2)) << c.name();
    EXPECT_TRUE(bitwise_equal(fused.grads, split.grads)) << c.name();
  }
}

TEST_P(MlaContract, SelectiveRecomputeEqualsKeepingTheCoreBitwise) {
  for (const Config& c : {Config{true, true, true}, Config{false, false, false}}) {
    ContractRun none = run_contract(c, GetParam(), true, true),
                selective = run_contract(c, GetParam(), true, false);
    EXPECT_TRUE(bitwise_equal(none.dx1, selective.dx1)) << c.name();
    EXPECT_TRUE(bitwise_equal(none.dx2, selective.dx2)) << c.name();
    EXPECT_TRUE(bitwise_equal(none.grads, selective.grads)) << c.name();
  }
}

INSTANTIATE_TEST_SUITE_P(GemmDtypes, MlaContract,
                         ::testing::Values(Dtypes{DType::f32, DType::f32}, Dtypes{DType::bf16, DType::f32},
                                           Dtypes{DType::bf16, DType::bf16}),
                         dtypes_name);

// MLA as the token mixer of a decoder layer (through the LayerPart interface): the three recompute policies
// and B then W give the same gradients bitwise.
TEST_P(MlaContract, InADecoderLayerEveryRecomputePolicyGivesTheSameGradients) {
  const Config c{true, true, true};
  const int64_t rows = kBatch * kSeq;
  Tensor x = from_vector(testing::random_floats(rows * 16, 14), {rows, 16});
  Tensor dy = from_vector(testing::random_floats(rows * 16, 15), {rows, 16});
  Tensor dx_ref, grads_ref;
  for (Recompute policy : {Recompute::none, Recompute::selective, Recompute::full}) {
    for (bool split : {false, true}) {
      Fixture f(c, options_of(GetParam(), policy), 16, {}, true);
      f.store.zero_grads();
      DecoderLayer::Saved saved;
      f.layer->forward(x, kBatch, kSeq, saved);
      Tensor dx = f.layer->backward_input(dy, kBatch, kSeq, saved);
      if (split) f.layer->forward(x, kBatch, kSeq, *std::make_unique<DecoderLayer::Saved>());
      f.layer->backward_weight(saved);
      if (!dx_ref.defined()) {
        dx_ref = dx, grads_ref = f.store.grads().clone();
        continue;
      }
      EXPECT_TRUE(bitwise_equal(dx, dx_ref)) << recompute_name(policy) << " split " << split;
      EXPECT_TRUE(bitwise_equal(f.store.grads(), grads_ref)) << recompute_name(policy) << " split " << split;
    }
  }
}

// bf16 GEMM operands (fp32 accumulation) against the double reference, by the scale-free dissimilarity:
// bf16's 8-bit mantissa gives ~4e-3 relative error per operand, ~1e-5 dissimilarity; thresholds 1e-4 for
// the output, 1e-3 for the gradients (two more GEMMs deep), against the fp32 module's gradients.
TEST(MlaBf16, WithinToleranceOfTheReference) {
  const Config c{true, true, true};
  Fixture f(c, {DType::bf16, Recompute::none}), exact(c, {DType::f32, Recompute::none});
  const int64_t rows = kBatch * kSeq, hidden = f.shape.hidden;
  auto xv = testing::random_floats(rows * hidden, 8);
  auto wv = testing::random_floats(rows * hidden, 9);
  f.store.zero_grads(), exact.store.zero_grads();
  MlaAttention::Saved saved, saved_exact;
  Tensor y = f.mla->forward(from_vector(xv, {rows, hidden}), kBatch, kSeq, saved, true);
  auto want = reference(f.shape, ref_weights(f), f.rope, testing::to_double(xv), kBatch, kSeq);
  const double forward = testing::dissimilarity(y.f32(), want.data(), want.size());
  EXPECT_LT(forward, 1e-4);
  Tensor dx = f.mla->backward_input(from_vector(wv, {rows, hidden}), kBatch, kSeq, saved);
  f.mla->backward_weight(saved);
  exact.mla->forward(from_vector(xv, {rows, hidden}), kBatch, kSeq, saved_exact, true);
  Tensor dx_exact = exact.mla->backward_input(from_vector(wv, {rows, hidden}), kBatch, kSeq, saved_exact);
  exact.mla->backward_weight(saved_exact);
  const auto dx_want = doubles(dx_exact);
  EXPECT_LT(testing::dissimilarity(dx.f32(), dx_want.data(), dx_want.size()), 1e-3);
  for (const auto& info : f.store.infos()) {
    const auto g_want = doubles(exact.store.grad(f.store.find(info.name)));
    EXPECT_LT(
        testing::dissimilarity(f.store.grad(f.store.find(info.name)).f32(), g_want.data(), g_want.size()),
        1e-3)
        << info.name;
  }
  std::printf("bf16 MLA: forward dissimilarity %.2e\n", forward);
}

// bf16 activations measured against what bf16 GEMMs already cost
// (LayerActivations.Bf16CostsNoMoreThanBf16Gemms does the same for GQA). bf16 GEMMs round every Linear's x
// and dy operands: in forward h (shared by q_a and kv_a), the q latent, the kv latent and the core's output;
// in backward the output gradients of all five Linears. bf16 activations add about as many where a tensor was
// fp32 and no GEMM rounded it: q (before and after RoPE), kv_a, k, v and the two latents' inputs, the output;
// in backward the core's input, dq|dk|dv, dq after RoPE's inverse and the input gradient (the rope key's
// gradient sums the heads in fp32; dh sums its two paths in fp32 and rounds once). Errors that small
// propagate linearly, so the added roundings can at most double the distance from the exact fp32 module
// (triangle inequality): bounded by 2x, normwise, for the input and the weight gradients. The core's inputs
// and output are kept in bf16, half the bytes, and the output once, as o_proj's operand.
TEST(MlaBf16, ActivationsCostNoMoreThanBf16Gemms) {
  const Config c{true, true, true};
  Fixture exact(c, options_of({DType::f32, DType::f32})), gemms(c, options_of({DType::bf16, DType::f32})),
      bf16(c, options_of({DType::bf16, DType::bf16}));
  const int64_t rows = kBatch * kSeq, hidden = exact.shape.hidden;
  const Tensor x = from_vector(testing::random_floats(rows * hidden, 21), {rows, hidden});
  const Tensor dy = from_vector(testing::random_floats(rows * hidden, 22), {rows, hidden});
  auto run = [&](Fixture& f, MlaAttention::Saved& saved) {
    f.store.zero_grads();
    f.mla->forward(x, kBatch, kSeq, saved, true);
    MlaAttention::Saved copy = saved;  // what forward kept, for the checks below
    Tensor dx = to_dtype(f.mla->backward_input(dy, kBatch, kSeq, saved), DType::f32);
    f.mla->backward_weight(saved);
    saved = copy;
    return dx;
  };
  MlaAttention::Saved s_exact, s32, s16;
  const Tensor dx = run(exact, s_exact), dx32 = run(gemms, s32), dx16 = run(bf16, s16);
  const auto error = [](const Tensor& a, const Tensor& b) {
    return testing::normwise_error(a.f32(), b.f32(), static_cast<size_t>(a.numel()));
  };
  const double gemm_error = error(dx32, dx), all = error(dx16, dx);
  const double gemm_w = error(gemms.store.grads(), exact.store.grads());
  const double all_w = error(bf16.store.grads(), exact.store.grads());
  std::printf("MLA from the fp32 module: bf16 GEMMs %.2e (weights %.2e), bf16 activations %.2e (%.2e)\n",
              gemm_error, gemm_w, all, all_w);
  EXPECT_GT(error(dx16, dx32), 0) << "bf16 activations changed nothing: is MLA still fp32?";
  EXPECT_LT(all, 2 * gemm_error);
  EXPECT_LT(all_w, 2 * gemm_w);
  for (const Tensor* t : {&s16.q, &s16.k, &s16.v, &s16.out}) EXPECT_EQ(t->dtype(), DType::bf16);
  EXPECT_EQ(2 * s16.q.bytes(), s32.q.bytes());
  EXPECT_EQ(2 * s16.k.bytes(), s32.k.bytes());
  EXPECT_EQ(2 * s16.v.bytes(), s32.v.bytes());
  EXPECT_EQ(s16.out.raw(), s16.out_op.data.raw());  // one bf16 tensor for the core's backward and o_proj
}

// FP8 comes through the Linears: every projection's GEMMs in FP8 (current and DeepSeek's block recipe)
// against the fp32 module, by dissimilarity. E4M3 keeps 3 mantissa bits (~3% relative error per operand);
// measured about 2e-3 for the output here; bounds 1e-2 for the output, 3e-2 for the gradients (E5M2).
TEST(MlaFp8, RecipesStayCloseToTheFp32Module) {
  const Config c{true, true, true};
  for (fp8::Recipe recipe : {fp8::Recipe::current, fp8::Recipe::block}) {
    Fp8Options o;
    o.recipe.recipe = recipe, o.recipe.format = fp8::Format::hybrid, o.recipe.amax_history_len = 4;
    Fp8Context context(o);
    ComputeOptions options{DType::f32, Recompute::none};
    options.fp8 = &context;
    Fixture f(c, options), exact(c, {DType::f32, Recompute::none});
    context.seal();
    const int64_t rows = kBatch * kSeq, hidden = f.shape.hidden;
    Tensor x = from_vector(testing::random_floats(rows * hidden, 16), {rows, hidden});
    Tensor dy = from_vector(testing::random_floats(rows * hidden, 17), {rows, hidden});
    auto step = [&](Fixture& m, Fp8Context* ctx) {
      const Fp8Recording recording(ctx, true);
      m.store.zero_grads();
      MlaAttention::Saved saved;
      Tensor y = m.mla->forward(x, kBatch, kSeq, saved, false);
      Tensor dx = m.mla->backward_input(dy, kBatch, kSeq, saved);
      m.mla->backward_weight(saved);
      return std::make_pair(y, dx);
    };
    auto [y, dx] = step(f, &context);
    auto [y_want, dx_want] = step(exact, nullptr);
    const std::string name = recipe == fp8::Recipe::block ? "block" : "current";
    const double forward = testing::dissimilarity(y.f32(), doubles(y_want).data(), y.numel());
    EXPECT_LT(forward, 1e-2) << name;
    EXPECT_LT(testing::dissimilarity(dx.f32(), doubles(dx_want).data(), dx.numel()), 3e-2) << name;
    for (const auto& info : f.store.infos()) {
      const auto g_want = doubles(exact.store.grad(exact.store.find(info.name)));
      EXPECT_LT(
          testing::dissimilarity(f.store.grad(f.store.find(info.name)).f32(), g_want.data(), g_want.size()),
          3e-2)
          << name << " " << info.name;
    }
    std::printf("FP8 %s MLA: forward dissimilarity %.2e\n", name.c_str(), forward);
  }
}

Tensor rows_of(const Tensor& x, int64_t batch, int64_t seq, int64_t begin, int64_t count) {
  const int64_t width = x.dim(1);
  Tensor out = Tensor::empty({batch * count, width}, DType::f32);
  for (int64_t b = 0; b < batch; ++b)
    std::memcpy(out.f32() + b * count * width, x.f32() + (b * seq + begin) * width,
                count * width * sizeof(float));
  return out;
}

// The compressed cache (one kv head of L + dr per token) and the absorbed decode: a prefill of 3 tokens, then
// tokens one at a time, against the full forward's rows. Both are fp32; the absorbed products reassociate
// the sums, hence 1e-5 relative rather than bitwise.
TEST(MlaCached, CompressedCacheDecodeMatchesFullForward) {
  for (const Config& c : {Config{true, true, true}, Config{false, false, false}}) {
    Fixture f(c, {DType::f32, Recompute::none});
    const int64_t seq = 7, rows = kBatch * seq, hidden = f.shape.hidden;
    Tensor x = from_vector(testing::random_floats(rows * hidden, 10), {rows, hidden});
    MlaAttention::Saved saved;
    Tensor full = f.mla->forward(x, kBatch, seq, saved, true);
    KvCache cache(1, kBatch, 8, 1, f.shape.kv_a_dim());
    int64_t at = 0;
    for (int64_t chunk : {3, 1, 1, 2}) {
      KvLayer layer = cache.layer(0);
      Tensor y = f.mla->forward_cached(rows_of(x, kBatch, seq, at, chunk), kBatch, chunk, layer);
      cache.advance(chunk);
      Tensor want = rows_of(full, kBatch, seq, at, chunk);
      const auto w = doubles(want);
      EXPECT_LT(testing::relative_error(y.f32(), w.data(), w.size()), 1e-5) << c.name() << " at " << at;
      at += chunk;
    }
    KvLayer layer = cache.layer(0);
    testing::expect_error_containing(
        [&] { f.mla->forward_cached(rows_of(x, kBatch, seq, 0, 2), kBatch, 2, layer); }, {"KV cache full"});
    KvCache wrong(1, kBatch, 8, 2, f.shape.qk_head_dim());
    KvLayer wrong_layer = wrong.layer(0);
    testing::expect_error_containing(
        [&] { f.mla->forward_cached(rows_of(x, kBatch, seq, 0, 1), kBatch, 1, wrong_layer); },
        {"compressed cache"});
  }
}

// DeepSeek-V3's head sizes (nope 128, rope 64, v 128, kv latent 512: the core at 192/128, the absorbed decode
// at 576/512) with few heads and a narrow hidden: the forward against the reference, the cache against it.
TEST(MlaCached, DeepSeekV3HeadSizes) {
  MlaShape s;
  s.hidden = 32, s.heads = 2, s.q_lora_rank = 48, s.kv_lora_rank = 512;
  s.qk_nope_head_dim = 128, s.qk_rope_head_dim = 64, s.v_head_dim = 128;
  s.rope_interleave = true;
  s.softmax_scale = static_cast<float>(1.0 / std::sqrt(192.0));
  const Config c{true, true, true};
  Fixture f(c, {DType::f32, Recompute::none}, 16, s);
  const int64_t seq = 6, rows = kBatch * seq, hidden = s.hidden;
  auto xv = testing::random_floats(rows * hidden, 18);
  Tensor x = from_vector(xv, {rows, hidden});
  MlaAttention::Saved saved;
  Tensor full = f.mla->forward(x, kBatch, seq, saved, true);
  auto want = reference(f.shape, ref_weights(f), f.rope, testing::to_double(xv), kBatch, seq);
  EXPECT_LT(testing::relative_error(full.f32(), want.data(), want.size()), 1e-5);
  KvCache cache(1, kBatch, 8, 1, 576);
  int64_t at = 0;
  for (int64_t chunk : {4, 1, 1}) {
    Tensor y = f.mla->forward_cached(rows_of(x, kBatch, seq, at, chunk), kBatch, chunk, cache.layer(0));
    cache.advance(chunk);
    const auto w = doubles(rows_of(full, kBatch, seq, at, chunk));
    EXPECT_LT(testing::relative_error(y.f32(), w.data(), w.size()), 1e-5) << "at " << at;
    at += chunk;
  }
}

// A tensor-parallel group as seen by one rank, whose collectives leave the data alone: the test sums the
// ranks' partial results itself.
class OneRankOf : public TensorParallel {
 public:
  OneRankOf(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool sequence_parallel() const override { return false; }
  void all_reduce_sum(float*, int64_t, Device) override {}
  void all_reduce_max(float*, int64_t, Device) override {}
  void all_gather(const float* send, float* recv, int64_t count, Device) override {
    std::memcpy(recv, send, count * sizeof(float));
  }
  Tensor all_gather_rows(const Tensor& shard) override { return shard; }
  Tensor reduce_scatter_rows(const Tensor& full) override { return full; }

 private:
  int rank_, size_;
};

// Two ranks of one head each against the unsplit module: outputs and input gradients summed over the ranks,
// the column-/row-parallel weights' gradients per head slice, and the replicated parameters' gradients summed
// over the ranks (what the model's finalizers do with replicated_params()).
TEST(MlaTensorParallel, TwoRanksOfOneHeadSumToTheWhole) {
  const Config c{true, true, true};
  Fixture whole(c, {DType::f32, Recompute::none});
  const MlaShape& s = whole.shape;
  const int64_t rows = kBatch * kSeq, hidden = s.hidden, qk = s.qk_head_dim(),
                kvh = s.qk_nope_head_dim + s.v_head_dim;
  Tensor x = from_vector(testing::random_floats(rows * hidden, 12), {rows, hidden});
  Tensor dy = from_vector(testing::random_floats(rows * hidden, 13), {rows, hidden});
  whole.store.zero_grads();
  MlaAttention::Saved saved;
  Tensor y_whole = whole.mla->forward(x, kBatch, kSeq, saved, true);
  Tensor dx_whole = whole.mla->backward_input(dy, kBatch, kSeq, saved);
  whole.mla->backward_weight(saved);

  std::vector<double> y_sum(rows * hidden, 0.0), dx_sum(rows * hidden, 0.0);
  std::vector<std::vector<double>> replicated_sum;
  for (int rank = 0; rank < 2; ++rank) {
    OneRankOf group(rank, 2);
    MlaShape part = s;
    part.heads = 1;
    Fixture r(c, {DType::f32, Recompute::none, &group}, 16, part);
    // This rank's slices of the whole module's weights: q_b and kv_b by head rows, o by head columns; the
    // replicated ones whole.
    auto copy = [&](int to, int from, int64_t offset, int64_t row_len, int64_t rows_n, int64_t stride) {
      for (int64_t i = 0; i < rows_n; ++i)
        std::memcpy(r.store.param(to).f32() + i * row_len,
                    whole.store.param(from).f32() + offset + i * stride, row_len * sizeof(float));
    };
    copy(r.ids.q_a, whole.ids.q_a, 0, s.q_lora_rank * hidden, 1, 0);
    copy(r.ids.q_a_norm, whole.ids.q_a_norm, 0, s.q_lora_rank, 1, 0);
    copy(r.ids.q_b, whole.ids.q_b, rank * qk * s.q_lora_rank, qk * s.q_lora_rank, 1, 0);
    copy(r.ids.kv_a, whole.ids.kv_a, 0, s.kv_a_dim() * hidden, 1, 0);
    copy(r.ids.kv_a_norm, whole.ids.kv_a_norm, 0, s.kv_lora_rank, 1, 0);
    copy(r.ids.kv_b, whole.ids.kv_b, rank * kvh * s.kv_lora_rank, kvh * s.kv_lora_rank, 1, 0);
    copy(r.ids.o, whole.ids.o, rank * s.v_head_dim, s.v_head_dim, hidden, 2 * s.v_head_dim);
    r.store.zero_grads();
    MlaAttention::Saved rs;
    Tensor y = r.mla->forward(x, kBatch, kSeq, rs, true);
    Tensor dx = r.mla->backward_input(dy, kBatch, kSeq, rs);
    r.mla->backward_weight(rs);
    for (int64_t i = 0; i < rows * hidden; ++i) y_sum[i] += y.f32()[i], dx_sum[i] += dx.f32()[i];
    const std::vector<int> replicated = r.mla->replicated_params();
    EXPECT_EQ(replicated, (std::vector<int>{r.ids.q_a, r.ids.q_a_norm, r.ids.kv_a, r.ids.kv_a_norm}));
    replicated_sum.resize(replicated.size());
    for (size_t k = 0; k < replicated.size(); ++k) {
      Tensor g = r.store.grad(replicated[k]);
      replicated_sum[k].resize(g.numel(), 0.0);
      for (int64_t i = 0; i < g.numel(); ++i) replicated_sum[k][i] += g.f32()[i];
    }
    // Sharded weights: this rank's gradient is the whole module's slice.
    Tensor gq = r.store.grad(r.ids.q_b), gkv = r.store.grad(r.ids.kv_b);
    EXPECT_LT(testing::relative_error(
                  gq.f32(), doubles(whole.store.grad(whole.ids.q_b)).data() + rank * gq.numel(), gq.numel()),
              1e-5);
    EXPECT_LT(
        testing::relative_error(
            gkv.f32(), doubles(whole.store.grad(whole.ids.kv_b)).data() + rank * gkv.numel(), gkv.numel()),
        1e-5);
  }
  EXPECT_LT(testing::relative_error(y_whole.f32(), y_sum.data(), y_sum.size()), 1e-5);
  EXPECT_LT(testing::relative_error(dx_whole.f32(), dx_sum.data(), dx_sum.size()), 1e-5);
  const int whole_ids[] = {whole.ids.q_a, whole.ids.q_a_norm, whole.ids.kv_a, whole.ids.kv_a_norm};
  for (int k = 0; k < 4; ++k)
    EXPECT_LT(testing::relative_error(whole.store.grad(whole_ids[k]).f32(), replicated_sum[k].data(),
                                      replicated_sum[k].size()),
              1e-5)
        << whole.store.info(whole_ids[k]).name;
  EXPECT_TRUE(whole.mla->replicated_params().empty());
}

}  // namespace
}  // namespace forge::nn::mla_attention_test
