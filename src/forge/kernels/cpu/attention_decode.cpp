// Attention for a few new queries against a longer key/value cache: the decoding step of generation
// (one token per sequence) and short chunks after it. The flash forward keeps kBlock queries in SIMD lanes,
// which a single query would leave 63/64 idle; here the SIMD lanes run along head_dim instead.
//
// One work item is one (batch, kv head) pair and one chunk of kChunkKeys keys. Its rows are the group's
// query heads times the new tokens, so every key and value row of the chunk is read once from memory for
// all of them (what makes grouped-query decoding cheap). Per tile of kBlock keys: scores by SIMD dot
// products of each key row with every query row, an online softmax along each row, then O[rows, dim] += P V
// with the accumulators in registers. Decoding is memory-bound, so rows are read where they lie (staged
// only when head_dim, or v_head_dim for values, is not a multiple of the lane count) with a short software
// prefetch. Values may alias the keys (MLA's absorbed decode reads them from the first v_head_dim columns of
// the key rows): both are only read. Chunks write
// unnormalised partial outputs with their row maxima and sums; a second pass combines the chunks of each
// pair in chunk order. The chunk size is fixed, so a long cache spreads over the threads while results stay
// independent of the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "forge/kernels/cpu/attention_tiles.h"
#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

using namespace attention_tiles;

constexpr int64_t kChunkKeys = 4 * kBlock;
constexpr int kMaxAccumulators = 8;  // output vectors per row kept in registers by accumulate_row
// Key and value rows requested ahead of the scores: a couple of rows keeps the line fill buffers busy without
// overflowing them (8 rows ahead measured slower at head_dim 128), and pulls the values in for P V.
constexpr int64_t kDecodeRowsAhead = 2;

// Expects parameters with their defaults resolved (v_head_dim set).
struct DecodeGeometry {
  int64_t batch, seq, heads, kv_heads, dim, v_dim, group, rows, kv_seq, q_offset, chunks, dim_padded,
      v_dim_padded;
  explicit DecodeGeometry(const ops::AttentionParams& p)
      : batch(p.batch),
        seq(p.seq),
        heads(p.heads),
        kv_heads(p.kv_heads),
        dim(p.head_dim),
        v_dim(p.v_head_dim),
        group(p.heads / p.kv_heads),
        rows(group * p.seq),
        kv_seq(p.kv_seq),
        q_offset(p.q_offset),
        chunks((p.kv_seq + kChunkKeys - 1) / kChunkKeys),
        dim_padded((p.head_dim + kLanes - 1) / kLanes * kLanes),
        v_dim_padded((p.v_head_dim + kLanes - 1) / kLanes * kLanes) {}
  // Row r of a pair is query head (kv_head * group + r / seq) at new token r % seq; the last key it sees.
  int64_t last_key(const ops::AttentionParams& p, int64_t row) const {
    return p.causal ? q_offset + row % seq : kv_seq - 1;
  }
  // The first key it sees (its sliding window's start).
  int64_t first_key(const ops::AttentionParams& p, int64_t row) const {
    return p.window > 0 ? std::max<int64_t>(0, q_offset + row % seq - p.window + 1) : 0;
  }
  int64_t scratch_floats() const {
    return rows * dim_padded + rows * kBlock + kBlock * dim_padded + kBlock * v_dim_padded;
  }
};

// acc[0, kVectorsPerRow * kLanes) = acc * alpha + sum_j probs[j] * values[j, :] for j < count (values rows
// row_stride apart): the accumulators stay in registers across the keys.
template <int kVectorsPerRow>
void accumulate_row(float* acc, float alpha, const float* probs, const float* values, int64_t count,
                    int64_t row_stride) {
  Vec a[kVectorsPerRow];
  for (int c = 0; c < kVectorsPerRow; ++c) a[c] = mul(load(acc + c * kLanes), splat(alpha));
  for (int64_t j = 0; j < count; ++j) {
    const Vec pj = splat(probs[j]);
    for (int c = 0; c < kVectorsPerRow; ++c)
      a[c] = fmadd(pj, load(values + j * row_stride + c * kLanes), a[c]);
  }
  for (int c = 0; c < kVectorsPerRow; ++c) store(acc + c * kLanes, a[c]);
}

using AccumulateRow = void (*)(float*, float, const float*, const float*, int64_t, int64_t);
constexpr AccumulateRow kAccumulateRows[kMaxAccumulators] = {
    accumulate_row<1>, accumulate_row<2>, accumulate_row<3>, accumulate_row<4>,
    accumulate_row<5>, accumulate_row<6>, accumulate_row<7>, accumulate_row<8>};

// The same over a whole row of dim_padded floats, kMaxAccumulators vectors at a time.
void accumulate(float* acc, float alpha, const float* probs, const float* values, int64_t count,
                int64_t dim_padded, int64_t row_stride) {
  for (int64_t first = 0; first < dim_padded; first += kMaxAccumulators * kLanes) {
    const int64_t vectors = std::min<int64_t>(kMaxAccumulators, (dim_padded - first) / kLanes);
    kAccumulateRows[vectors - 1](acc + first, alpha, probs, values + first, count, row_stride);
  }
}

// <a, b> over n elements, n a multiple of kLanes.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec s0 = splat(0.0f), s1 = splat(0.0f);
  int64_t d = 0;
  for (; d + 2 * kLanes <= n; d += 2 * kLanes) {
    s0 = fmadd(load(a + d), load(b + d), s0);
    s1 = fmadd(load(a + d + kLanes), load(b + d + kLanes), s1);
  }
  if (d < n) s0 = fmadd(load(a + d), load(b + d), s0);
  return reduce_add(add(s0, s1));
}

// One (pair, chunk) item: writes acc [rows, v_dim_padded] (unnormalised), row maxima m (base 2, -inf for a
// row that sees none of the chunk's keys) and row sums l.
void decode_chunk(const ops::AttentionParams& p, const DecodeGeometry& g, int64_t pair, int64_t chunk,
                  float* scratch, float* acc, float* m, float* l) {
  const int64_t b = pair / g.kv_heads, kv_head = pair % g.kv_heads, dim = g.dim, width = g.dim_padded;
  const int64_t v_dim = g.v_dim, v_width = g.v_dim_padded;
  float* qs = scratch;               // [rows, width] queries, pre-scaled into base-2 logits, zero-padded
  float* st = qs + g.rows * width;   // [rows, kBlock] scores, then probabilities
  float* kr = st + g.rows * kBlock;  // [kBlock, width] keys and [kBlock, v_width] values, zero-padded (when
  float* vr = kr + kBlock * width;   // dim or v_dim is not a multiple of kLanes; otherwise read in place)
  std::fill(acc, acc + g.rows * v_width, 0.0f);
  std::fill(m, m + g.rows, -kInfinity);
  std::fill(l, l + g.rows, 0.0f);

  const SoftCap softcap(p.softcap);
  const int64_t key_begin = chunk * kChunkKeys;
  int64_t key_end = std::min(g.kv_seq, key_begin + kChunkKeys);
  if (p.causal) key_end = std::min(key_end, g.q_offset + g.seq);
  if (key_begin >= key_end) return;

  const bool k_staged = width != dim, v_staged = v_width != v_dim;
  if (k_staged) {
    std::fill(qs, qs + g.rows * width, 0.0f);
    std::fill(kr, kr + kBlock * width, 0.0f);
  }
  if (v_staged) std::fill(vr, vr + kBlock * v_width, 0.0f);
  for (int64_t member = 0; member < g.group; ++member) {
    const float* q = p.q.f32() + b * g.seq * p.q_stride + (kv_head * g.group + member) * dim;
    copy_rows(q, p.q_stride, g.seq, dim, p.scale * kLog2e, qs + member * g.seq * width, width);
  }
  const float* k = p.k.f32() + b * p.k_batch_stride + kv_head * p.k_head_stride;
  const float* v = p.v.f32() + b * p.v_batch_stride + kv_head * p.v_head_stride;
  const int64_t k_stride = k_staged ? width : p.k_stride, v_stride = v_staged ? v_width : p.v_stride;

  for (int64_t k0 = key_begin; k0 < key_end; k0 += kBlock) {
    const int64_t nk = std::min<int64_t>(kBlock, key_end - k0);
    const float* keys = k + k0 * p.k_stride;
    const float* values = v + k0 * p.v_stride;
    if (k_staged) {
      copy_rows(keys, p.k_stride, nk, dim, 1.0f, kr, width);
      keys = kr;
    }
    if (v_staged) {
      copy_rows(values, p.v_stride, nk, v_dim, 1.0f, vr, v_width);
      values = vr;
    }
    // Scores, key by key: each key row is read once for all rows of the group.
    for (int64_t j = 0; j < nk; ++j) {
      if (j + kDecodeRowsAhead < key_end - k0) {
        if (!k_staged) prefetch_row(keys + (j + kDecodeRowsAhead) * k_stride, dim);
        if (!v_staged) prefetch_row(values + (j + kDecodeRowsAhead) * v_stride, v_dim);
      }
      const float* key = keys + j * k_stride;
      for (int64_t r = 0; r < g.rows; ++r) st[r * kBlock + j] = dot(qs + r * width, key, width);
    }
    for (int64_t r = 0; r < g.rows; ++r) {
      // Keys k0 + hidden .. k0 + visible - 1 of this block are the row's.
      const int64_t visible = std::min(nk, g.last_key(p, r) - k0 + 1);
      const int64_t hidden = std::max<int64_t>(0, g.first_key(p, r) - k0);
      if (visible <= hidden) continue;
      float* s = st + r * kBlock;
      if (softcap.on())
        for (int i = 0; i < kVectors; ++i) store(s + i * kLanes, softcap.apply(load(s + i * kLanes)));
      std::fill(s, s + hidden, -kInfinity);
      std::fill(s + visible, s + kBlock, -kInfinity);
      Vec row_max = load(s);
      for (int i = 1; i < kVectors; ++i) row_max = max(row_max, load(s + i * kLanes));
      const float m_new = std::max(m[r], reduce_max(row_max));
      const float alpha = std::exp2(m[r] - m_new);  // 0 for the first visible tile (m = -inf)
      Vec sum = splat(0.0f);
      for (int i = 0; i < kVectors; ++i) {
        const Vec e = pow2(sub(load(s + i * kLanes), splat(m_new)));
        store(s + i * kLanes, e);
        sum = add(sum, e);
      }
      l[r] = l[r] * alpha + reduce_add(sum);
      m[r] = m_new;
      accumulate(acc + r * v_width, alpha, s, values, visible, v_width, v_stride);
    }
  }
}

// Combines the chunks of one pair in chunk order and writes out (and lse) for its rows.
void combine_pair(const ops::AttentionParams& p, const DecodeGeometry& g, int64_t pair, const float* acc,
                  const float* m, const float* l) {
  const int64_t b = pair / g.kv_heads, kv_head = pair % g.kv_heads, v_dim = g.v_dim;
  const int64_t item_rows = g.rows, first_item = pair * g.chunks;
  for (int64_t r = 0; r < g.rows; ++r) {
    float row_max = -kInfinity;
    for (int64_t c = 0; c < g.chunks; ++c) row_max = std::max(row_max, m[(first_item + c) * item_rows + r]);
    float total = 0.0f;
    const int64_t member = r / g.seq, t = r % g.seq, h = kv_head * g.group + member;
    float* out = p.out.f32() + (b * g.seq + t) * p.out_stride + h * v_dim;
    std::fill(out, out + v_dim, 0.0f);
    for (int64_t c = 0; c < g.chunks; ++c) {
      const int64_t row = (first_item + c) * item_rows + r;
      if (m[row] == -kInfinity) continue;
      const float weight = std::exp2(m[row] - row_max);
      total += l[row] * weight;
      const float* a = acc + row * g.v_dim_padded;
      for (int64_t d = 0; d < v_dim; ++d) out[d] += a[d] * weight;
    }
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;  // a row that sees no key (a ring block): 0
    for (int64_t d = 0; d < v_dim; ++d) out[d] *= inverse;
    if (p.lse) p.lse[(b * g.heads + h) * g.seq + t] = (row_max + std::log2(total)) * kLn2;
  }
}

}  // namespace

void attention_forward_decode(const ops::AttentionParams& p) {
  const DecodeGeometry g(p);
  const int64_t pairs = g.batch * g.kv_heads, items = pairs * g.chunks;
  // Partial results per item, written before they are read. Kept per calling thread and only grown: a
  // decoding step calls this once per layer, and fresh pages every call would cost more than long caches'
  // attention itself.
  thread_local std::vector<float> partials;
  const size_t partial_floats = static_cast<size_t>(items * g.rows * (g.v_dim_padded + 2));
  if (partials.size() < partial_floats) partials.resize(partial_floats);
  float* acc = partials.data();
  float* m = acc + items * g.rows * g.v_dim_padded;
  float* l = m + items * g.rows;
  ThreadScratch scratch(g.scratch_floats());
  // A short cache of a small model is not worth a parallel region (a decoding step runs one per layer).
  const bool parallel = g.batch * g.kv_heads * g.kv_seq * g.dim_padded * g.rows > (1 << 16);
#pragma omp parallel if (parallel)
  {
    float* mine = scratch.mine();
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < items; ++n)
      decode_chunk(p, g, n / g.chunks, n % g.chunks, mine, acc + n * g.rows * g.v_dim_padded, m + n * g.rows,
                   l + n * g.rows);
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < pairs; ++pair) combine_pair(p, g, pair, acc, m, l);
  }
}

bool supports_kv_append(const ops::KvAppendParams& p, std::string* reason) {
  if (p.batch >= 0 && p.tokens >= 0 && p.kv_heads > 0 && p.head_dim > 0 && p.position >= 0) return true;
  return ops::refuse(reason, "kv_append: bad shape batch={} tokens={} kv_heads={} head_dim={} position={}",
                     p.batch, p.tokens, p.kv_heads, p.head_dim, p.position);
}

void kv_append(const ops::KvAppendParams& p) {
  if (std::string why; !supports_kv_append(p, &why)) fail("{}", why);
  const size_t row_bytes = static_cast<size_t>(p.head_dim) * sizeof(float);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < p.tokens; ++t) {
      const float* row = p.qkv + (b * p.tokens + t) * p.qkv_stride;
      for (int64_t g = 0; g < p.kv_heads; ++g) {
        const int64_t slot = b * p.batch_stride + g * p.head_stride + (p.position + t) * p.head_dim;
        std::memcpy(p.keys + slot, row + p.k_offset + g * p.head_dim, row_bytes);
        std::memcpy(p.values + slot, row + p.v_offset + g * p.head_dim, row_bytes);
      }
    }
}

}  // namespace forge::cpu
