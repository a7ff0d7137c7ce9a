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
#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "forge/parallel/context_parallel.h"

namespace forge::parallel {
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

// The whole sequence's attention on one process, and the same through the cp group, compared on this rank's
// tokens.
void expect_matches_one_process(const Shape& s, ContextAttention mode) {
  comm::Communicator& world = comm::world();
  const int cp = world.size();
  const ContextSplit split = ContextSplit::make(cp, world.rank(), 2 * cp * s.chunk);
  const int64_t seq = split.seq, local = split.local();
  const int64_t qw = s.heads * s.head_dim, kw = s.kv_heads * s.head_dim, vw = s.kv_heads * s.v_dim,
                ow = s.heads * s.v_dim;
  // Every rank draws the same whole sequence.
  const std::vector<float> q = random_floats(s.batch * seq * qw, 1), k = random_floats(s.batch * seq * kw, 2),
                           v = random_floats(s.batch * seq * vw, 3),
                           dout = random_floats(s.batch * seq * ow, 4);
  ops::AttentionParams whole;
  whole.batch = s.batch, whole.seq = seq, whole.heads = s.heads, whole.kv_heads = s.kv_heads;
  whole.head_dim = s.head_dim, whole.v_head_dim = s.v_dim;
  whole.q_stride = qw, whole.k_stride = kw, whole.v_stride = vw, whole.out_stride = ow;
  whole.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<float> out(s.batch * seq * ow), lse(s.batch * s.heads * seq), dq(q.size()), dk(k.size()),
      dv(v.size());
  whole.q = q.data(), whole.k = k.data(), whole.v = v.data(), whole.out = out.data(), whole.lse = lse.data();
  ops::attention_forward(whole);
  whole.dout = dout.data(), whole.dout_stride = ow;
  whole.dq = dq.data(), whole.dk = dk.data(), whole.dv = dv.data();
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

  std::vector<float> lq = mine(q, qw), lk = mine(k, kw), lv = mine(v, vw), ldout = mine(dout, ow);
  std::vector<float> lout(s.batch * local * ow, -7.0f), llse(lse_mine.size(), -7.0f), ldq(lq.size(), -7.0f),
      ldk(lk.size(), -7.0f), ldv(lv.size(), -7.0f);
  ops::AttentionParams p = whole;
  p.seq = local;
  p.q = lq.data(), p.k = lk.data(), p.v = lv.data(), p.out = lout.data(), p.lse = llse.data();
  context_attention_forward(world, split, mode, p);
  p.dout = ldout.data(), p.dq = ldq.data(), p.dk = ldk.data(), p.dv = ldv.data();
  context_attention_backward(world, split, mode, p);

  auto expect_near = [&](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(double(want[i]))));
    EXPECT_LT(worst, 2e-5) << what << " of rank " << world.rank() << " of " << cp << " ("
                           << context_attention_name(mode) << ")";
  };
  expect_near(lout, mine(out, ow), "out");
  expect_near(llse, lse_mine, "lse");
  expect_near(ldq, mine(dq, qw), "dq");
  expect_near(ldk, mine(dk, kw), "dk");
  expect_near(ldv, mine(dv, vw), "dv");
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
}  // namespace forge::parallel
