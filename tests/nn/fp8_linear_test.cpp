// FP8 Linear: the three GEMMs of each recipe against a double-precision reference built here from the scalar
// FP8 conversions of core (independent of fp8/quantize.cpp): every operand fake-quantised tile by tile (a
// whole tensor, 1x128 tiles along either dimension, 128x128 blocks), then multiplied in double. Also: the
// delayed recipe's scales follow the recorded amaxes step to step, the FP8 weight is cast once per weight
// version, inputs saved in the GEMM dtype give the same gradients as inputs saved in FP8, and what the saved
// operands cost in bytes. The current recipe, whose scales now live in the operands' device memory, is
// checked bitwise against the host-scale ops it used before (amax on the host, compute_scale, the cast and
// GEMMs with host values), with a tensor-parallel group max-reducing the weight's amax.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/ops.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/linear.h"
#include "forge/nn/tensor_parallel.h"
#include "fp8_fake_quantize.h"

namespace forge::nn::fp8_linear_test {
namespace {

using fp8::Recipe;

// Dimensions that leave partial tiles on every edge.
constexpr int64_t kRows = 160, kIn = 200, kOut = 136;

std::vector<float> random_matrix(int64_t n, float std, uint32_t seed, bool outliers) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, std);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(gen);
  if (outliers)  // a few large values, as activations have: per-tensor scales lose the small ones
    for (int64_t i = 0; i < n; i += 997) v[static_cast<size_t>(i)] *= 40.0f;
  return v;
}

Tensor to_tensor(const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

using testing::fake_quantize;

// C [m, n] = A [m, k] op B, with B [n, k] (b_nk) or [k, n].
std::vector<double> matmul(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n,
                           int64_t k, bool b_nk) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += a[i * k + p] * (b_nk ? b[j * k + p] : b[p * n + j]);
      c[i * n + j] = s;
    }
  return c;
}

std::vector<double> transpose(const std::vector<double>& m, int64_t rows, int64_t cols) {
  std::vector<double> t(m.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = m[r * cols + c];
  return t;
}
std::vector<float> transpose(const std::vector<float>& m, int64_t rows, int64_t cols) {
  std::vector<float> t(m.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = m[r * cols + c];
  return t;
}

// Max |got - want| over the largest |want|: the products are exact in fp32 (FP8 x FP8 fits), so only the
// fp32 accumulation order separates the two.
double relative_error(const float* got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return err / scale;
}

struct Fixture {
  ParameterStore store;
  Fp8Context context;
  Linear linear;
  std::vector<float> w, x, dy;

  explicit Fixture(Fp8Options options, DType gemm_dtype = DType::f32, TensorParallel* tp = nullptr)
      : context(options) {
    store.add("w", {kOut, kIn}, true, Init::normal);
    store.allocate(gemm_dtype == DType::bf16);
    w = random_matrix(kOut * kIn, 0.05f, 1, false);
    std::copy(w.begin(), w.end(), store.params().f32());
    store.refresh_bf16();
    ComputeOptions compute;
    compute.gemm_dtype = gemm_dtype;
    compute.fp8 = &context;
    compute.tp = tp;
    linear = Linear(&store, {0}, kIn, compute);
    context.seal();
    x = random_matrix(kRows * kIn, 1.0f, 2, true);
    dy = random_matrix(kRows * kOut, 1e-4f, 3, true);  // gradients are small: E5M2's range matters
  }

  struct Result {
    Tensor y, dx;
    std::vector<float> dw;
    int64_t saved_input_bytes = 0;
  };
  Result step() {
    const Fp8Recording recording(&context, true);
    Result r;
    Tensor xt = to_tensor(x, {kRows, kIn}), dyt = to_tensor(dy, {kRows, kOut});
    GemmOperand xo = linear.input(xt);
    r.y = linear.forward(xo);
    r.saved_input_bytes = xo.bytes();
    GemmOperand dyo = linear.grad_output(dyt);
    r.dx = linear.backward_input(dyo);
    store.zero_grads();
    linear.backward_weight(dyo, xo);
    r.dw.assign(store.grads().f32(), store.grads().f32() + kOut * kIn);
    return r;
  }
};

Fp8Options options_for(Recipe recipe, fp8::Format format = fp8::Format::hybrid) {
  Fp8Options o;
  o.recipe.recipe = recipe;
  o.recipe.format = format;
  o.recipe.amax_history_len = 4;
  return o;
}

TEST(Fp8Linear, CurrentScalingMatchesFakeQuantisedReference) {
  Fixture f(options_for(Recipe::current));
  const Fixture::Result r = f.step();
  const DType e4 = DType::e4m3, e5 = DType::e5m2;
  // Per-tensor: one tile per tensor. Forward operands E4M3, the output gradient E5M2 (hybrid).
  const auto xq = fake_quantize(f.x, kRows, kIn, kRows, kIn, e4, false);
  const auto wq = fake_quantize(f.w, kOut, kIn, kOut, kIn, e4, false);
  const auto dyq = fake_quantize(f.dy, kRows, kOut, kRows, kOut, e5, false);
  EXPECT_LT(relative_error(r.y.f32(), matmul(xq, wq, kRows, kOut, kIn, true)), 1e-5);
  EXPECT_LT(relative_error(r.dx.f32(), matmul(dyq, wq, kRows, kIn, kOut, false)), 1e-5);
  EXPECT_LT(relative_error(r.dw.data(), matmul(transpose(dyq, kRows, kOut), xq, kOut, kIn, kRows, false)),
            1e-5);
}

TEST(Fp8Linear, BlockScalingMatchesFakeQuantisedReference) {
  Fixture f(options_for(Recipe::block, fp8::Format::e4m3));
  const Fixture::Result r = f.step();
  const DType e4 = DType::e4m3;
  // Forward and input gradient: 1x128 tiles along K (the features), 128x128 weight blocks.
  const auto xq = fake_quantize(f.x, kRows, kIn, 1, 128, e4, true);
  const auto wq = fake_quantize(f.w, kOut, kIn, 128, 128, e4, true);
  const auto dyq = fake_quantize(f.dy, kRows, kOut, 1, 128, e4, true);
  EXPECT_LT(relative_error(r.y.f32(), matmul(xq, wq, kRows, kOut, kIn, true)), 1e-5);
  EXPECT_LT(relative_error(r.dx.f32(), matmul(dyq, wq, kRows, kIn, kOut, false)), 1e-5);
  // Weight gradient: K is the tokens, so dy^T and x^T are quantised in 1x128 tiles along the tokens.
  const auto dyt_q = fake_quantize(transpose(f.dy, kRows, kOut), kOut, kRows, 1, 128, e4, true);
  const auto xt_q = fake_quantize(transpose(f.x, kRows, kIn), kIn, kRows, 1, 128, e4, true);
  EXPECT_LT(relative_error(r.dw.data(), matmul(dyt_q, xt_q, kOut, kIn, kRows, true)), 1e-5);
}

TEST(Fp8Linear, BlockScalingBeatsPerTensorOnOutliers) {
  // The tile scales keep the small values that one per-tensor scale (set by the outliers) flushes.
  auto error_vs_exact = [](Recipe recipe) {
    Fixture f(options_for(recipe, fp8::Format::e4m3));
    const Fixture::Result r = f.step();
    std::vector<double> xd(f.x.begin(), f.x.end()), wd(f.w.begin(), f.w.end());
    return relative_error(r.y.f32(), matmul(xd, wd, kRows, kOut, kIn, true));
  };
  const double block = error_vs_exact(Recipe::block), current = error_vs_exact(Recipe::current);
  EXPECT_LT(block, current);
  EXPECT_LT(block, 0.1);  // max error over max |y|: E4M3 keeps 3 mantissa bits
}

TEST(Fp8Linear, DelayedScalingUsesThePreviousStepsAmaxes) {
  Fixture f(options_for(Recipe::delayed));
  // Step 1: no history yet, every scale is 1 (TransformerEngine's initial scale).
  Fixture::Result first = f.step();
  const DType e4 = DType::e4m3, e5 = DType::e5m2;
  {
    const auto xq = fake_quantize(f.x, kRows, kIn, kRows, kIn, e4, false, 1.0f);
    const auto wq = fake_quantize(f.w, kOut, kIn, kOut, kIn, e4, false, 1.0f);
    EXPECT_LT(relative_error(first.y.f32(), matmul(xq, wq, kRows, kOut, kIn, true)), 1e-5);
  }
  // The amaxes recorded during step 1 are those of x, W and dy.
  std::span<float> amaxes = f.context.step_amaxes();
  ASSERT_EQ(amaxes.size(), 3u);
  auto amax_of = [](const std::vector<float>& v) {
    float a = 0;
    for (float x : v) a = std::max(a, std::fabs(x));
    return a;
  };
  EXPECT_EQ(amaxes[0], amax_of(f.x));
  EXPECT_EQ(amaxes[1], amax_of(f.w));
  EXPECT_EQ(amaxes[2], amax_of(f.dy));
  f.context.end_step();
  // Step 2 (new data, same weights) is scaled by step 1's amaxes.
  const float sx = 448.0f / amax_of(f.x), sw = 448.0f / amax_of(f.w), sdy = 57344.0f / amax_of(f.dy);
  f.x = random_matrix(kRows * kIn, 0.5f, 7, false);
  f.dy = random_matrix(kRows * kOut, 2e-4f, 8, false);
  Fixture::Result second = f.step();
  const auto xq = fake_quantize(f.x, kRows, kIn, kRows, kIn, e4, false, sx);
  const auto wq = fake_quantize(f.w, kOut, kIn, kOut, kIn, e4, false, sw);
  const auto dyq = fake_quantize(f.dy, kRows, kOut, kRows, kOut, e5, false, sdy);
  EXPECT_LT(relative_error(second.y.f32(), matmul(xq, wq, kRows, kOut, kIn, true)), 1e-5);
  EXPECT_LT(relative_error(second.dx.f32(), matmul(dyq, wq, kRows, kIn, kOut, false)), 1e-5);
  EXPECT_LT(
      relative_error(second.dw.data(), matmul(transpose(dyq, kRows, kOut), xq, kOut, kIn, kRows, false)),
      1e-5);
}

TEST(Fp8Linear, EvaluationDoesNotRecordAmaxes) {
  Fixture f(options_for(Recipe::delayed));
  Tensor xt = to_tensor(f.x, {kRows, kIn});
  GemmOperand xo = f.linear.input(xt);  // recording() is off outside training micro-batches
  f.linear.forward(xo);
  std::span<float> amaxes = f.context.step_amaxes();
  EXPECT_EQ(amaxes[0], 0.0f);
  EXPECT_GT(amaxes[1], 0.0f);  // the weight's amax describes the weights: recorded whenever it is cast
}

// Recording scopes count: an overlapped pair's forward and backward (two fibers, core/fibers.h) open theirs
// and close them in either order, and recording stays on until both are closed (a scope that saved and
// restored the previous value would turn it off under the still-running backward when the forward ends
// first); an off scope (evaluation) mutes it while open.
TEST(Fp8Linear, RecordingScopesEndingInAnyOrderKeepRecording) {
  Fixture f(options_for(Recipe::delayed));
  EXPECT_FALSE(f.context.recording());
  auto forward = std::make_unique<Fp8Recording>(&f.context, true);
  auto backward = std::make_unique<Fp8Recording>(&f.context, true);
  forward.reset();  // the forward ends first
  EXPECT_TRUE(f.context.recording());
  {
    const Fp8Recording evaluation(&f.context, false);
    EXPECT_FALSE(f.context.recording());
  }
  EXPECT_TRUE(f.context.recording());
  backward.reset();
  EXPECT_FALSE(f.context.recording());
}

TEST(Fp8Linear, WeightIsCastOncePerWeightVersion) {
  Fixture f(options_for(Recipe::current));
  EXPECT_EQ(f.context.weight_casts(), 0);
  f.step();
  f.step();  // micro-batches of one step: forward and input gradient share one cast
  EXPECT_EQ(f.context.weight_casts(), 1);
  const Fixture::Result before = f.step();
  // An optimizer step changes the weights and marks the store: the next GEMM casts again.
  for (int64_t i = 0; i < kOut * kIn; ++i) f.store.params().f32()[i] *= 2.0f;
  f.w = std::vector<float>(f.store.params().f32(), f.store.params().f32() + kOut * kIn);
  f.store.mark_updated();
  const Fixture::Result after = f.step();
  EXPECT_EQ(f.context.weight_casts(), 2);
  // Doubling W doubles its per-tensor scale's inverse: the FP8 codes are the same, y doubles exactly.
  for (int64_t i = 0; i < kRows * kOut; ++i) ASSERT_EQ(after.y.f32()[i], 2.0f * before.y.f32()[i]) << i;
}

class Fp8LinearSavedInputs : public ::testing::TestWithParam<Recipe> {};

TEST_P(Fp8LinearSavedInputs, GemmDtypeInputsGiveTheSameGradientsAndCostMore) {
  Fp8Options saved_fp8 = options_for(GetParam(), fp8::Format::hybrid);
  Fp8Options saved_high = saved_fp8;
  saved_high.save_fp8_inputs = false;
  Fixture a(saved_fp8), b(saved_high);  // fp32 GEMM dtype: the re-cast reads the exact input
  const Fixture::Result ra = a.step(), rb = b.step();
  for (int64_t i = 0; i < kOut * kIn; ++i)
    ASSERT_EQ(ra.dw[static_cast<size_t>(i)], rb.dw[static_cast<size_t>(i)]);
  // FP8 codes: one byte per element (plus tile scales under the block recipe); fp32: four. The current recipe
  // keeps amax, scale and scale_inv (three floats) with either.
  const int64_t elements = kRows * kIn;
  const int64_t scales = GetParam() == Recipe::current ? kScaleFloats * 4 : 0;
  EXPECT_EQ(rb.saved_input_bytes, 4 * elements + scales);
  const int64_t tiles = GetParam() == Recipe::block ? kIn * ((kRows + 127) / 128) * 4 : 0;
  EXPECT_EQ(ra.saved_input_bytes, elements + tiles + scales);
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8LinearSavedInputs,
                         ::testing::Values(Recipe::delayed, Recipe::current, Recipe::block),
                         [](const auto& info) { return std::string(fp8::recipe_name(info.param)); });

TEST(Fp8Linear, LimitedAccumulatorChangesTheResultSlightly) {
  Fp8Options exact = options_for(Recipe::current), limited = exact;
  limited.accumulator_bits = 10;
  Fixture a(exact), b(limited);
  const Fixture::Result ra = a.step(), rb = b.step();
  std::vector<double> want(ra.y.f32(), ra.y.f32() + kRows * kOut);
  const double err = relative_error(rb.y.f32(), want);
  EXPECT_GT(err, 0.0);
  EXPECT_LT(err, 1e-2);
}

// forward_fast_accumulation (TransformerEngine's default) makes the forward GEMM accumulate without
// promotion, and leaves the gradient GEMMs promoting: under the accumulator model, y is that of a Linear that
// never promotes, dx and dW those of one that promotes every promote_every.
TEST(Fp8Linear, FastAccumulationIsTheForwardsOnly) {
  Fp8Options fast = options_for(Recipe::current);
  fast.accumulator_bits = 10, fast.promote_every = 32;
  ASSERT_TRUE(fast.forward_fast_accumulation);  // the default
  Fp8Options promoting = fast, never = fast;
  promoting.forward_fast_accumulation = never.forward_fast_accumulation = false;
  never.promote_every = 0;
  Fixture a(fast), b(promoting), c(never);
  const Fixture::Result ra = a.step(), rb = b.step(), rc = c.step();
  auto floats = [](const Tensor& t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); };
  EXPECT_EQ(floats(ra.y), floats(rc.y));
  EXPECT_NE(floats(ra.y), floats(rb.y));
  EXPECT_EQ(floats(ra.dx), floats(rb.dx));
  EXPECT_EQ(ra.dw, rb.dw);
}

// ---------------------------------------------------------------------------------------------------------------
// The current recipe against the host-scale path it replaced, bit for bit.

// A tensor-parallel group of two ranks as the weight cast sees it: all_reduce_max folds in the other rank's
// amax; everything else is unused here.
class FakeTensorParallel : public TensorParallel {
 public:
  explicit FakeTensorParallel(float other_amax) : other_amax_(other_amax) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  bool sequence_parallel() const override { return false; }
  void all_reduce_sum(float*, int64_t, Device) override { ADD_FAILURE() << "all_reduce_sum"; }
  void all_reduce_max(float* buf, int64_t count, Device where) override {
    EXPECT_EQ(count, 1);
    EXPECT_EQ(where, Device::cpu);  // the Linears' device: device memory on a GPU
    buf[0] = std::isnan(buf[0]) ? buf[0] : std::max(buf[0], other_amax_);
    ++calls;
  }
  void all_gather(const float*, float*, int64_t, Device) override { ADD_FAILURE() << "all_gather"; }
  Tensor all_gather_rows(const Tensor& shard) override { return shard; }
  Tensor reduce_scatter_rows(const Tensor& full) override { return full; }
  int calls = 0;

 private:
  float other_amax_;
};

struct HostScaleCast {
  std::vector<uint8_t> q, q_t;
  float scale_inv = 1.0f;
};

// Today's path before the change: amax on the host, compute_scale, the cast with that host scale.
HostScaleCast host_scale_cast(const std::vector<float>& x, int64_t rows, int64_t cols, DType dtype,
                              int margin, float other_amax = 0.0f) {
  float amax = ops::amax(x.data(), rows * cols);
  if (!std::isnan(amax)) amax = std::max(amax, other_amax);
  const float scale = fp8::compute_scale(amax, fp8::fp8_max(dtype), margin, 1.0f);
  HostScaleCast r;
  r.q.resize(x.size()), r.q_t.resize(x.size());
  ops::Fp8CastParams p;
  p.rows = rows, p.cols = cols, p.x = x.data(), p.fp8 = dtype, p.scale = scale, p.q = r.q.data(),
  p.q_t = r.q_t.data();
  ops::fp8_cast_transpose(p);
  r.scale_inv = 1.0f / scale;
  return r;
}

// C [m, n] = A [m, k] B [n, k]^T (+ beta * 0, as the weight gradient accumulates) with host scale values.
std::vector<float> host_scale_gemm(const HostScaleCast& a, const std::vector<uint8_t>& a_codes, DType a_dtype,
                                   const HostScaleCast& b, const std::vector<uint8_t>& b_codes, DType b_dtype,
                                   int64_t m, int64_t n, int64_t k, float beta = 0.0f) {
  std::vector<float> c(static_cast<size_t>(m * n), 0.0f);
  ops::Fp8GemmParams p;
  p.m = m, p.n = n, p.k = k;
  p.a = a_codes.data(), p.lda = k, p.a_dtype = a_dtype;
  p.b = b_codes.data(), p.ldb = k, p.trans_b = true, p.b_dtype = b_dtype;
  p.c = c.data(), p.ldc = n, p.beta = beta;
  p.a_scale_inv = a.scale_inv, p.b_scale_inv = b.scale_inv;
  ops::fp8_gemm(p);
  return c;
}

void expect_same_bits(const float* got, const std::vector<float>& want, const std::string& what) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]) && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << want.size() << " differ; first at " << first << ": "
                     << got[first] << " vs " << want[first];
}

struct CurrentCase {
  int margin = 0;
  bool save_fp8_inputs = true;
  int special = 0;  // 1: a NaN in x; 2: dy all zero (amax 0); 3: a weight amax from the other tp rank
};

void check_current_against_host_scales(const CurrentCase& c) {
  Fp8Options options = options_for(Recipe::current);
  options.recipe.margin = c.margin;
  options.save_fp8_inputs = c.save_fp8_inputs;
  const float other_amax = c.special == 3 ? 7.5f : 0.0f;  // W's own amax is ~0.25
  FakeTensorParallel tp(other_amax);
  Fixture f(options, DType::f32, c.special == 3 ? &tp : nullptr);
  if (c.special == 1) f.x[kIn * 3 + 5] = std::numeric_limits<float>::quiet_NaN();
  if (c.special == 2) std::fill(f.dy.begin(), f.dy.end(), 0.0f);
  const Fixture::Result r = f.step();
  const std::string what = "margin " + std::to_string(c.margin) +
                           (c.save_fp8_inputs ? " fp8 inputs" : " fp32 inputs") + " case " +
                           std::to_string(c.special);
  if (c.special == 3) {
    EXPECT_EQ(tp.calls, 1) << what;
  }

  const DType e4 = DType::e4m3, e5 = DType::e5m2;
  const HostScaleCast x = host_scale_cast(f.x, kRows, kIn, e4, c.margin);
  const HostScaleCast w = host_scale_cast(f.w, kOut, kIn, e4, c.margin, other_amax);
  const HostScaleCast dy = host_scale_cast(f.dy, kRows, kOut, e5, c.margin);
  expect_same_bits(r.y.f32(), host_scale_gemm(x, x.q, e4, w, w.q, e4, kRows, kOut, kIn), what + ": y");
  expect_same_bits(r.dx.f32(), host_scale_gemm(dy, dy.q, e5, w, w.q_t, e4, kRows, kIn, kOut), what + ": dx");
  expect_same_bits(r.dw.data(), host_scale_gemm(dy, dy.q_t, e5, x, x.q_t, e4, kOut, kIn, kRows, 1.0f),
                   what + ": dw");
  // The weight's codes and scales where the GEMMs read them.
  const Fp8Weight& fw = f.context.weight(0);
  EXPECT_EQ(0, std::memcmp(fw.q.data<uint8_t>(), w.q.data(), w.q.size())) << what;
  EXPECT_EQ(std::bit_cast<uint32_t>(fw.scales.f32()[kScaleInv]), std::bit_cast<uint32_t>(w.scale_inv))
      << what;
  EXPECT_EQ(1.0f / fw.scales.f32()[kScale], w.scale_inv) << what;
}

TEST(Fp8LinearCurrentScaling, BitwiseTheHostScalePath) { check_current_against_host_scales({}); }
TEST(Fp8LinearCurrentScaling, BitwiseWithMargin) { check_current_against_host_scales({.margin = 3}); }
TEST(Fp8LinearCurrentScaling, BitwiseWithInputsRecastInBackward) {
  check_current_against_host_scales({.margin = 1, .save_fp8_inputs = false});
}
TEST(Fp8LinearCurrentScaling, BitwiseWithANaNInput) { check_current_against_host_scales({.special = 1}); }
TEST(Fp8LinearCurrentScaling, BitwiseWithAZeroGradient) {
  check_current_against_host_scales({.save_fp8_inputs = false, .special = 2});
}
TEST(Fp8LinearCurrentScaling, WeightAmaxIsReducedOverTheTensorParallelGroup) {
  check_current_against_host_scales({.margin = 2, .special = 3});
}

// The operand carries its scales as a small tensor on its device; the host floats stay those of a delayed
// cast.
TEST(Fp8LinearCurrentScaling, OperandsCarryTheirScalesOnTheirDevice) {
  Fixture f(options_for(Recipe::current));
  Tensor xt = to_tensor(f.x, {kRows, kIn});
  const GemmOperand xo = f.linear.input(xt);
  ASSERT_TRUE(xo.scales.defined());
  EXPECT_EQ(xo.scales.numel(), kScaleFloats);
  EXPECT_EQ(xo.scales.device(), Device::cpu);
  float amax = 0;
  for (float v : f.x) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(xo.scales.f32()[kAmax], amax);
  EXPECT_EQ(xo.scales.f32()[kScale], fp8::compute_scale(amax, 448.0f, 0, 1.0f));
  EXPECT_EQ(xo.scales.f32()[kScaleInv], 1.0f / xo.scales.f32()[kScale]);
  Fixture d(options_for(Recipe::delayed));
  EXPECT_FALSE(d.linear.input(xt).scales.defined());
}

TEST(Fp8Context, RefusesBadOptionsAndLateRegistration) {
  Fp8Options bad = options_for(Recipe::block);
  bad.accumulator_bits = 8;
  bad.promote_every = 96;
  EXPECT_THROW({ Fp8Context c(bad); }, Error);
  bad = options_for(Recipe::current);
  bad.accumulator_bits = 30;
  EXPECT_THROW({ Fp8Context c(bad); }, Error);
  bad = options_for(Recipe::delayed);
  bad.recipe.amax_history_len = 0;
  EXPECT_THROW({ Fp8Context c(bad); }, Error);
  Fp8Context c(options_for(Recipe::delayed));
  c.add_linear("a");
  c.seal();
  EXPECT_THROW(c.add_linear("b"), Error);
  EXPECT_EQ(c.step_amaxes().size(), 3u);
}

TEST(Fp8Context, OnlyDelayedScalingKeepsAHistory) {
  for (Recipe r : {Recipe::current, Recipe::block}) {
    Fp8Context c(options_for(r));
    c.add_linear("a");
    EXPECT_TRUE(c.step_amaxes().empty());
    EXPECT_EQ(c.delayed_group(), nullptr);
    c.end_step();  // a no-op
  }
}

}  // namespace
}  // namespace forge::nn::fp8_linear_test
