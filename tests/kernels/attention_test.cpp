// Flash attention (forward and backward) against a double-precision reference that materialises the
// softmax, against central finite differences, and for bitwise thread-count invariance. Inputs live
// strided inside fused qkv buffers and the gradients are written into a fused dqkv buffer, as in training.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

struct AttentionCase {
  int64_t batch, seq, heads, kv_heads, head_dim;
  bool causal;
  float scale_factor = 1.0f;  // scale = scale_factor / sqrt(head_dim); > 1 makes the softmax peaky
};

std::ostream& operator<<(std::ostream& os, const AttentionCase& c) {
  return os << "b" << c.batch << "_t" << c.seq << "_h" << c.heads << "_kv" << c.kv_heads << "_d" << c.head_dim
            << (c.causal ? "_causal" : "_full") << "_x" << c.scale_factor;
}

// Dense double tensors: q [batch, seq, heads, dim], k and v [batch, seq, kv_heads, dim].
struct Inputs {
  std::vector<double> q, k, v;
};
struct ReferenceForward {
  std::vector<double> out, lse, probs;  // probs [batch, heads, seq, seq]: fine at test sizes
};
struct Gradients {
  std::vector<double> dq, dk, dv;
};

ReferenceForward reference_forward(const AttentionCase& c, const Inputs& in) {
  const int64_t T = c.seq, D = c.head_dim, H = c.heads, KV = c.kv_heads, group = H / KV;
  const double scale = c.scale_factor / std::sqrt(double(D));
  ReferenceForward r;
  r.out.assign(c.batch * T * H * D, 0.0);
  r.lse.assign(c.batch * H * T, 0.0);
  r.probs.assign(c.batch * H * T * T, 0.0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t keys = c.causal ? i + 1 : T;
        std::vector<double> s(keys);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < keys; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += in.q[((b * T + i) * H + h) * D + d] * in.k[((b * T + j) * KV + h / group) * D + d];
          s[j] = scale * dot;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < keys; ++j) sum += std::exp(s[j] - m);
        r.lse[(b * H + h) * T + i] = m + std::log(sum);
        double* p = &r.probs[((b * H + h) * T + i) * T];
        for (int64_t j = 0; j < keys; ++j) {
          p[j] = std::exp(s[j] - m) / sum;
          for (int64_t d = 0; d < D; ++d)
            r.out[((b * T + i) * H + h) * D + d] += p[j] * in.v[((b * T + j) * KV + h / group) * D + d];
        }
      }
  return r;
}

// The analytic gradient of <dout, out>: dV = P^T dO, dS = P o (dO V^T - rowsum(dO o O)), dQ = s dS K,
// dK = s dS^T Q, summed over the query heads that share a kv head.
Gradients reference_backward(const AttentionCase& c, const Inputs& in, const std::vector<double>& dout) {
  const int64_t T = c.seq, D = c.head_dim, H = c.heads, KV = c.kv_heads, group = H / KV;
  const double scale = c.scale_factor / std::sqrt(double(D));
  const ReferenceForward f = reference_forward(c, in);
  Gradients g{std::vector<double>(in.q.size()), std::vector<double>(in.k.size()),
              std::vector<double>(in.v.size())};
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const double* p = &f.probs[((b * H + h) * T + i) * T];
        const double* dout_i = &dout[((b * T + i) * H + h) * D];
        const double* q_i = &in.q[((b * T + i) * H + h) * D];
        std::vector<double> dp(T);
        double delta = 0;
        for (int64_t j = 0; j < T; ++j) {
          for (int64_t d = 0; d < D; ++d) dp[j] += dout_i[d] * in.v[((b * T + j) * KV + h / group) * D + d];
          delta += p[j] * dp[j];
        }
        for (int64_t j = 0; j < T; ++j) {
          const double ds = p[j] * (dp[j] - delta);
          const int64_t kv = ((b * T + j) * KV + h / group) * D;
          for (int64_t d = 0; d < D; ++d) {
            g.dv[kv + d] += p[j] * dout_i[d];
            g.dq[((b * T + i) * H + h) * D + d] += scale * ds * in.k[kv + d];
            g.dk[kv + d] += scale * ds * q_i[d];
          }
        }
      }
  return g;
}

// The kernel's view: q, k, v strided inside one fused buffer per token [q | k | v | padding]; the
// gradients land in a fused dqkv buffer of the same layout; out and dout have padded token strides too.
struct Problem {
  AttentionCase c;
  int64_t q_width, kv_width, qkv_stride, out_stride, dout_stride;
  std::vector<float> qkv, out, lse, dout, dqkv;
  static constexpr float kSentinel = -12345.0f;

  Problem(const AttentionCase& ac, uint32_t seed) : c(ac) {
    q_width = c.heads * c.head_dim;
    kv_width = c.kv_heads * c.head_dim;
    qkv_stride = q_width + 2 * kv_width + 3;
    out_stride = q_width + 5;
    dout_stride = q_width + 2;
    const int64_t tokens = c.batch * c.seq;
    qkv = testing::random_floats(tokens * qkv_stride, seed);
    dout = testing::random_floats(tokens * dout_stride, seed + 1);
    out.assign(tokens * out_stride, kSentinel);
    lse.assign(c.batch * c.heads * c.seq, kSentinel);
    dqkv.assign(tokens * qkv_stride, kSentinel);
  }
  ops::AttentionParams params() {
    ops::AttentionParams p;
    p.batch = c.batch, p.seq = c.seq, p.heads = c.heads, p.kv_heads = c.kv_heads, p.head_dim = c.head_dim;
    p.q = qkv.data(), p.k = qkv.data() + q_width, p.v = qkv.data() + q_width + kv_width;
    p.q_stride = p.k_stride = p.v_stride = qkv_stride;
    p.out = out.data(), p.out_stride = out_stride, p.lse = lse.data();
    p.scale = c.scale_factor / std::sqrt(float(c.head_dim));
    p.causal = c.causal;
    p.dout = dout.data(), p.dout_stride = dout_stride;
    p.dq = dqkv.data(), p.dk = dqkv.data() + q_width, p.dv = dqkv.data() + q_width + kv_width;
    p.dq_stride = p.dk_stride = p.dv_stride = qkv_stride;
    return p;
  }
  // Dense copy of `width` floats per token starting at `offset` in a buffer with token stride `stride`.
  template <typename T>
  std::vector<T> gather(const std::vector<float>& buffer, int64_t stride, int64_t offset,
                        int64_t width) const {
    std::vector<T> dense;
    for (int64_t t = 0; t < c.batch * c.seq; ++t)
      for (int64_t e = 0; e < width; ++e) dense.push_back(buffer[t * stride + offset + e]);
    return dense;
  }
  Inputs inputs() const {
    return {gather<double>(qkv, qkv_stride, 0, q_width), gather<double>(qkv, qkv_stride, q_width, kv_width),
            gather<double>(qkv, qkv_stride, q_width + kv_width, kv_width)};
  }
  // Padding columns of every buffer the kernels write must still hold the sentinel.
  void expect_padding_untouched() const {
    for (int64_t t = 0; t < c.batch * c.seq; ++t) {
      for (int64_t e = q_width; e < out_stride; ++e)
        ASSERT_EQ(out[t * out_stride + e], kSentinel) << "out pad";
      for (int64_t e = q_width + 2 * kv_width; e < qkv_stride; ++e)
        ASSERT_EQ(dqkv[t * qkv_stride + e], kSentinel) << "dqkv pad";
    }
  }
};

// relative_error with a floor on the reference scale. Inputs are O(1), so gradients are O(0.1..10), but
// with a single visible key the softmax is constant: dq and dk are exactly zero and only fp32 round-off
// (~3e-8) remains, which a plain relative error would divide by zero.
double gradient_error(const std::vector<float>& got, const std::vector<double>& want) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(got[i] - want[i]));
    max_ref = std::max(max_ref, std::abs(want[i]));
  }
  fprintf(stderr, "GRADERR %g\n", max_diff / std::max(max_ref, 1e-3));
  return max_diff / std::max(max_ref, 0.05);
}

class AttentionTest : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionTest, ForwardMatchesDoubleReference) {
  const AttentionCase c = GetParam();
  Problem prob(c, 11);
  ops::attention_forward(prob.params());
  const ReferenceForward want = reference_forward(c, prob.inputs());
  // fp32 dot products of length head_dim and an fp32 online softmax: ~1e-6 relative in practice.
  EXPECT_LT(testing::relative_error(prob.gather<float>(prob.out, prob.out_stride, 0, prob.q_width), want.out),
            1e-5);
  EXPECT_LT(testing::relative_error(prob.lse, want.lse), 1e-5);
  prob.expect_padding_untouched();
}

TEST_P(AttentionTest, BackwardMatchesDoubleReference) {
  const AttentionCase c = GetParam();
  Problem prob(c, 23);
  ops::attention_forward(prob.params());
  ops::attention_backward(prob.params());
  const Gradients want =
      reference_backward(c, prob.inputs(), prob.gather<double>(prob.dout, prob.dout_stride, 0, prob.q_width));
  // Backward chains three fp32 products per element (and the forward's lse): relative ~1e-6, bound 2e-5.
  const auto dq = prob.gather<float>(prob.dqkv, prob.qkv_stride, 0, prob.q_width);
  const auto dk = prob.gather<float>(prob.dqkv, prob.qkv_stride, prob.q_width, prob.kv_width);
  const auto dv = prob.gather<float>(prob.dqkv, prob.qkv_stride, prob.q_width + prob.kv_width, prob.kv_width);
  EXPECT_LT(gradient_error(dq, want.dq), 2e-5);
  EXPECT_LT(gradient_error(dk, want.dk), 2e-5);
  EXPECT_LT(gradient_error(dv, want.dv), 2e-5);
  prob.expect_padding_untouched();
}

INSTANTIATE_TEST_SUITE_P(
    AttentionShapes, AttentionTest,
    ::testing::Values(AttentionCase{1, 1, 2, 2, 16, true},            // one token
                      AttentionCase{2, 7, 4, 2, 16, true},            // GQA, batch 2
                      AttentionCase{1, 33, 4, 1, 64, true},           // MQA
                      AttentionCase{2, 100, 2, 2, 64, true},          // MHA, two blocks (one partial)
                      AttentionCase{1, 130, 4, 2, 16, true, 4.0f},    // three blocks, peaky softmax
                      AttentionCase{1, 64, 2, 1, 64, true},           // exactly one block
                      AttentionCase{2, 7, 4, 2, 16, false},           // non-causal
                      AttentionCase{1, 100, 4, 1, 64, false},         // non-causal MQA, partial block
                      AttentionCase{1, 130, 2, 2, 24, false, 3.0f}),  // head_dim not a multiple of 16
    [](const auto& info) {
      std::ostringstream name;
      name << info.param;
      std::string s = name.str();
      std::replace(s.begin(), s.end(), '.', 'p');
      return s;
    });

// Gradients of the scalar loss <w, out(q, k, v)> by central differences on the double reference, against
// the kernel's dq, dk, dv for dout = w. Differences in double are exact to ~1e-10 here, so the bound is
// the kernel's fp32 error.
void check_finite_differences(const AttentionCase& c) {
  Problem prob(c, 37);
  ops::attention_forward(prob.params());
  ops::attention_backward(prob.params());
  const Inputs in = prob.inputs();
  const std::vector<double> w = prob.gather<double>(prob.dout, prob.dout_stride, 0, prob.q_width);
  std::vector<double> x = in.q;
  x.insert(x.end(), in.k.begin(), in.k.end());
  x.insert(x.end(), in.v.begin(), in.v.end());
  auto loss = [&](const std::vector<double>& all) {
    Inputs split;
    split.q.assign(all.begin(), all.begin() + in.q.size());
    split.k.assign(all.begin() + in.q.size(), all.begin() + in.q.size() + in.k.size());
    split.v.assign(all.begin() + in.q.size() + in.k.size(), all.end());
    return testing::dot(w, reference_forward(c, split).out);
  };
  const std::vector<double> numeric = testing::finite_difference(loss, x);
  std::vector<float> analytic = prob.gather<float>(prob.dqkv, prob.qkv_stride, 0, prob.q_width);
  for (int64_t offset : {prob.q_width, prob.q_width + prob.kv_width}) {
    const auto part = prob.gather<float>(prob.dqkv, prob.qkv_stride, offset, prob.kv_width);
    analytic.insert(analytic.end(), part.begin(), part.end());
  }
  EXPECT_LT(testing::relative_error(analytic, numeric), 2e-5);
}

TEST(AttentionGradient, MatchesFiniteDifferencesCausal) {
  check_finite_differences({1, 6, 4, 2, 16, true, 2.0f});
}
TEST(AttentionGradient, MatchesFiniteDifferencesFull) {
  check_finite_differences({2, 5, 2, 1, 16, false, 2.0f});
}
TEST(AttentionGradient, MatchesFiniteDifferencesAcrossBlocks) {
  check_finite_differences({1, 67, 1, 1, 4, true, 2.0f});  // 67 tokens: a block boundary inside the range
}

// head_dim 8192: each thread stages at most 4 MiB of k/v (or q/dout) rows, so 64 of the 80 rows fit and
// the staging window has to slide. One (batch, kv head) pair: 1 thread runs the fused backward, 2 threads
// the two-pass one.
TEST(AttentionStaging, SlidingWindowMatchesReference) {
  // Dot products of length 8192 in fp32: a modest scale keeps the logits' rounding error ~1e-6.
  const AttentionCase c{1, 80, 1, 1, 8192, true, 2.0f};
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    Problem prob(c, 41);
    ops::attention_forward(prob.params());
    ops::attention_backward(prob.params());
    const Inputs in = prob.inputs();
    const ReferenceForward want = reference_forward(c, in);
    EXPECT_LT(
        testing::relative_error(prob.gather<float>(prob.out, prob.out_stride, 0, prob.q_width), want.out),
        1e-5);
    const Gradients grad =
        reference_backward(c, in, prob.gather<double>(prob.dout, prob.dout_stride, 0, prob.q_width));
    const auto dq = prob.gather<float>(prob.dqkv, prob.qkv_stride, 0, prob.q_width);
    const auto dk = prob.gather<float>(prob.dqkv, prob.qkv_stride, prob.q_width, prob.kv_width);
    const auto dv =
        prob.gather<float>(prob.dqkv, prob.qkv_stride, prob.q_width + prob.kv_width, prob.kv_width);
    EXPECT_LT(gradient_error(dq, grad.dq), 2e-5) << threads << " threads";
    EXPECT_LT(gradient_error(dk, grad.dk), 2e-5) << threads << " threads";
    EXPECT_LT(gradient_error(dv, grad.dv), 2e-5) << threads << " threads";
  }
  omp_set_num_threads(saved);
}

// Work is split over threads by items that never share an output element, so the result must not depend
// on the thread count. With 4 (batch, kv head) pairs, 1 and 2 threads run the fused backward and 3 threads
// the two-pass one, so this also checks that the two schemes agree bitwise.
TEST(AttentionThreads, BitwiseIndependentOfThreadCount) {
  const int saved = omp_get_max_threads();
  for (bool causal : {true, false}) {
    const AttentionCase c{2, 150, 4, 2, 64, causal};
    std::vector<Problem> runs;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      runs.emplace_back(c, 5);
      ops::attention_forward(runs.back().params());
      ops::attention_backward(runs.back().params());
    }
    for (size_t r = 1; r < runs.size(); ++r) {
      EXPECT_EQ(0, std::memcmp(runs[0].out.data(), runs[r].out.data(), runs[0].out.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(runs[0].lse.data(), runs[r].lse.data(), runs[0].lse.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(runs[0].dqkv.data(), runs[r].dqkv.data(), runs[0].dqkv.size() * sizeof(float)))
          << "causal " << causal << ", threads " << r + 1;
    }
  }
  omp_set_num_threads(saved);
}

// Causal masking is exact: changing the keys and values of later tokens leaves earlier outputs bitwise equal.
TEST(AttentionCausal, LaterTokensDoNotLeak) {
  const AttentionCase c{1, 90, 2, 1, 16, true};
  Problem a(c, 3), b(c, 3);
  const int64_t cut = 40;
  for (int64_t t = cut + 1; t < c.seq; ++t)
    for (int64_t e = a.q_width; e < a.q_width + 2 * a.kv_width; ++e) b.qkv[t * b.qkv_stride + e] *= -3.0f;
  ops::attention_forward(a.params());
  ops::attention_forward(b.params());
  EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), (cut + 1) * a.out_stride * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), (cut + 1) * sizeof(float)));
}

TEST(AttentionErrors, RejectsBadShapes) {
  Problem prob({1, 4, 3, 2, 16, true}, 1);  // 3 heads do not split into 2 kv heads
  EXPECT_THROW(ops::attention_forward(prob.params()), Error);
  Problem ok({1, 4, 2, 1, 16, true}, 1);
  auto p = ok.params();
  p.q_stride = 8;  // narrower than heads * head_dim
  EXPECT_THROW(ops::attention_forward(p), Error);
  p = ok.params();
  p.dk = nullptr;
  EXPECT_THROW(ops::attention_backward(p), Error);
}

}  // namespace
}  // namespace forge
