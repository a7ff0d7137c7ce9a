// Module contract tests on a stack of transformer layers: B-then-W equals the fused order bitwise, the
// recompute policies give bitwise-identical gradients (and their peak activation memory is reported),
// and the layer's gradients agree with central finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "forge/core/memory.h"
#include "forge/kernels/rope_tables.h"
#include "nn/layer_stack.h"
#include "op_harness.h"

namespace forge::nn::decoder_layer_test {
namespace {
using namespace testing_layers;

struct Stack {
  ParameterStore store;
  std::vector<DecoderLayer> layers;
  RopeTable rope;
  DType residual;
  Stack(int count, ComputeOptions options, LayerShape shape, int64_t positions)
      : residual(options.residual_dtype) {
    std::vector<LayerIds> ids;
    for (int i = 0; i < count; ++i) ids.push_back(register_layer(store, i, shape, 0.2f, count));
    store.allocate(options.gemm_dtype == DType::bf16);
    store.initialize(42);
    // Norm weights away from 1 so their gradients are exercised.
    for (const auto& info : store.infos())
      if (info.shape.size() == 1)
        for (int64_t i = 0; i < info.shape[0]; ++i)
          store.params().f32()[info.offset + i] = 1.0f + 0.05f * (i % 7);
    store.refresh_bf16();
    rope.positions = positions, rope.half_dim = shape.attention.head_dim / 2;
    rope.cos = Tensor::empty({positions, rope.half_dim}, DType::f32);
    rope.sin = Tensor::empty({positions, rope.half_dim}, DType::f32);
    rope_tables(positions, shape.attention.head_dim, 10000.0, RopeScaling{}, rope.cos.f32(), rope.sin.f32());
    for (const LayerIds& l : ids) layers.push_back(make_layer(store, l, shape, &rope, options));
  }
};

LayerShape small_shape() {
  LayerShape s;
  s.attention = {32, 4, 2, 8};
  s.ffn = 48;
  s.norm_eps = 1e-5f;
  return s;
}

Tensor from_vector(const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
  return t;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

constexpr int64_t kBatch = 2, kSeq = 9, kLayers = 2;

// Runs forward then backward over the stack, the residual stream in the options' residual dtype (x and dy
// converted to it); returns the input gradient in fp32. split: all backward_input first, then all
// backward_weight. rows: where the rows sit for hidden dropout (inactive: none), layer l at sites 1 + 2 l and
// 2 + 2 l.
Tensor run(Stack& s, const Tensor& x, const Tensor& dy, bool split, DropoutRows rows = {}) {
  std::vector<DecoderLayer::Saved> saved(s.layers.size());
  const DType residual = s.residual;
  Tensor h = to_dtype(x, residual);
  for (size_t l = 0; l < s.layers.size(); ++l) {
    saved[l].dropout = rows;
    saved[l].dropout.stream = static_cast<uint32_t>(1 + 2 * l);
    h = s.layers[l].forward(h, kBatch, kSeq, saved[l]);
  }
  EXPECT_EQ(h.dtype(), residual);
  Tensor g = to_dtype(dy, residual);
  for (size_t l = s.layers.size(); l-- > 0;) {
    g = s.layers[l].backward_input(g, kBatch, kSeq, saved[l]);
    if (!split) s.layers[l].backward_weight(saved[l]);
  }
  if (split)
    for (size_t l = s.layers.size(); l-- > 0;) s.layers[l].backward_weight(saved[l]);
  EXPECT_EQ(g.dtype(), residual);
  return to_dtype(g, DType::f32);
}

// The GEMM operands' dtype, the activations' and the residual stream's (ComputeOptions::activation_dtype,
// residual_dtype).
struct Dtypes {
  DType gemm, activation, residual = DType::f32;
};
ComputeOptions options_of(Dtypes d, Recompute policy) {
  ComputeOptions o{d.gemm, policy};
  o.activation_dtype = d.activation;
  o.residual_dtype = d.residual;
  return o;
}

class LayerContract : public ::testing::TestWithParam<Dtypes> {};

TEST_P(LayerContract, BackwardInputThenWeightEqualsFusedOrderBitwise) {
  const auto shape = small_shape();
  Tensor x = from_vector(testing::random_floats(kBatch * kSeq * 32, 1), {kBatch * kSeq, 32});
  Tensor dy = from_vector(testing::random_floats(kBatch * kSeq * 32, 2), {kBatch * kSeq, 32});
  Stack fused(kLayers, options_of(GetParam(), Recompute::none), shape, 16),
      split(kLayers, options_of(GetParam(), Recompute::none), shape, 16);
  Tensor dx_fused = run(fused, x, dy, false);
  Tensor dx_split = run(split, x, dy, true);
  EXPECT_TRUE(bitwise_equal(dx_fused, dx_split));
  EXPECT_TRUE(bitwise_equal(fused.store.grads(), split.store.grads()));
}

TEST_P(LayerContract, RecomputePoliciesGiveIdenticalGradients) {
  const auto shape = small_shape();
  Tensor x = from_vector(testing::random_floats(kBatch * kSeq * 32, 3), {kBatch * kSeq, 32});
  Tensor dy = from_vector(testing::random_floats(kBatch * kSeq * 32, 4), {kBatch * kSeq, 32});
  Stack reference(kLayers, options_of(GetParam(), Recompute::none), shape, 16);
  Tensor dx_ref = run(reference, x, dy, false);
  for (Recompute policy : {Recompute::selective, Recompute::full}) {
    Stack s(kLayers, options_of(GetParam(), policy), shape, 16);
    Tensor dx = run(s, x, dy, true);
    EXPECT_TRUE(bitwise_equal(dx, dx_ref)) << recompute_name(policy);
    EXPECT_TRUE(bitwise_equal(s.store.grads(), reference.store.grads())) << recompute_name(policy);
  }
  // Selective recompute of chosen modules: the norms alone (their outputs rebuilt before each part's
  // backward), the activation alone, every module.
  for (const char* modules : {"norm", "mlp_act", "core_attn,mlp_act,norm"}) {
    ComputeOptions o = options_of(GetParam(), Recompute::selective);
    o.recompute_modules = recompute_modules_from_names(modules);
    Stack s(kLayers, o, shape, 16);
    Tensor dx = run(s, x, dy, true);
    EXPECT_TRUE(bitwise_equal(dx, dx_ref)) << modules;
    EXPECT_TRUE(bitwise_equal(s.store.grads(), reference.store.grads())) << modules;
  }
}

INSTANTIATE_TEST_SUITE_P(GemmDtypes, LayerContract,
                         ::testing::Values(Dtypes{DType::f32, DType::f32}, Dtypes{DType::bf16, DType::f32},
                                           Dtypes{DType::bf16, DType::bf16},
                                           Dtypes{DType::bf16, DType::bf16, DType::bf16}),
                         [](const ::testing::TestParamInfo<Dtypes>& info) {
                           return std::string(dtype_name(info.param.gemm)) + "_activations_" +
                                  std::string(dtype_name(info.param.activation)) + "_residual_" +
                                  std::string(dtype_name(info.param.residual));
                         });

// bf16 activations measured against what bf16 GEMMs already cost. Both round activations to bf16 (unit
// roundoff 2^-9): bf16 GEMMs round each Linear's x and dy operands (eight activation roundings in the layer's
// four Linears, plus the weights). bf16 activations add eight where a tensor was fp32 and no GEMM rounded it
// anyway: the gate|up projection and q|k|v (again after RoPE), the parts' outputs (o and down projections),
// and in backward the input gradients of all four Linears and the core's dq|dk|dv after RoPE's inverse (the
// GLU's and the core's outputs, the norms' outputs and the parts' output gradients were rounded for their
// GEMMs already). Errors that small propagate linearly, so added roundings no more and no larger than the
// GEMMs' own can at most double the distance from the exact fp32 layer (triangle inequality; sqrt(2) if
// independent): bounded by 2x, normwise, for the input gradient and the weight gradients. A bf16 residual
// stream adds four more (the two sums in forward, the two in backward): 2.5x. Measured here: 1.10x and 1.22x
// (weights) with bf16 activations, 1.12x and 1.22x with the bf16 stream too.
// The saved gate|up and q|k|v take half the bytes, and the core's output is kept once, as the o-projection's
// bf16 operand (fp32 activations keep it twice: fp32 for the core's backward, bf16 for the GEMM).
TEST(LayerActivations, Bf16CostsNoMoreThanBf16Gemms) {
  const auto shape = small_shape();
  Tensor x = from_vector(testing::random_floats(kBatch * kSeq * 32, 7), {kBatch * kSeq, 32});
  Tensor dy = from_vector(testing::random_floats(kBatch * kSeq * 32, 8), {kBatch * kSeq, 32});
  Stack exact(kLayers, options_of({DType::f32, DType::f32}, Recompute::none), shape, 16);
  Stack fp32(kLayers, options_of({DType::bf16, DType::f32}, Recompute::none), shape, 16);
  Stack bf16(kLayers, options_of({DType::bf16, DType::bf16}, Recompute::none), shape, 16);
  Stack stream16(kLayers, options_of({DType::bf16, DType::bf16, DType::bf16}, Recompute::none), shape, 16);
  const Tensor dx = run(exact, x, dy, false), dx32 = run(fp32, x, dy, false), dx16 = run(bf16, x, dy, false);
  const Tensor dxs = run(stream16, x, dy, false);
  const auto error = [](const Tensor& a, const Tensor& b) {
    return testing::normwise_error(a.f32(), b.f32(), static_cast<size_t>(a.numel()));
  };
  const double gemms = error(dx32, dx), all = error(dx16, dx);
  const double gemms_w = error(fp32.store.grads(), exact.store.grads());
  const double all_w = error(bf16.store.grads(), exact.store.grads());
  const double stream = error(dxs, dx), stream_w = error(stream16.store.grads(), exact.store.grads());
  std::printf(
      "from the fp32 layer: bf16 GEMMs %.2e (weights %.2e), bf16 activations %.2e (%.2e), and a bf16 "
      "residual "
      "stream %.2e (%.2e)\n",
      gemms, gemms_w, all, all_w, stream, stream_w);
  EXPECT_GT(error(dx16, dx32), 0) << "bf16 activations changed nothing: are the layers still fp32?";
  EXPECT_LT(all, 2 * gemms);
  EXPECT_LT(all_w, 2 * gemms_w);
  EXPECT_LT(stream, 2.5 * gemms);
  EXPECT_LT(stream_w, 2.5 * gemms_w);

  DecoderLayer::Saved s32, s16;
  (void)fp32.layers[0].forward(x, kBatch, kSeq, s32);
  (void)bf16.layers[0].forward(x, kBatch, kSeq, s16);
  const auto& mlp32 = static_cast<const Mlp::Saved&>(*s32.ffn);
  const auto& mlp16 = static_cast<const Mlp::Saved&>(*s16.ffn);
  EXPECT_EQ(mlp32.gate_up.dtype(), DType::f32);
  EXPECT_EQ(mlp16.gate_up.dtype(), DType::bf16);
  EXPECT_EQ(2 * mlp16.gate_up.bytes(), mlp32.gate_up.bytes());
  const auto& attention32 = static_cast<const Attention::Saved&>(*s32.mixer);
  const auto& attention16 = static_cast<const Attention::Saved&>(*s16.mixer);
  EXPECT_EQ(attention16.qkv.dtype(), DType::bf16);
  EXPECT_EQ(2 * attention16.qkv.bytes(), attention32.qkv.bytes());
  EXPECT_EQ(attention32.out.dtype(), DType::f32);
  EXPECT_EQ(attention32.out_op.data.dtype(), DType::bf16);          // a second copy, for the GEMM
  EXPECT_EQ(attention16.out.raw(), attention16.out_op.data.raw());  // one bf16 tensor for both
}

// Peak activation memory (allocator peak during forward+backward minus what was live before) must drop
// from none to selective to full; the numbers are printed for the record.
TEST(LayerMemory, RecomputeLowersPeakActivationMemory) {
  LayerShape shape;
  shape.attention = {128, 4, 2, 32};
  shape.ffn = 384;
  const int64_t batch = 4, seq = 128, layers = 4, rows = batch * seq;
  Tensor x = from_vector(testing::random_floats(rows * 128, 5), {rows, 128});
  Tensor dy = from_vector(testing::random_floats(rows * 128, 6), {rows, 128});
  int64_t peaks[4];
  int i = 0;
  // The fourth: selective with the norms' outputs recomputed too.
  for (Recompute policy : {Recompute::none, Recompute::selective, Recompute::selective, Recompute::full}) {
    ComputeOptions o{DType::bf16, policy};
    if (i == 2) o.recompute_modules = recompute_modules_from_names("core_attn,mlp_act,norm");
    Stack s(layers, o, shape, seq);
    int64_t live = memory_stats().live_bytes;
    reset_peak_memory();
    std::vector<DecoderLayer::Saved> saved(layers);
    Tensor h = x;
    for (int l = 0; l < layers; ++l) h = s.layers[l].forward(h, batch, seq, saved[l]);
    Tensor g = dy;
    for (int l = layers; l-- > 0;) {
      g = s.layers[l].backward_input(g, batch, seq, saved[l]);
      s.layers[l].backward_weight(saved[l]);
    }
    peaks[i++] = memory_stats().peak_bytes - live;
    std::printf("recompute %-9s%s peak activation memory %.2f MiB (4 layers, %lld tokens, hidden 128)\n",
                std::string(recompute_name(policy)).c_str(), i == 3 ? " + norm" : "",
                peaks[i - 1] / 1048576.0, static_cast<long long>(rows));
  }
  EXPECT_GT(peaks[0], peaks[1]);
  EXPECT_GT(peaks[1], peaks[2]);
  EXPECT_GT(peaks[2], peaks[3]);
}

// Hidden dropout at rate 0.3 over the test's micro-batch: samples from 40, every position its own.
ComputeOptions with_dropout(ComputeOptions o) {
  o.hidden_dropout = 0.3f, o.dropout_seed = 99;
  return o;
}
DropoutRows training_rows(int64_t seq) {
  DropoutRows rows;
  rows.first_sample = 40, rows.seq = seq;
  return rows;
}

// Central finite differences (in fp32, on a smooth layer) against the analytic gradients of
// L = <w, layer(x)> for the input and a sample of every parameter. Tolerance 2e-2 relative: fp32 FD noise.
// With hidden dropout the layer is still a smooth function for a given mask (the micro-batch's), which
// forward and backward must both apply.
void expect_gradients_match_finite_differences(float dropout) {
  const auto shape = small_shape();
  const int64_t batch = 1, seq = 5, rows = batch * seq;
  ComputeOptions options{DType::f32, Recompute::none};
  DropoutRows where;
  if (dropout > 0)
    options = with_dropout(options), options.hidden_dropout = dropout, where = training_rows(seq);
  Stack s(1, options, shape, 8);
  auto xv = testing::random_floats(rows * 32, 7);
  auto wv = testing::random_floats(rows * 32, 8);
  Tensor x = from_vector(xv, {rows, 32}), w = from_vector(wv, {rows, 32});
  auto loss = [&](const Tensor& input) {
    DecoderLayer::Saved saved;
    saved.dropout = where;
    Tensor y = s.layers[0].forward(input, batch, seq, saved);
    double total = 0;
    for (int64_t i = 0; i < y.numel(); ++i) total += double(y.f32()[i]) * wv[i];
    return total;
  };
  s.store.zero_grads();
  DecoderLayer::Saved saved;
  saved.dropout = where;
  s.layers[0].forward(x, batch, seq, saved);
  Tensor dx = s.layers[0].backward_input(w, batch, seq, saved);
  s.layers[0].backward_weight(saved);

  const float h = 1e-2f;
  auto check = [&](float* value, float analytic, const std::string& what) {
    float saved_value = *value;
    *value = saved_value + h;
    double up = loss(x);
    *value = saved_value - h;
    double down = loss(x);
    *value = saved_value;
    double numeric = (up - down) / (2 * h);
    EXPECT_NEAR(analytic, numeric, 2e-2 * std::max(1.0, std::abs(numeric))) << what;
  };
  for (int64_t i = 0; i < x.numel(); i += 7) check(x.f32() + i, dx.f32()[i], "x[" + std::to_string(i) + "]");
  for (const auto& info : s.store.infos()) {
    int64_t n = shape_numel(info.shape);
    for (int64_t i = 0; i < n; i += std::max<int64_t>(1, n / 5))
      check(s.store.params().f32() + info.offset + i, s.store.grads().f32()[info.offset + i],
            info.name + "[" + std::to_string(i) + "]");
  }
}

TEST(LayerGradients, MatchFiniteDifferences) { expect_gradients_match_finite_differences(0.0f); }
TEST(LayerGradients, MatchFiniteDifferencesUnderHiddenDropout) {
  expect_gradients_match_finite_differences(0.3f);
}

// Hidden dropout acts on training micro-batches only: with rows that are not a training micro-batch's the
// layers give the no-dropout results bit for bit, with a training micro-batch's they do not; and full
// recompute draws the same masks again in backward (bitwise the gradients of keeping everything).
TEST(LayerDropout, TrainingOnlyAndRecomputedAlike) {
  const auto shape = small_shape();
  Tensor x = from_vector(testing::random_floats(kBatch * kSeq * 32, 5), {kBatch * kSeq, 32});
  Tensor dy = from_vector(testing::random_floats(kBatch * kSeq * 32, 6), {kBatch * kSeq, 32});
  Stack plain(kLayers, {DType::f32, Recompute::none}, shape, 16);
  const Tensor dx_plain = run(plain, x, dy, false);
  Stack evaluating(kLayers, with_dropout({DType::f32, Recompute::none}), shape, 16);
  EXPECT_TRUE(bitwise_equal(run(evaluating, x, dy, false), dx_plain));
  EXPECT_TRUE(bitwise_equal(evaluating.store.grads(), plain.store.grads()));
  Stack training(kLayers, with_dropout({DType::f32, Recompute::none}), shape, 16);
  const Tensor dx_training = run(training, x, dy, false, training_rows(kSeq));
  EXPECT_FALSE(bitwise_equal(dx_training, dx_plain));
  for (Recompute policy : {Recompute::selective, Recompute::full}) {
    Stack s(kLayers, with_dropout({DType::f32, policy}), shape, 16);
    EXPECT_TRUE(bitwise_equal(run(s, x, dy, true, training_rows(kSeq)), dx_training))
        << recompute_name(policy);
    EXPECT_TRUE(bitwise_equal(s.store.grads(), training.store.grads())) << recompute_name(policy);
  }
}

}  // namespace
}  // namespace forge::nn::decoder_layer_test
