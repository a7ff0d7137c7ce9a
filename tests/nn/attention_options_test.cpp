// nn::Attention's per-layer options against a double-precision reference written out below: QK-norm (an
// RMSNorm over head_dim on every q and k head before RoPE, Qwen3) and the sliding window (each query sees
// the `window` latest keys, itself included, Mistral), alone and together, with head_dim unequal to
// hidden / heads. The forward within fp32 rounding, and the module's input and parameter gradients (B then
// W) against central finite differences of the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "forge/kernels/rope_tables.h"
#include "forge/nn/attention.h"
#include "op_harness.h"

namespace forge::nn::attention_options_test {
namespace {

constexpr int64_t kBatch = 2, kSeq = 7, kHidden = 16, kHeads = 4, kKvHeads = 2, kDim = 6;
constexpr double kEps = 1e-6, kTheta = 10000.0;

struct Options {
  bool qk_norm;
  int64_t window;
  std::string name() const {
    return (qk_norm ? "qknorm" : "plain") + std::string("_window") + std::to_string(window);
  }
};

struct Module {
  ParameterStore store;
  AttentionParams ids;
  RopeTable rope;
  Attention attention;
  explicit Module(const Options& o) {
    ids.q = store.add("q", {kHeads * kDim, kHidden}, true, Init::normal, 0.3f);
    ids.k = store.add("k", {kKvHeads * kDim, kHidden}, true, Init::normal, 0.3f);
    ids.v = store.add("v", {kKvHeads * kDim, kHidden}, true, Init::normal, 0.3f);
    ids.o = store.add("o", {kHidden, kHeads * kDim}, true, Init::normal, 0.3f);
    if (o.qk_norm) {
      ids.q_norm = store.add("q_norm", {kDim}, false, Init::ones);
      ids.k_norm = store.add("k_norm", {kDim}, false, Init::ones);
    }
    ids.norm_eps = static_cast<float>(kEps), ids.window = o.window;
    store.allocate(false);
    store.initialize(5);
    for (const auto& info : store.infos())  // norm weights away from 1, so their gradients show
      if (info.shape.size() == 1)
        for (int64_t i = 0; i < info.shape[0]; ++i)
          store.params().f32()[info.offset + i] = 1.0f + 0.15f * static_cast<float>(i % 5) - 0.2f;
    rope.positions = kSeq, rope.half_dim = kDim / 2;
    rope.cos = Tensor::empty({kSeq, kDim / 2}, DType::f32);
    rope.sin = Tensor::empty({kSeq, kDim / 2}, DType::f32);
    rope_tables(kSeq, kDim, kTheta, RopeScaling{}, rope.cos.f32(), rope.sin.f32());
    attention =
        Attention(&store, ids, {kHidden, kHeads, kKvHeads, kDim}, &rope, {DType::f32, Recompute::none});
  }
};

// The reference on `all` = [x (rows x hidden) | the store's parameters, flat]: y [rows, hidden].
std::vector<double> reference(const Module& m, const Options& o, const std::vector<double>& all) {
  const int64_t rows = kBatch * kSeq;
  const double* x = all.data();
  auto param = [&](int id) { return all.data() + rows * kHidden + m.store.info(id).offset; };
  auto project = [&](const double* w, int64_t out, const double* in, int64_t width, double* y) {
    for (int64_t r = 0; r < out; ++r) {
      y[r] = 0;
      for (int64_t c = 0; c < width; ++c) y[r] += w[r * width + c] * in[c];
    }
  };
  // q and k per token and head: projected, normed, rotated; v projected.
  std::vector<double> q(rows * kHeads * kDim), k(rows * kKvHeads * kDim), v(rows * kKvHeads * kDim);
  auto norm_and_rotate = [&](double* head, const double* weight, int64_t position) {
    if (weight) {
      double ms = 0;
      for (int64_t i = 0; i < kDim; ++i) ms += head[i] * head[i] / kDim;
      for (int64_t i = 0; i < kDim; ++i) head[i] = weight[i] * head[i] / std::sqrt(ms + kEps);
    }
    for (int64_t i = 0; i < kDim / 2; ++i) {
      const double angle = position * std::pow(kTheta, -2.0 * i / kDim), a = head[i], b = head[i + kDim / 2];
      head[i] = a * std::cos(angle) - b * std::sin(angle);
      head[i + kDim / 2] = b * std::cos(angle) + a * std::sin(angle);
    }
  };
  for (int64_t r = 0; r < rows; ++r) {
    project(param(m.ids.q), kHeads * kDim, x + r * kHidden, kHidden, &q[r * kHeads * kDim]);
    project(param(m.ids.k), kKvHeads * kDim, x + r * kHidden, kHidden, &k[r * kKvHeads * kDim]);
    project(param(m.ids.v), kKvHeads * kDim, x + r * kHidden, kHidden, &v[r * kKvHeads * kDim]);
    for (int64_t h = 0; h < kHeads; ++h)
      norm_and_rotate(&q[(r * kHeads + h) * kDim], o.qk_norm ? param(m.ids.q_norm) : nullptr, r % kSeq);
    for (int64_t g = 0; g < kKvHeads; ++g)
      norm_and_rotate(&k[(r * kKvHeads + g) * kDim], o.qk_norm ? param(m.ids.k_norm) : nullptr, r % kSeq);
  }
  std::vector<double> out(rows * kHeads * kDim), y(rows * kHidden), s(kSeq);
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t t = 0; t < kSeq; ++t)
      for (int64_t h = 0; h < kHeads; ++h) {
        const int64_t g = h / (kHeads / kKvHeads),
                      first = o.window ? std::max<int64_t>(0, t - o.window + 1) : 0;
        const double* qh = &q[((b * kSeq + t) * kHeads + h) * kDim];
        double m_max = -1e300, sum = 0;
        for (int64_t j = first; j <= t; ++j) {
          s[j] = 0;
          for (int64_t i = 0; i < kDim; ++i) s[j] += qh[i] * k[((b * kSeq + j) * kKvHeads + g) * kDim + i];
          s[j] /= std::sqrt(double(kDim)), m_max = std::max(m_max, s[j]);
        }
        for (int64_t j = first; j <= t; ++j) sum += std::exp(s[j] - m_max);
        double* oh = &out[((b * kSeq + t) * kHeads + h) * kDim];
        for (int64_t j = first; j <= t; ++j)
          for (int64_t i = 0; i < kDim; ++i)
            oh[i] += std::exp(s[j] - m_max) / sum * v[((b * kSeq + j) * kKvHeads + g) * kDim + i];
      }
  for (int64_t r = 0; r < rows; ++r)
    project(param(m.ids.o), kHidden, &out[r * kHeads * kDim], kHeads * kDim, &y[r * kHidden]);
  return y;
}

// max |got - want| over max(max |want|, 1e-2): with a window of 1 each query sees only itself, the output
// no longer depends on q and k, and their true gradients are zero (fp32 leaves ~1e-7 of noise; the others are
// O(0.1)).
double gradient_error(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, scale = 1e-2;
  for (size_t i = 0; i < want.size(); ++i)
    diff = std::max(diff, std::abs(got[i] - want[i])), scale = std::max(scale, std::abs(want[i]));
  return diff / scale;
}

class AttentionOptions : public ::testing::TestWithParam<Options> {};

TEST_P(AttentionOptions, MatchesDoubleReferenceAndFiniteDifferences) {
  const Options o = GetParam();
  Module m(o);
  const int64_t rows = kBatch * kSeq;
  const std::vector<float> xv = testing::random_floats(rows * kHidden, 3),
                           wv = testing::random_floats(rows * kHidden, 4);
  Tensor x = Tensor::empty({rows, kHidden}, DType::f32), w = Tensor::empty({rows, kHidden}, DType::f32);
  std::copy(xv.begin(), xv.end(), x.f32()), std::copy(wv.begin(), wv.end(), w.f32());

  m.store.zero_grads();
  Attention::Saved saved;
  const Tensor y = m.attention.forward(x, kBatch, kSeq, saved, true);
  const Tensor dx = m.attention.backward_input(w, kBatch, kSeq, saved);
  m.attention.backward_weight(saved);

  std::vector<double> all = testing::to_double(xv);
  const float* params = m.store.params().f32();
  all.insert(all.end(), params, params + m.store.params().numel());
  EXPECT_LT(testing::relative_error(std::vector<float>(y.f32(), y.f32() + y.numel()), reference(m, o, all)),
            1e-5)
      << o.name() << " forward";

  // d<w, y> by central differences of the double reference (exact to ~1e-9), against B (dx) and W.
  const std::vector<double> wd = testing::to_double(wv);
  const std::vector<double> numeric = testing::finite_difference(
      [&](const std::vector<double>& in) { return testing::dot(wd, reference(m, o, in)); }, all, 1e-6);
  std::vector<float> analytic(dx.f32(), dx.f32() + dx.numel());
  const float* grads = m.store.grads().f32();
  analytic.insert(analytic.end(), grads, grads + m.store.grads().numel());
  EXPECT_LT(testing::relative_error(std::vector<float>(analytic.begin(), analytic.begin() + rows * kHidden),
                                    std::vector<double>(numeric.begin(), numeric.begin() + rows * kHidden)),
            2e-5)
      << o.name() << " dx";
  for (const auto& info : m.store.infos()) {
    const int64_t at = rows * kHidden + info.offset, n = shape_numel(info.shape);
    EXPECT_LT(gradient_error(std::vector<float>(analytic.begin() + at, analytic.begin() + at + n),
                             std::vector<double>(numeric.begin() + at, numeric.begin() + at + n)),
              2e-5)
        << o.name() << " d" << info.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Options, AttentionOptions,
                         ::testing::Values(Options{true, 0}, Options{false, 3}, Options{true, 3},
                                           Options{false, 1}),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace forge::nn::attention_options_test
