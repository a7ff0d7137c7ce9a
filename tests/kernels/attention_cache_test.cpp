// Attention over a key/value cache (inference), what only the CPU kernels promise: decoding token by token
// gives the rows of square attention, the decode kernel's chunks do not depend on the thread count, and the
// CPU's position and stride checks. The cache forward against the double-precision reference (decode and
// prefill, MHA, GQA, MQA, both cache layouts, lse optional, positions past kv_seq ignored) is an op test run
// on every backend: op_tests/attention.h (AttentionCacheOp, AttentionFixed).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::attention_cache_test {
namespace {

struct CacheCase {
  int64_t batch, seq, q_offset, kv_seq, heads, kv_heads, head_dim;
  bool causal = true;
  float scale_factor = 1.0f;
  bool head_major =
      false;  // cache [batch, kv_heads, capacity, dim] instead of [batch, capacity, kv_heads, dim]
};

// q [batch, seq, heads, dim] with a padded token stride; k and v in caches [batch, capacity, kv_heads, dim]
// or [batch, kv_heads, capacity, dim] (capacity > kv_seq, plus gaps between heads and sequences) of which
// the first kv_seq positions are filled.
struct CacheProblem {
  CacheCase c;
  int64_t q_width, kv_width, q_stride, out_stride, capacity, token_stride, head_stride, batch_stride;
  std::vector<float> q, k, v, out, lse;
  static constexpr float kSentinel = -12345.0f;

  CacheProblem(const CacheCase& cc, uint32_t seed) : c(cc) {
    q_width = c.heads * c.head_dim;
    kv_width = c.kv_heads * c.head_dim;
    q_stride = q_width + 3;
    out_stride = q_width + 5;
    capacity = c.kv_seq + 7;
    token_stride = c.head_major ? c.head_dim : kv_width;
    head_stride = c.head_major ? capacity * c.head_dim + 5 : c.head_dim;
    batch_stride = (c.head_major ? c.kv_heads * head_stride : capacity * kv_width) + 11;
    q = testing::random_floats(c.batch * c.seq * q_stride, seed);
    k = testing::random_floats(c.batch * batch_stride, seed + 1);
    v = testing::random_floats(c.batch * batch_stride, seed + 2);
    out.assign(c.batch * c.seq * out_stride, kSentinel);
    lse.assign(c.batch * c.heads * c.seq, kSentinel);
  }
  ops::AttentionParams params() {
    ops::AttentionParams p;
    p.batch = c.batch, p.seq = c.seq, p.heads = c.heads, p.kv_heads = c.kv_heads, p.head_dim = c.head_dim;
    p.q = q.data(), p.k = k.data(), p.v = v.data();
    p.q_stride = q_stride, p.k_stride = p.v_stride = token_stride;
    p.k_head_stride = p.v_head_stride = c.head_major ? head_stride : 0;  // 0: the default, head_dim
    p.k_batch_stride = p.v_batch_stride = batch_stride;
    p.kv_seq = c.kv_seq, p.q_offset = c.q_offset;
    p.out = out.data(), p.out_stride = out_stride, p.lse = lse.data();
    p.scale = c.scale_factor / std::sqrt(float(c.head_dim));
    p.causal = c.causal;
    return p;
  }
};

// Decoding one token at a time must give the rows of square causal attention over the whole sequence
// (the training kernel), within fp32 rounding.
TEST(AttentionCache, TokenByTokenMatchesSquareAttention) {
  const int64_t batch = 2, seq = 70, heads = 4, kv_heads = 2, dim = 16;
  const int64_t q_width = heads * dim, kv_width = kv_heads * dim, stride = q_width + 2 * kv_width;
  std::vector<float> qkv = testing::random_floats(batch * seq * stride, 5);
  std::vector<float> square(batch * seq * q_width), lse(batch * heads * seq);
  ops::AttentionParams p;
  p.batch = batch, p.seq = seq, p.heads = heads, p.kv_heads = kv_heads, p.head_dim = dim;
  p.q = qkv.data(), p.k = p.q + q_width, p.v = p.k + kv_width;
  p.q_stride = p.k_stride = p.v_stride = stride;
  p.out = square.data(), p.out_stride = q_width, p.lse = lse.data();
  p.scale = 0.25f;
  ops::attention_forward(p);

  std::vector<float> row(batch * q_width);
  for (int64_t t = 0; t < seq; ++t) {
    ops::AttentionParams d = p;
    d.seq = 1, d.q_offset = t, d.kv_seq = t + 1;
    d.q = qkv.data() + t * stride;  // query t of each sequence: batch stride seq * stride
    d.q_stride = seq * stride;      // one query per sequence, so the token stride steps between sequences
    d.k_batch_stride = d.v_batch_stride = seq * stride;
    d.out = row.data(), d.lse = nullptr;
    ops::attention_forward(d);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t e = 0; e < q_width; ++e)
        ASSERT_NEAR(row[b * q_width + e], square[(b * seq + t) * q_width + e], 2e-6) << "token " << t;
  }
}

// MLA's absorbed decode: one kv head of q/k 576 whose values are the first 512 columns of each key row
// (v = k). Token by token through the decode kernel it must give the rows of square attention over the same
// aliased rows (the flash tiles), within fp32 rounding: dot products of 576 terms and sums over up to 40 keys
// of O(1) values, ~1e-6.
TEST(AttentionCache, AbsorbedMlaDecodeMatchesSquareAttention) {
  const int64_t seq = 40, heads = 16, dim = 576, v_dim = 512, stride = heads * dim + dim;
  std::vector<float> qk = testing::random_floats(seq * stride, 9);
  std::vector<float> square(seq * heads * v_dim), lse(heads * seq);
  ops::AttentionParams p;
  p.batch = 1, p.seq = seq, p.heads = heads, p.kv_heads = 1, p.head_dim = dim, p.v_head_dim = v_dim;
  p.q = qk.data(), p.k = p.v = p.q + heads * dim;
  p.q_stride = p.k_stride = p.v_stride = stride;
  p.v_head_stride = dim;  // the alias keeps k's layout
  p.out = square.data(), p.out_stride = heads * v_dim, p.lse = lse.data();
  p.scale = 1.0f / std::sqrt(192.0f);  // DeepSeek-V3 scales by the unabsorbed q/k width
  ops::attention_forward(p);

  std::vector<float> row(heads * v_dim);
  for (int64_t t = 0; t < seq; ++t) {
    ops::AttentionParams d = p;
    d.seq = 1, d.q_offset = t, d.kv_seq = t + 1;
    d.q = qk.data() + t * stride;
    d.out = row.data(), d.lse = nullptr;
    ops::attention_forward(d);
    for (int64_t e = 0; e < heads * v_dim; ++e)
      ASSERT_NEAR(row[e], square[t * heads * v_dim + e], 1e-5) << "token " << t << ", element " << e;
  }
}

// Chunks are fixed by the cache length, not the thread count: results are bitwise independent of it.
TEST(AttentionCache, DecodeBitwiseIndependentOfThreadCount) {
  const CacheCase c{2, 2, 698, 700, 4, 2, 32};
  const int saved = omp_get_max_threads();
  std::vector<CacheProblem> runs;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    runs.emplace_back(c, 9);
    ops::attention_forward(runs.back().params());
  }
  omp_set_num_threads(saved);
  for (size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(0, std::memcmp(runs[0].out.data(), runs[r].out.data(), runs[0].out.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(runs[0].lse.data(), runs[r].lse.data(), runs[0].lse.size() * sizeof(float)));
  }
}

TEST(AttentionCache, RejectsInconsistentPositionsAndStrides) {
  CacheProblem prob({2, 2, 4, 6, 2, 1, 16}, 1);  // queries at positions 4 and 5 of 6
  ops::attention_forward(prob.params());
  auto p = prob.params();
  p.q_offset = 5;  // the second query would need a seventh key
  testing::expect_error_containing([&] { ops::attention_forward(p); }, {"positions 5..6", "kv_seq is 6"});
  p = prob.params();
  p.q_offset = -1;
  testing::expect_error_containing([&] { ops::attention_forward(p); }, {"negative"});
  p = prob.params();
  p.k_batch_stride = 3;  // overlaps the sequences
  testing::expect_error_containing([&] { ops::attention_forward(p); }, {"batch strides 3"});
  p = prob.params();
  p.k_head_stride = 8;  // heads overlap
  testing::expect_error_containing([&] { ops::attention_forward(p); }, {"head strides 8"});
  p = prob.params();
  std::vector<float> grads(prob.q.size() + 2 * prob.k.size());
  p.dout = prob.q.data(), p.dout_stride = prob.q_stride;
  p.dq = grads.data(), p.dk = grads.data(), p.dv = grads.data();
  p.dq_stride = prob.q_stride, p.dk_stride = p.dv_stride = prob.kv_width;
  testing::expect_error_containing([&] { ops::attention_backward(p); }, {"only square attention"});
}

// A head-major cache of one position (a one-token prompt with one new token: forge generate's cache then
// holds a single position) has heads head_dim apart and a token stride of head_dim, which also reads as
// heads side by side with too short a token stride; with one key the token stride is never stepped, so it
// runs, and each query head's output is its kv head's value.
TEST(AttentionCache, ACacheOfOnePositionRuns) {
  const int64_t heads = 4, kv_heads = 2, dim = 8;
  std::vector<float> q = testing::random_floats(heads * dim, 1),
                     k = testing::random_floats(kv_heads * dim, 2),
                     v = testing::random_floats(kv_heads * dim, 3), out(heads * dim), lse(heads);
  ops::AttentionParams p;
  p.batch = 1, p.seq = 1, p.heads = heads, p.kv_heads = kv_heads, p.head_dim = dim;
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.out = out.data(), p.lse = lse.data();
  p.q_stride = p.out_stride = heads * dim, p.k_stride = p.v_stride = dim;
  p.k_head_stride = p.v_head_stride = dim;  // capacity 1 x head_dim
  p.kv_seq = 1, p.scale = 0.5f;
  ops::attention_forward(p);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(out[h * dim + d], v[(h / (heads / kv_heads)) * dim + d]);
}

}  // namespace
}  // namespace forge::attention_cache_test
