// Attention over a key/value cache (inference): new queries at positions q_offset.. against kv_seq cached
// keys that live in a buffer allocated for more positions, against a double-precision reference. Covers
// both kernels behind attention_forward: the decode kernel (a few queries, keys in lanes, chunked caches)
// and the flash tiles with an offset (prefill), under MHA, GQA and MQA, odd lengths and head dims.
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

struct CacheCase {
  int64_t batch, seq, q_offset, kv_seq, heads, kv_heads, head_dim;
  bool causal = true;
  float scale_factor = 1.0f;
  bool head_major =
      false;  // cache [batch, kv_heads, capacity, dim] instead of [batch, capacity, kv_heads, dim]
};

std::ostream& operator<<(std::ostream& os, const CacheCase& c) {
  return os << "b" << c.batch << "_new" << c.seq << "_at" << c.q_offset << "_kv" << c.kv_seq << "_h"
            << c.heads << "_kvh" << c.kv_heads << "_d" << c.head_dim << (c.causal ? "_causal" : "_full")
            << "_x" << c.scale_factor << (c.head_major ? "_headmajor" : "");
}

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
  // Offset of position j, kv head g of sequence b in k and v.
  int64_t kv_at(int64_t b, int64_t j, int64_t g) const {
    return b * batch_stride + g * head_stride + j * token_stride;
  }
  std::vector<float> dense_out() const {
    std::vector<float> dense;
    for (int64_t t = 0; t < c.batch * c.seq; ++t)
      dense.insert(dense.end(), out.begin() + t * out_stride, out.begin() + t * out_stride + q_width);
    return dense;
  }
  // Double-precision softmax attention, materialised: out [batch, seq, heads, dim], lse [batch, heads, seq].
  void reference(std::vector<double>& want_out, std::vector<double>& want_lse) const {
    const int64_t D = c.head_dim, group = c.heads / c.kv_heads;
    const double scale = c.scale_factor / std::sqrt(double(D));
    want_out.assign(c.batch * c.seq * q_width, 0.0);
    want_lse.assign(c.batch * c.heads * c.seq, 0.0);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.heads; ++h)
        for (int64_t t = 0; t < c.seq; ++t) {
          const int64_t keys = c.causal ? c.q_offset + t + 1 : c.kv_seq;
          const float* qr = &q[(b * c.seq + t) * q_stride + h * D];
          std::vector<double> s(keys);
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < keys; ++j) {
            const float* kr = &k[kv_at(b, j, h / group)];
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += double(qr[d]) * kr[d];
            s[j] = scale * dot;
            m = std::max(m, s[j]);
          }
          double sum = 0;
          for (double x : s) sum += std::exp(x - m);
          want_lse[(b * c.heads + h) * c.seq + t] = m + std::log(sum);
          double* o = &want_out[(b * c.seq + t) * q_width + h * D];
          for (int64_t j = 0; j < keys; ++j) {
            const float* vr = &v[kv_at(b, j, h / group)];
            for (int64_t d = 0; d < D; ++d) o[d] += std::exp(s[j] - m) / sum * vr[d];
          }
        }
  }
};

class AttentionCacheTest : public ::testing::TestWithParam<CacheCase> {};

TEST_P(AttentionCacheTest, MatchesDoubleReference) {
  const CacheCase c = GetParam();
  CacheProblem prob(c, 17);
  ops::attention_forward(prob.params());
  std::vector<double> want_out, want_lse;
  prob.reference(want_out, want_lse);
  // fp32 dot products and an fp32 online softmax, as the training kernel: ~1e-6 relative, bound 1e-5.
  EXPECT_LT(testing::relative_error(prob.dense_out(), want_out), 1e-5);
  EXPECT_LT(testing::relative_error(prob.lse, want_lse), 1e-5);
  for (int64_t t = 0; t < c.batch * c.seq; ++t)
    for (int64_t e = prob.q_width; e < prob.out_stride; ++e)
      ASSERT_EQ(prob.out[t * prob.out_stride + e], CacheProblem::kSentinel) << "out padding written";
}

TEST_P(AttentionCacheTest, LseIsOptional) {
  const CacheCase c = GetParam();
  CacheProblem with(c, 29), without(c, 29);
  ops::attention_forward(with.params());
  auto p = without.params();
  p.lse = nullptr;
  ops::attention_forward(p);
  EXPECT_EQ(with.out, without.out);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionCacheTest,
    ::testing::Values(
        // decode kernel: a few queries against a longer cache
        CacheCase{2, 1, 36, 37, 4, 2, 16},               // one new token, GQA, batch 2
        CacheCase{1, 1, 0, 1, 2, 2, 16},                 // the first token
        CacheCase{1, 1, 299, 300, 4, 1, 64},             // MQA, two chunks (one partial)
        CacheCase{2, 3, 67, 70, 6, 2, 24},               // three new tokens, head_dim 24 (padded)
        CacheCase{1, 2, 598, 600, 2, 1, 8, true, 4.0f},  // three chunks, peaky softmax
        CacheCase{1, 1, 64, 65, 2, 2, 200},              // head_dim 200: more output vectors than registers
        CacheCase{2, 2, 48, 50, 4, 4, 16, false},        // non-causal: every cached key
        CacheCase{1, 16, 100, 116, 8, 2, 32},            // the largest decode chunk, 32 rows per pair
        CacheCase{1, 1, 10, 300, 4, 2, 16},              // causal: a query early in a longer cache
        CacheCase{2, 1, 299, 300, 8, 2, 64, true, 1.0f, true},  // head-major cache (forge's KvCache)
        CacheCase{1, 3, 40, 43, 4, 4, 24, true, 1.0f, true},    // head-major, staged head_dim
        // flash tiles with an offset: prefill onto a cache
        CacheCase{1, 40, 60, 100, 4, 2, 16},              // a chunk of prompt after earlier tokens
        CacheCase{2, 17, 0, 17, 4, 1, 16},                // prompt into an empty cache (MQA)
        CacheCase{1, 130, 5, 135, 2, 2, 64, true, 3.0f},  // three query blocks, offset not a block multiple
        CacheCase{1, 20, 0, 90, 2, 1, 16, false},         // non-causal, kv longer than the queries
        CacheCase{2, 33, 10, 43, 4, 2, 16, true, 1.0f, true}),  // head-major prefill
    [](const auto& info) {
      std::ostringstream name;
      name << info.param;
      std::string s = name.str();
      std::replace(s.begin(), s.end(), '.', 'p');
      return s;
    });

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

// Cache positions past kv_seq (stale or never written) must not leak into the result.
TEST(AttentionCache, IgnoresPositionsPastKvSeq) {
  for (bool head_major : {false, true}) {
    const CacheCase c{1, 1, 40, 41, 2, 2, 16, true, 1.0f, head_major};
    CacheProblem a(c, 3), b(c, 3);
    for (int64_t j = c.kv_seq; j < b.capacity; ++j)
      for (int64_t g = 0; g < c.kv_heads; ++g)
        for (int64_t d = 0; d < c.head_dim; ++d)
          b.k[b.kv_at(0, j, g) + d] = std::numeric_limits<float>::quiet_NaN(),
                                 b.v[b.kv_at(0, j, g) + d] = 1e30f;
    ops::attention_forward(a.params());
    ops::attention_forward(b.params());
    EXPECT_EQ(a.out, b.out);
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

}  // namespace
}  // namespace forge
