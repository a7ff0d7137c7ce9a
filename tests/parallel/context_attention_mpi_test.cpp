// Context-parallel attention (parallel/context_parallel.h), the whole world one cp group (mpirun with 2 and
// 4 ranks): every rank holds its two chunks of each sequence (chunk r and chunk 2·cp − 1 − r), and the ring
// and the all-to-all modes give, forward and backward, what one process computes over the whole sequence
// (out, log-sum-exp, dq, dk, dv of the rank's tokens), for grouped-query and MLA-shaped heads; bad requests
// are one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "forge/parallel/context_parallel.h"

namespace forge::parallel::context_attention_mpi_test {
namespace {

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(gen);
  return v;
}

struct Shape {
  int64_t batch, chunk, heads, kv_heads, head_dim, v_dim;
};

// Rows of fp32 values as bf16 bits, and back.
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_bf16(x[i]);
  return y;
}
std::vector<float> widen(const std::vector<uint16_t>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = bf16_to_float(x[i]);
  return y;
}

// The whole sequence's attention on one process, and the same through the cp group, compared on this rank's
// tokens. bf16: every tensor but the log-sum-exp in bf16, on both sides (the inputs drawn as bf16 values);
// the group moves them in bf16. Against the one-process bf16 kernel, which rounds each result once: the
// all-to-all runs that kernel over the whole sequence of its heads; the ring rounds the same fp32 result once
// (forward; dq) or sums the key and value gradients of cp ranks with a rounding per hop (cp - 1 of them on
// top of the final one): within cp bf16 units (2^-8) of max(1, |x|), and the log-sum-exp within fp32's 2e-5.
void expect_matches_one_process(const Shape& s, ContextAttention mode, bool bf16 = false) {
  comm::Communicator& world = comm::world();
  const int cp = world.size();
  const ContextSplit split = ContextSplit::make(cp, world.rank(), 2 * cp * s.chunk);
  const int64_t seq = split.seq, local = split.local();
  const int64_t qw = s.heads * s.head_dim, kw = s.kv_heads * s.head_dim, vw = s.kv_heads * s.v_dim,
                ow = s.heads * s.v_dim;
  // Every rank draws the same whole sequence.
  auto draw = [&](size_t n, uint32_t seed) {
    std::vector<float> x = random_floats(n, seed);
    if (bf16)
      for (float& f : x) f = bf16_to_float(float_to_bf16(f));
    return x;
  };
  const std::vector<float> q = draw(s.batch * seq * qw, 1), k = draw(s.batch * seq * kw, 2),
                           v = draw(s.batch * seq * vw, 3), dout = draw(s.batch * seq * ow, 4);
  // An attention problem's tensors in the test's dtype.
  struct Tensors {
    bool bf16;
    std::vector<float> f[8];
    std::vector<uint16_t> h[8];
    Tensors(bool b, const std::vector<std::vector<float>>& init) : bf16(b) {
      for (size_t i = 0; i < init.size(); ++i) f[i] = init[i], h[i] = to_bf16(init[i]);
    }
    ConstElements in(int i) const { return bf16 ? ConstElements(h[i].data()) : ConstElements(f[i].data()); }
    Elements out(int i) { return bf16 ? Elements(h[i].data()) : Elements(f[i].data()); }
    std::vector<float> get(int i) const { return bf16 ? widen(h[i]) : f[i]; }
  };
  enum { Q, K, V, DOUT, OUT, DQ, DK, DV };
  ops::AttentionParams whole;
  whole.batch = s.batch, whole.seq = seq, whole.heads = s.heads, whole.kv_heads = s.kv_heads;
  whole.head_dim = s.head_dim, whole.v_head_dim = s.v_dim;
  whole.q_stride = qw, whole.k_stride = kw, whole.v_stride = vw, whole.out_stride = ow;
  whole.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  Tensors w(bf16, {q, k, v, dout, std::vector<float>(s.batch * seq * ow), std::vector<float>(q.size()),
                   std::vector<float>(k.size()), std::vector<float>(v.size())});
  std::vector<float> lse(s.batch * s.heads * seq);
  whole.q = w.in(Q), whole.k = w.in(K), whole.v = w.in(V), whole.out = w.out(OUT), whole.lse = lse.data();
  ops::attention_forward(whole);
  whole.out = w.out(OUT);
  whole.dout = w.in(DOUT), whole.dout_stride = ow;
  whole.dq = w.out(DQ), whole.dk = w.out(DK), whole.dv = w.out(DV);
  whole.dq_stride = qw, whole.dk_stride = kw, whole.dv_stride = vw;
  ops::attention_backward(whole);

  auto mine = [&](const std::vector<float>& x, int64_t width) {
    std::vector<float> y(s.batch * local * width);
    split.take_local(x.data(), y.data(), s.batch, width);
    return y;
  };
  // The log-sum-exp is [batch, heads, seq]: as `batch x heads` sequences of one value per token.
  std::vector<float> lse_mine(s.batch * s.heads * local);
  split.take_local(lse.data(), lse_mine.data(), s.batch * s.heads, 1);

  const std::vector<float> poison_out(s.batch * local * ow, -7.0f);
  Tensors l(bf16,
            {mine(q, qw), mine(k, kw), mine(v, vw), mine(dout, ow), poison_out,
             std::vector<float>(s.batch * local * qw, -7.0f), std::vector<float>(s.batch * local * kw, -7.0f),
             std::vector<float>(s.batch * local * vw, -7.0f)});
  std::vector<float> llse(lse_mine.size(), -7.0f);
  ops::AttentionParams p = whole;
  p.seq = local;
  p.q = l.in(Q), p.k = l.in(K), p.v = l.in(V), p.out = l.out(OUT), p.lse = llse.data();
  context_attention_forward(world, split, mode, p);
  p.out = l.out(OUT);
  p.dout = l.in(DOUT), p.dq = l.out(DQ), p.dk = l.out(DK), p.dv = l.out(DV);
  context_attention_backward(world, split, mode, p);

  auto expect_near = [&](const std::vector<float>& got, const std::vector<float>& want, const char* what,
                         double tolerance) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(double(want[i]))));
    EXPECT_LT(worst, tolerance) << what << " of rank " << world.rank() << " of " << cp << " ("
                                << context_attention_name(mode) << (bf16 ? ", bf16" : "") << ")";
  };
  const double tolerance = bf16 ? cp * std::ldexp(1.0, -8) : 2e-5;
  expect_near(l.get(OUT), mine(w.get(OUT), ow), "out", tolerance);
  expect_near(llse, lse_mine, "lse", 2e-5);
  expect_near(l.get(DQ), mine(w.get(DQ), qw), "dq", tolerance);
  expect_near(l.get(DK), mine(w.get(DK), kw), "dk", tolerance);
  expect_near(l.get(DV), mine(w.get(DV), vw), "dv", tolerance);
}

TEST(ContextAttention, Bf16TensorsTravelAndMatchOneProcessInBf16) {
  const int cp = comm::world().size();
  expect_matches_one_process({2, 5, 4, 2, 8, 8}, ContextAttention::ring, true);
  expect_matches_one_process({1, 4, 4, 4, 12, 8}, ContextAttention::ring, true);
  expect_matches_one_process({2, 3, 2 * cp, cp, 8, 8}, ContextAttention::all_to_all, true);
  // The bytes a rank sends: the ring's key/value hops in bf16, half those of fp32.
  const ContextSplit split = ContextSplit::make(cp, comm::world().rank(), 2 * cp * 4);
  auto sent = [&](bool bf16) {
    ops::AttentionParams p;
    p.batch = 1, p.seq = split.local(), p.heads = 2, p.kv_heads = 2, p.head_dim = 8;
    p.q_stride = p.k_stride = p.v_stride = p.out_stride = 16, p.scale = 0.25f;
    const size_t n = static_cast<size_t>(p.seq * 16);
    std::vector<float> f(n, 0.5f), out(n), lse(static_cast<size_t>(2 * p.seq));
    std::vector<uint16_t> h(n, float_to_bf16(0.5f)), hout(n);
    if (bf16)
      p.q = p.k = p.v = h.data(), p.out = hout.data();
    else
      p.q = p.k = p.v = f.data(), p.out = out.data();
    p.lse = lse.data();
    ContextAttentionStats stats;
    context_attention_forward(comm::world(), split, ContextAttention::ring, p, &stats);
    return stats.bytes_sent;
  };
  EXPECT_EQ(2 * sent(true), sent(false));
}

TEST(ContextAttention, RingMatchesOneProcessForGroupedQueries) {
  expect_matches_one_process({2, 5, 4, 2, 8, 8}, ContextAttention::ring);
}

TEST(ContextAttention, RingMatchesOneProcessForMlaShapes) {
  // q/k heads of 12 (8 + a rope part of 4), values of 8, one kv head per head (MLA's training form).
  expect_matches_one_process({1, 4, 4, 4, 12, 8}, ContextAttention::ring);
}

TEST(ContextAttention, AllToAllMatchesOneProcess) {
  const int cp = comm::world().size();
  expect_matches_one_process({2, 3, 2 * cp, cp, 8, 8}, ContextAttention::all_to_all);  // grouped queries
  expect_matches_one_process({1, 4, cp, cp, 12, 8}, ContextAttention::all_to_all);     // MLA-shaped
}

TEST(ContextAttention, TheSplitBalancesTheCausalWork) {
  const int cp = comm::world().size();
  const ContextSplit split = ContextSplit::make(cp, comm::world().rank(), 8 * cp);
  // Chunks r and 2cp-1-r: the positions, and the keys each rank's queries see in all, are the same on every
  // rank.
  int64_t visible = 0;
  for (int64_t t = 0; t < split.local(); ++t) visible += split.position(t) + 1;
  EXPECT_EQ(split.position(0), split.rank * split.chunk());
  EXPECT_EQ(split.position(split.chunk()), (2 * cp - 1 - split.rank) * split.chunk());
  double most = static_cast<double>(visible), least = most;
  most = comm::all_reduce_max(comm::world(), most);
  least = -comm::all_reduce_max(comm::world(), -least);
  EXPECT_EQ(most, least);
}

TEST(ContextAttention, BadRequestsAreOneLine) {
  comm::Communicator& world = comm::world();
  const int cp = world.size();
  auto expect_one_line = [](auto&& fn, const std::string& culprit) {
    try {
      fn();
      ADD_FAILURE() << "accepted; expected an error naming " << culprit;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(culprit), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  };
  expect_one_line([&] { (void)ContextSplit::make(cp, 0, 2 * cp + 1); }, "must be a multiple of 2 x cp");
  expect_one_line([] { (void)context_attention_from_name("rings"); }, "'rings'");
  // All-to-all with kv heads that do not divide by cp (every rank refuses alike: no collective runs).
  const ContextSplit split = ContextSplit::make(cp, world.rank(), 2 * cp);
  std::vector<float> x(64 * cp, 0.0f);
  ops::AttentionParams p;
  p.batch = 1, p.seq = split.local(), p.heads = 2 * cp, p.kv_heads = 1, p.head_dim = 4;
  p.q = p.k = p.v = x.data(), p.out = x.data(), p.lse = x.data();
  p.q_stride = p.out_stride = 2 * cp * 4, p.k_stride = p.v_stride = 4;
  expect_one_line([&] { context_attention_forward(world, split, ContextAttention::all_to_all, p); },
                  "kv heads must each divide by parallel.cp");
}

}  // namespace
}  // namespace forge::parallel::context_attention_mpi_test
