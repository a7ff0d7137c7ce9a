// The DeepSeekMoE feed-forward part (nn::Moe) against a double-precision reference of the whole layer: router
// (group-limited top-k on biased sigmoid scores), routed SwiGLU experts, shared experts, the sequence-wise
// balance loss and the micro-batch auxiliary loss (each alone and both at once), token dropping at a capacity
// (in forward, not in forward_cached); gradients of the input and of every weight against finite differences;
// the load statistics (counted before the drop), the dropped assignments and the bias update.
#include "forge/nn/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "forge/core/parameters.h"
#include "forge/nn/fp8_context.h"
#include "fp8_fake_quantize.h"
#include "kernels/op_tests/moe_router_reference.h"
#include "op_harness.h"

namespace forge::nn::moe_test {
namespace {

constexpr int64_t kHidden = 8, kExperts = 6, kTopK = 2, kFfn = 6, kSharedFfn = 4, kBatch = 2, kSeq = 5;
constexpr int64_t kRows = kBatch * kSeq;

struct Layer {
  ParameterStore store;
  MoeParams ids;
  MoeShape shape;
  MoeStats stats;
  MoeStepScale scale;
  std::unique_ptr<Moe> moe;

  // gemm, activation: the GEMMs' and the activations' dtypes (bf16 activations need bf16 GEMMs).
  explicit Layer(double capacity_factor = 0, bool shared = true, float balance = 0.5f, float aux = 0.0f,
                 Fp8Context* fp8 = nullptr, DType gemm = DType::f32, DType activation = DType::f32) {
    shape.hidden = kHidden, shape.experts = kExperts, shape.top_k = kTopK, shape.groups = 3,
    shape.topk_groups = 2;
    shape.expert_ffn = kFfn, shape.shared_ffn = shared ? kSharedFfn : 0, shape.scaling = 2.5f;
    shape.capacity_factor = capacity_factor;
    ids.router = store.add("router", {kExperts, kHidden}, true, Init::normal);
    ids.bias = store.add("bias", {kExperts}, false, Init::zeros);
    for (int64_t e = 0; e < kExperts; ++e) {
      const int gate = store.add("gate" + std::to_string(e), {kFfn, kHidden}, true, Init::normal);
      store.add("up" + std::to_string(e), {kFfn, kHidden}, true, Init::normal);
      if (e == 0) ids.first_gate_up = gate;
    }
    for (int64_t e = 0; e < kExperts; ++e) {
      const int down = store.add("down" + std::to_string(e), {kHidden, kFfn}, true, Init::normal);
      if (e == 0) ids.first_down = down;
    }
    if (shared) {
      ids.shared.gate = store.add("shared.gate", {kSharedFfn, kHidden}, true, Init::normal);
      ids.shared.up = store.add("shared.up", {kSharedFfn, kHidden}, true, Init::normal);
      ids.shared.down = store.add("shared.down", {kHidden, kSharedFfn}, true, Init::normal);
    }
    store.allocate(gemm == DType::bf16);
    // Weights of order one, so that routing margins dwarf finite-difference steps.
    const std::vector<float> values = testing::random_floats(store.numel(), 5, -0.8f, 0.8f);
    std::memcpy(store.params().f32(), values.data(), values.size() * sizeof(float));
    const float bias[kExperts] = {0.05f, -0.1f, 0.15f, 0.0f, -0.05f, 0.1f};
    std::memcpy(store.param(ids.bias).f32(), bias, sizeof(bias));
    if (store.has_bf16()) store.refresh_bf16();
    scale.balance = balance, scale.aux = aux;
    ComputeOptions options;
    options.gemm_dtype = gemm;
    options.activation_dtype = activation;
    options.fp8 = fp8;
    moe = std::make_unique<Moe>(&store, ids, shape, options, &stats, &scale);
    if (fp8) fp8->seal();
  }
  std::vector<double> param(int id) const {
    const Tensor t = store.param(id);
    return {t.f32(), t.f32() + t.numel()};
  }
};

// The layer in double: y, the balance losses per sequence and the micro-batch's auxiliary loss. fixed_ids:
// the routing to use (finite differences stay on one piece of the piecewise-smooth function).
struct ReferenceOut {
  std::vector<double> y, balance;
  double aux = 0;
  std::vector<int32_t> ids;
};

double silu(double g) { return g / (1 + std::exp(-g)); }

// fp8_block: the experts' GEMMs as the block recipe computes them (E4M3 forward operands): every expert's
// input rows and SwiGLU output in 1x128 tiles, its gate|up (one matrix) and down weights in 128x128 blocks.
std::vector<std::vector<double>> fp8_block_weights(const Layer& l, std::vector<std::vector<double>> w,
                                                   bool pow2);

ReferenceOut reference(const Layer& l, const std::vector<double>& h,
                       const std::vector<std::vector<double>>& w, const std::vector<int32_t>* fixed_ids,
                       bool fp8_block = false, bool pow2 = true) {
  // w: every parameter by id.
  const std::vector<double>& router = w[l.ids.router];
  std::vector<double> z(kRows * kExperts, 0.0);
  for (int64_t t = 0; t < kRows; ++t)
    for (int64_t e = 0; e < kExperts; ++e)
      for (int64_t i = 0; i < kHidden; ++i)
        z[t * kExperts + e] += h[t * kHidden + i] * router[e * kHidden + i];
  op_tests::moe_router::Case c{};
  c.tokens = kRows, c.experts = kExperts, c.top_k = kTopK, c.groups = l.shape.groups;
  c.topk_groups = l.shape.topk_groups, c.score = ops::MoeScore::sigmoid, c.normalize = true, c.scaling = 2.5f;
  // Both losses' values (their scales only matter to backward).
  c.bias = true, c.seq_len = kSeq, c.aux = true;
  const op_tests::moe_router::Reference r = op_tests::moe_router::reference(c, z, w[l.ids.bias], fixed_ids);
  ReferenceOut out;
  out.ids = r.ids, out.balance = r.losses, out.aux = r.aux_loss, out.y.assign(kRows * kHidden, 0.0);
  // Capacity: each expert keeps its first assignments in assignment order.
  std::vector<bool> kept(kRows * kTopK, true);
  if (l.shape.capacity_factor > 0) {
    const int64_t capacity = static_cast<int64_t>(
        std::ceil(static_cast<double>(kRows * kTopK) / kExperts * l.shape.capacity_factor));
    std::vector<int64_t> taken(kExperts, 0);
    for (int64_t a = 0; a < kRows * kTopK; ++a) kept[a] = taken[r.ids[a]]++ < capacity;
  }
  auto swiglu = [&](const std::vector<double>& gate, const std::vector<double>& up,
                    const std::vector<double>& down, int64_t ffn, const double* x, double weight, double* y) {
    std::vector<double> act(ffn), xq(x, x + kHidden);
    if (fp8_block) xq = testing::fake_quantize(xq, 1, kHidden, 1, 128, DType::e4m3, pow2);
    for (int64_t f = 0; f < ffn; ++f) {
      double g = 0, u = 0;
      for (int64_t i = 0; i < kHidden; ++i)
        g += gate[f * kHidden + i] * xq[i], u += up[f * kHidden + i] * xq[i];
      act[f] = silu(g) * u;
    }
    if (fp8_block) act = testing::fake_quantize(act, 1, ffn, 1, 128, DType::e4m3, pow2);
    for (int64_t i = 0; i < kHidden; ++i) {
      double o = 0;
      for (int64_t f = 0; f < ffn; ++f) o += down[i * ffn + f] * act[f];
      y[i] += weight * o;
    }
  };
  for (int64_t t = 0; t < kRows; ++t) {
    for (int64_t j = 0; j < kTopK; ++j) {
      const int64_t a = t * kTopK + j, e = r.ids[a];
      if (!kept[a]) continue;
      swiglu(w[l.ids.first_gate_up + 2 * e], w[l.ids.first_gate_up + 2 * e + 1], w[l.ids.first_down + e],
             kFfn, &h[t * kHidden], r.weights[a], &out.y[t * kHidden]);
    }
    if (l.ids.shared.gate >= 0)
      swiglu(w[l.ids.shared.gate], w[l.ids.shared.up], w[l.ids.shared.down], kSharedFfn, &h[t * kHidden], 1.0,
             &out.y[t * kHidden]);
  }
  return out;
}

std::vector<std::vector<double>> fp8_block_weights(const Layer& l, std::vector<std::vector<double>> w,
                                                   bool pow2) {
  auto block = [&](int first, int count, int64_t cols) {
    std::vector<double> m;
    for (int id = first; id < first + count; ++id) m.insert(m.end(), w[id].begin(), w[id].end());
    const int64_t rows = static_cast<int64_t>(m.size()) / cols;
    const std::vector<double> q = testing::fake_quantize(m, rows, cols, 128, 128, DType::e4m3, pow2);
    for (int id = first, at = 0; id < first + count; at += static_cast<int>(w[id].size()), ++id)
      std::copy(q.begin() + at, q.begin() + at + static_cast<int64_t>(w[id].size()), w[id].begin());
  };
  for (int e = 0; e < kExperts; ++e) {
    block(l.ids.first_gate_up + 2 * e, 2, kHidden);
    block(l.ids.first_down + e, 1, kFfn);
  }
  if (l.ids.shared.gate >= 0) block(l.ids.shared.gate, 2, kHidden), block(l.ids.shared.down, 1, kSharedFfn);
  return w;
}

std::vector<std::vector<double>> all_params(const Layer& l) {
  std::vector<std::vector<double>> w;
  for (int id = 0; id < l.store.count(); ++id) w.push_back(l.param(id));
  return w;
}

Tensor from_vector(const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
  return t;
}

std::vector<float> to_vector(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

TEST(Moe, ForwardMatchesDoubleReference) {
  for (double capacity : {0.0, 0.75}) {
    Layer l(capacity);
    const std::vector<float> h = testing::random_floats(kRows * kHidden, 7);
    Moe::Saved saved;
    const Tensor y = l.moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
    const ReferenceOut want = reference(l, testing::to_double(h), all_params(l), nullptr);
    EXPECT_LT(testing::relative_error(to_vector(y), want.y), 1e-5) << "capacity_factor " << capacity;
    EXPECT_EQ(std::vector<int32_t>(saved.expert_ids.i32(), saved.expert_ids.i32() + kRows * kTopK), want.ids);
    if (capacity > 0) {
      EXPECT_LT(saved.offsets.back(), kRows * kTopK) << "nothing was dropped";
    }
  }
}

// L = <dy, y> + balance_scale * sum_q balance_q + aux_scale * aux: the module's dh and every weight gradient
// against central differences of the reference, with the sequence-wise loss alone and with both losses.
TEST(Moe, GradientsMatchFiniteDifferences) {
  for (const auto& [capacity, aux] :
       {std::pair{0.0, 0.0f}, std::pair{0.75, 0.0f}, std::pair{0.0, 0.4f}, std::pair{0.75, 0.4f}}) {
    SCOPED_TRACE(::testing::Message() << "capacity_factor " << capacity << ", aux scale " << aux);
    Layer l(capacity, true, 0.5f, aux);
    const std::vector<float> h = testing::random_floats(kRows * kHidden, 8);
    const std::vector<float> dy = testing::random_floats(kRows * kHidden, 9);
    l.store.zero_grads();
    Moe::Saved saved;
    l.moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
    const std::vector<int32_t> ids(saved.expert_ids.i32(), saved.expert_ids.i32() + kRows * kTopK);
    const Tensor dh = l.moe->backward_input(from_vector(dy, {kRows, kHidden}), kBatch, kSeq, saved);
    l.moe->backward_weight(saved);

    const std::vector<double> dyd = testing::to_double(dy);
    std::vector<std::vector<double>> w = all_params(l);
    auto loss = [&](const std::vector<double>& hh, const std::vector<std::vector<double>>& ww) {
      const ReferenceOut r = reference(l, hh, ww, &ids);
      double sum = testing::dot(dyd, r.y);
      for (double b : r.balance) sum += l.scale.balance * b;
      return sum + l.scale.aux * r.aux;
    };
    const auto fd_h = testing::finite_difference([&](const std::vector<double>& x) { return loss(x, w); },
                                                 testing::to_double(h));
    EXPECT_LT(testing::relative_error(to_vector(dh), fd_h), 1e-4) << "dh, capacity_factor " << capacity;
    for (int id = 0; id < l.store.count(); ++id) {
      if (id == l.ids.bias) continue;
      const auto fd = testing::finite_difference(
          [&](const std::vector<double>& x) {
            std::vector<std::vector<double>> ww = w;
            ww[id] = x;
            return loss(testing::to_double(h), ww);
          },
          w[id]);
      EXPECT_LT(testing::relative_error(to_vector(l.store.grad(id)), fd), 1e-4)
          << l.store.info(id).name << ", capacity_factor " << capacity;
    }
    // The correction bias steers routing only: it never gets a gradient.
    for (float g : to_vector(l.store.grad(l.ids.bias))) EXPECT_EQ(g, 0.0f);
  }
}

// Without a coefficient the balance loss adds nothing to the gradient; the statistics still see its value.
TEST(Moe, BalanceCoefficientZeroLeavesGradientsToTheExperts) {
  Layer with(0, false, 0.5f), without(0, false, 0.0f);
  const std::vector<float> h = testing::random_floats(kRows * kHidden, 10);
  const std::vector<float> dy = testing::random_floats(kRows * kHidden, 11);
  for (Layer* l : {&with, &without}) {
    l->store.zero_grads();
    Moe::Saved saved;
    l->moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
    l->moe->backward_input(from_vector(dy, {kRows, kHidden}), kBatch, kSeq, saved);
    l->moe->backward_weight(saved);
  }
  EXPECT_NE(to_vector(with.store.grad(with.ids.router)), to_vector(without.store.grad(without.ids.router)));
  EXPECT_EQ(to_vector(with.store.grad(with.ids.first_down)),
            to_vector(without.store.grad(without.ids.first_down)));
  EXPECT_EQ(with.stats.sequences, kBatch);
  EXPECT_NEAR(with.stats.balance_sum, without.stats.balance_sum, 1e-12);
  const ReferenceOut want = reference(with, testing::to_double(h), all_params(with), nullptr);
  EXPECT_NEAR(with.stats.balance_sum, want.balance[0] + want.balance[1], 1e-5);
}

// The auxiliary loss alone (no sequence-wise loss): it moves only the router's gradient, its value reaches
// the statistics once per micro-batch, and without a coefficient it is not computed at all.
TEST(Moe, AuxLossAloneMovesOnlyTheRouter) {
  Layer with(0, false, 0.0f, 0.6f), without(0, false, 0.0f, 0.0f);
  const std::vector<float> h = testing::random_floats(kRows * kHidden, 20);
  const std::vector<float> dy = testing::random_floats(kRows * kHidden, 21);
  for (Layer* l : {&with, &without}) {
    l->store.zero_grads();
    for (int micro = 0; micro < 2; ++micro) {
      Moe::Saved saved;
      l->moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
      l->moe->backward_input(from_vector(dy, {kRows, kHidden}), kBatch, kSeq, saved);
      l->moe->backward_weight(saved);
    }
  }
  EXPECT_NE(to_vector(with.store.grad(with.ids.router)), to_vector(without.store.grad(without.ids.router)));
  EXPECT_EQ(to_vector(with.store.grad(with.ids.first_down)),
            to_vector(without.store.grad(without.ids.first_down)));
  EXPECT_EQ(with.stats.micro_batches, 2);
  EXPECT_EQ(without.stats.micro_batches, 0);
  EXPECT_EQ(without.stats.aux_sum, 0.0);
  const ReferenceOut want = reference(with, testing::to_double(h), all_params(with), nullptr);
  EXPECT_NEAR(with.stats.aux_sum, 2 * want.aux, 1e-5);
  // The micro-batch's loss is not the mean of its sequences' (each sequence is balanced over its own tokens).
  EXPECT_GT(std::abs(want.aux - (want.balance[0] + want.balance[1]) / 2), 1e-3);
  // Gradient of L = <dy, y> + aux_scale * aux by finite differences of the router (from one micro-batch).
  with.store.zero_grads();
  Moe::Saved saved;
  with.moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
  const std::vector<int32_t> ids(saved.expert_ids.i32(), saved.expert_ids.i32() + kRows * kTopK);
  with.moe->backward_input(from_vector(dy, {kRows, kHidden}), kBatch, kSeq, saved);
  with.moe->backward_weight(saved);
  std::vector<std::vector<double>> w = all_params(with);
  const std::vector<double> dyd = testing::to_double(dy);
  const auto fd = testing::finite_difference(
      [&](const std::vector<double>& x) {
        std::vector<std::vector<double>> ww = w;
        ww[with.ids.router] = x;
        const ReferenceOut r = reference(with, testing::to_double(h), ww, &ids);
        return testing::dot(dyd, r.y) + with.scale.aux * r.aux;
      },
      w[with.ids.router]);
  EXPECT_LT(testing::relative_error(to_vector(with.store.grad(with.ids.router)), fd), 1e-4);
}

// A hand-made drop: a zero router gives every score 0.5, so the bias alone picks the experts: groups
// {0, 1}, {2, 3}, {4, 5} score 0.95, 1.15 and 1.05, the last two stay, and every token takes experts 2 (0.65)
// and 5 (0.6). At capacity_factor 1 each expert takes ceil(10 x 2 / 6) = 4 assignments: tokens 0-3 keep both,
// tokens 4-9 lose both (12 of 20 dropped), and only their routed part changes. The loads count all 20;
// forward_cached (generation) drops nothing.
TEST(Moe, CapacityDropsInForwardOnly) {
  Layer capped(1.0), dropless(0.0);
  for (Layer* l : {&capped, &dropless})
    std::fill_n(l->store.param(l->ids.router).f32(), kExperts * kHidden, 0.0f);
  const std::vector<float> h = testing::random_floats(kRows * kHidden, 22);
  std::vector<float> y[2];
  Layer* layers[2] = {&capped, &dropless};
  for (int i = 0; i < 2; ++i) {
    Moe::Saved saved;
    y[i] = to_vector(layers[i]->moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true));
    EXPECT_EQ(std::vector<int32_t>(saved.expert_ids.i32(), saved.expert_ids.i32() + 2),
              (std::vector<int32_t>{2, 5}));
    EXPECT_EQ(saved.offsets.back(), i == 0 ? 8 : kRows * kTopK);
    layers[i]->moe->backward_input(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved);
    layers[i]->moe->backward_weight(saved);
  }
  EXPECT_EQ(capped.stats.load, (std::vector<double>{0, 0, 10, 0, 0, 10}));  // before the drop
  EXPECT_EQ(capped.stats.dropped, 12);
  EXPECT_EQ(dropless.stats.dropped, 0);
  for (int64_t t = 0; t < kRows; ++t)
    for (int64_t i = 0; i < kHidden; ++i) {
      const float a = y[0][t * kHidden + i], b = y[1][t * kHidden + i];
      if (t < 4) {
        EXPECT_NEAR(a, b, 1e-5f * (1 + std::abs(b))) << "kept token " << t;
      }
    }
  const ReferenceOut want = reference(capped, testing::to_double(h), all_params(capped), nullptr);
  EXPECT_LT(testing::relative_error(y[0], want.y), 1e-5);
  EXPECT_GT(testing::relative_error(y[0], testing::to_double(y[1])),
            1e-3);  // the dropped tokens lost their routed experts
  // Generation: the capped layer's cached forward is the dropless forward.
  const std::vector<float> cached =
      to_vector(capped.moe->forward_cached(from_vector(h, {kRows, kHidden}), kBatch, kSeq, nullptr));
  EXPECT_LT(testing::relative_error(cached, testing::to_double(y[1])), 1e-6);
}

// Selective recompute (SwiGLU again in backward) gives the same gradients bitwise.
TEST(Moe, SelectiveRecomputeIsBitwiseTheSame) {
  Layer keep, recompute;
  const std::vector<float> h = testing::random_floats(kRows * kHidden, 12);
  const std::vector<float> dy = testing::random_floats(kRows * kHidden, 13);
  std::vector<float> dh[2];
  Layer* layers[2] = {&keep, &recompute};
  for (int i = 0; i < 2; ++i) {
    layers[i]->store.zero_grads();
    Moe::Saved saved;
    layers[i]->moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, i == 0);
    dh[i] = to_vector(layers[i]->moe->backward_input(from_vector(dy, {kRows, kHidden}), kBatch, kSeq, saved));
    layers[i]->moe->backward_weight(saved);
  }
  EXPECT_EQ(dh[0], dh[1]);
  EXPECT_EQ(std::memcmp(keep.store.grads().raw(), recompute.store.grads().raw(), keep.store.grads().bytes()),
            0);
}

// bf16 activations measured against what bf16 GEMMs already cost (as LayerActivations does for the dense
// layer), on the same routing (the router reads the same fp32 input in all three layers). bf16 GEMMs round
// the experts' operands: the permuted rows, SwiGLU's output, and in backward the rows' output gradients and
// gate|up's; the shared experts' likewise. bf16 activations add as many where a tensor was fp32 and no GEMM
// rounded it: gate|up, the experts' outputs, the combined output and the shared experts' (and their sum),
// and in backward the down projections' input gradients and the rows' gradients to the tokens (each token's
// sum over its experts and the router stays fp32). So at most twice bf16 GEMMs' distance from the exact fp32
// layer, normwise (triangle inequality), for the input and the weight gradients. Saved: gate|up and the
// experts' outputs in bf16, half the bytes; selective recompute stays bitwise.
TEST(MoeBf16, ActivationsCostNoMoreThanBf16Gemms) {
  Layer exact(0, true, 0.5f, 0.0f, nullptr), gemms(0, true, 0.5f, 0.0f, nullptr, DType::bf16),
      bf16(0, true, 0.5f, 0.0f, nullptr, DType::bf16, DType::bf16),
      recompute(0, true, 0.5f, 0.0f, nullptr, DType::bf16, DType::bf16);
  const Tensor h = from_vector(testing::random_floats(kRows * kHidden, 31), {kRows, kHidden});
  const Tensor dy = from_vector(testing::random_floats(kRows * kHidden, 32), {kRows, kHidden});
  auto run = [&](Layer& l, Moe::Saved& kept, bool keep_all = true) {
    l.store.zero_grads();
    Moe::Saved saved;
    l.moe->forward(h, kBatch, kSeq, saved, keep_all);
    kept = saved;
    Tensor dx = to_dtype(l.moe->backward_input(dy, kBatch, kSeq, saved), DType::f32);
    l.moe->backward_weight(saved);
    return dx;
  };
  Moe::Saved s_exact, s32, s16, s_recompute;
  const Tensor dx = run(exact, s_exact), dx32 = run(gemms, s32), dx16 = run(bf16, s16);
  const Tensor dx_recompute = run(recompute, s_recompute, false);
  ASSERT_EQ(std::memcmp(s16.expert_ids.raw(), s_exact.expert_ids.raw(), s16.expert_ids.bytes()), 0);
  const auto error = [](const Tensor& a, const Tensor& b) {
    return testing::normwise_error(a.f32(), b.f32(), static_cast<size_t>(a.numel()));
  };
  const double gemm_error = error(dx32, dx), all = error(dx16, dx);
  const double gemm_w = error(gemms.store.grads(), exact.store.grads());
  const double all_w = error(bf16.store.grads(), exact.store.grads());
  std::printf("MoE from the fp32 layer: bf16 GEMMs %.2e (weights %.2e), bf16 activations %.2e (%.2e)\n",
              gemm_error, gemm_w, all, all_w);
  EXPECT_GT(error(dx16, dx32), 0) << "bf16 activations changed nothing: is the MoE layer still fp32?";
  EXPECT_LT(all, 2 * gemm_error);
  EXPECT_LT(all_w, 2 * gemm_w);
  EXPECT_EQ(s16.gate_up.dtype(), DType::bf16);
  EXPECT_EQ(2 * s16.gate_up.bytes(), s32.gate_up.bytes());
  EXPECT_EQ(s16.xs.data.dtype(), DType::bf16);
  EXPECT_EQ(s16.h.dtype(), DType::f32);  // the layer was given fp32 rows: kept as given
  EXPECT_EQ(std::memcmp(dx_recompute.raw(), dx16.raw(), dx16.bytes()), 0);
  EXPECT_EQ(std::memcmp(recompute.store.grads().raw(), bf16.store.grads().raw(), bf16.store.grads().bytes()),
            0);
}

// The step's loads count every training micro-batch's assignments (before any drop); the bias update moves
// each expert's bias by exactly the rate towards the mean and clears the statistics.
TEST(Moe, LoadStatisticsAndBiasUpdate) {
  Layer l(0.75);
  const std::vector<float> h = testing::random_floats(kRows * kHidden, 14);
  std::vector<double> counts(kExperts, 0.0);
  for (int micro = 0; micro < 2; ++micro) {
    Moe::Saved saved;
    l.moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
    for (int64_t a = 0; a < kRows * kTopK; ++a) counts[saved.expert_ids.i32()[a]] += 1;
    l.moe->backward_input(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved);
    l.moe->backward_weight(saved);
  }
  EXPECT_EQ(l.stats.load, counts);
  EXPECT_GT(l.stats.dropped, 0);
  const std::vector<float> before = to_vector(l.store.param(l.ids.bias));
  const float rate = 1e-3f;
  l.moe->apply_bias_update(rate, false);
  const std::vector<float> after = to_vector(l.store.param(l.ids.bias));
  const double mean = 2.0 * kRows * kTopK / kExperts;
  for (int64_t e = 0; e < kExperts; ++e) {
    const float want = counts[e] < mean ? before[e] + rate : counts[e] > mean ? before[e] - rate : before[e];
    EXPECT_EQ(after[e], want) << "expert " << e << " load " << counts[e];
  }
  EXPECT_EQ(l.stats.load, std::vector<double>(kExperts, 0.0));
  // Evaluation forwards (no backward) count nothing.
  Moe::Saved saved;
  l.moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
  EXPECT_EQ(l.stats.load, std::vector<double>(kExperts, 0.0));
}

// FP8: each routed expert's GEMMs are their own FP8 Linears over its rows. Under the block recipe the output
// is what the fake-quantised reference gives (each expert's weights in their own 128x128 blocks: a block over
// the stacked experts would take another amax), to fp32 accumulation, and far from the fp32 layer's.
TEST(MoeFp8, BlockForwardMatchesTheFakeQuantisedReference) {
  Fp8Options o;
  o.recipe.recipe = fp8::Recipe::block;
  o.recipe.power_of_two_scales =
      false;  // with power-of-two scales a shared block would differ in subnormals only
  Fp8Context context(o);
  Layer l(0, true, 0.5f, 0.0f, &context);
  EXPECT_EQ(context.linears(), 2 * kExperts + 2) << "gate|up and down per expert, and the shared experts'";
  EXPECT_NE(context.linear_name(1).find("gate1"), std::string::npos) << context.linear_name(1);
  // Experts of different magnitudes: their own blocks take different scales.
  for (int e = 0; e < kExperts; ++e)
    for (int id : {l.ids.first_gate_up + 2 * e, l.ids.first_gate_up + 2 * e + 1, l.ids.first_down + e}) {
      Tensor w = l.store.param(id);
      for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] *= 0.3f * static_cast<float>(e + 1);
    }
  l.store.mark_updated();
  const std::vector<float> h = testing::random_floats(kRows * kHidden, 7);
  Moe::Saved saved;
  const Tensor y = l.moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
  const std::vector<std::vector<double>> w = all_params(l);
  const ReferenceOut want =
      reference(l, testing::to_double(h), fp8_block_weights(l, w, false), nullptr, true, false);
  EXPECT_LT(testing::relative_error(to_vector(y), want.y), 1e-5);
  const ReferenceOut exact = reference(l, testing::to_double(h), w, nullptr);
  EXPECT_GT(testing::relative_error(to_vector(y), exact.y), 1e-3) << "FP8 made no difference";
}

// Every recipe stays near the fp32 layer, output and every gradient (E4M3 keeps 3 mantissa bits; the
// gradients are E5M2), and routes exactly as it does (the router is fp32).
TEST(MoeFp8, RecipesStayCloseToTheFp32Layer) {
  const std::vector<float> h = testing::random_floats(kRows * kHidden, 8);
  const std::vector<float> dy = testing::random_floats(kRows * kHidden, 9);
  auto run = [&](Layer& l, Fp8Context* context) {
    const Fp8Recording recording(context, true);
    l.store.zero_grads();
    Moe::Saved saved;
    const Tensor y = l.moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, true);
    const std::vector<int32_t> ids(saved.expert_ids.i32(), saved.expert_ids.i32() + kRows * kTopK);
    const Tensor dh = l.moe->backward_input(from_vector(dy, {kRows, kHidden}), kBatch, kSeq, saved);
    l.moe->backward_weight(saved);
    return std::make_tuple(to_vector(y), to_vector(dh), ids);
  };
  Layer exact(0.75);
  const auto [y_want, dh_want, ids_want] = run(exact, nullptr);
  for (fp8::Recipe recipe : {fp8::Recipe::delayed, fp8::Recipe::current, fp8::Recipe::block}) {
    Fp8Options o;
    o.recipe.recipe = recipe, o.recipe.amax_history_len = 4;
    Fp8Context context(o);
    Layer l(0.75, true, 0.5f, 0.0f, &context);
    // Delayed scaling starts from scale 1; a first step fills the history as training would.
    if (recipe == fp8::Recipe::delayed) run(l, &context), context.end_step();
    const auto [y, dh, ids] = run(l, &context);
    const std::string name(fp8::recipe_name(recipe));
    EXPECT_EQ(ids, ids_want) << name;
    EXPECT_LT(testing::dissimilarity(y.data(), testing::to_double(y_want).data(), y.size()), 1e-2) << name;
    EXPECT_LT(testing::dissimilarity(dh.data(), testing::to_double(dh_want).data(), dh.size()), 3e-2) << name;
    for (int id = 0; id < l.store.count(); ++id) {
      if (id == l.ids.bias) continue;
      const std::vector<double> g_want = testing::to_double(to_vector(exact.store.grad(id)));
      EXPECT_LT(testing::dissimilarity(l.store.grad(id).f32(), g_want.data(), g_want.size()), 3e-2)
          << name << " " << l.store.info(id).name;
    }
  }
}

// Selective recompute casts SwiGLU's output again in backward: the same codes, so bitwise the same gradients.
TEST(MoeFp8, SelectiveRecomputeIsBitwiseTheSame) {
  for (fp8::Recipe recipe : {fp8::Recipe::current, fp8::Recipe::block}) {
    Fp8Options o;
    o.recipe.recipe = recipe;
    Fp8Context keep_context(o), recompute_context(o);
    Layer keep(0, true, 0.5f, 0.0f, &keep_context), recompute(0, true, 0.5f, 0.0f, &recompute_context);
    const std::vector<float> h = testing::random_floats(kRows * kHidden, 12);
    const std::vector<float> dy = testing::random_floats(kRows * kHidden, 13);
    std::vector<float> dh[2];
    Layer* layers[2] = {&keep, &recompute};
    for (int i = 0; i < 2; ++i) {
      layers[i]->store.zero_grads();
      Moe::Saved saved;
      layers[i]->moe->forward(from_vector(h, {kRows, kHidden}), kBatch, kSeq, saved, i == 0);
      dh[i] =
          to_vector(layers[i]->moe->backward_input(from_vector(dy, {kRows, kHidden}), kBatch, kSeq, saved));
      layers[i]->moe->backward_weight(saved);
    }
    const std::string name(fp8::recipe_name(recipe));
    EXPECT_EQ(dh[0], dh[1]) << name;
    EXPECT_EQ(
        std::memcmp(keep.store.grads().raw(), recompute.store.grads().raw(), keep.store.grads().bytes()), 0)
        << name;
  }
}

}  // namespace
}  // namespace forge::nn::moe_test
