// Grouped-query attention on CPU, flash style: tiled over query and key blocks with an online softmax, so
// no seq x seq matrix ever exists; each thread holds a few block-sized tiles.
//
// Layout: every tile keeps one block dimension (kBlock queries or kBlock keys) in SIMD lanes, and every
// matrix product is "rows of a matrix, broadcast element by element, times a packed lane panel"
// (tile_gemm, a register-blocked micro-kernel). Per-query softmax statistics then live in lanes (no
// horizontal reductions). The operand that becomes the panel is transposed once per work item; the rows
// that items read again and again are staged per thread in contiguous copies (RowStage).
//
// Backward is FlashAttention-2 (D = rowsum(dO o O), P recomputed from q, k and lse), race-free in one of
// two schemes: two passes, one per (batch, kv head, key block) accumulating dK, dV over the group's query
// heads and all query blocks and one per (batch, head, query block) for dQ; or fused, one item per (batch,
// kv head) that also accumulates dQ in thread-local rows (fewer products, fewer items). Each output element
// is written once, by the item that owns it, and both schemes add the same terms in the same order, so
// results do not depend on the thread count, the schedule or the scheme.
//
// Values may be narrower or wider than queries and keys (v_head_dim, MLA): the value, output and dout tiles
// and rows are v_head_dim tall or wide, the query, key, dq and dk ones head_dim.
//
// Inference over a key/value cache generalises the forward: queries sit at positions q_offset.. among kv_seq
// keys, and k, v may live in a cache with its own head and batch strides. A few queries against a longer
// cache go to attention_decode.cpp instead, which runs SIMD dot products along head_dim (query tiles would
// leave most lanes idle).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "forge/kernels/cpu/attention_tiles.h"
#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

using namespace attention_tiles;  // the tile toolkit is this file's vocabulary

// ---- shapes, work items, scratch ----

// Expects parameters with their defaults resolved (with_defaults).
struct Geometry {
  int64_t batch, seq, heads, kv_heads, head_dim, v_dim, group, blocks, kv_seq, q_offset, window;
  SoftCap softcap;
  explicit Geometry(const ops::AttentionParams& p)
      : batch(p.batch),
        seq(p.seq),
        heads(p.heads),
        kv_heads(p.kv_heads),
        head_dim(p.head_dim),
        v_dim(p.v_head_dim),
        group(p.heads / p.kv_heads),
        blocks((p.seq + kBlock - 1) / kBlock),
        kv_seq(p.kv_seq),
        q_offset(p.q_offset),
        window(p.window),
        softcap(p.softcap) {}
  // Offset of token t of batch b, head h in a [batch, seq, heads, head_dim] view with token stride `stride`.
  int64_t at(int64_t b, int64_t t, int64_t h, int64_t stride) const {
    return (b * seq + t) * stride + h * head_dim;
  }
  // The same in a [batch, seq, heads, v_dim] view (v, out, dout, dv).
  int64_t at_v(int64_t b, int64_t t, int64_t h, int64_t stride) const {
    return (b * seq + t) * stride + h * v_dim;
  }
  // The first key the query at `position` sees (the sliding window's start).
  int64_t first_key(int64_t position) const {
    return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  }
  // Key blocks [begin, end) seen by queries at positions first .. last: whole kBlock blocks from the first
  // query's window start, up to the last query (causal) or every key.
  int64_t keys_begin(int64_t first) const { return first_key(first) / kBlock * kBlock; }
  int64_t keys_end(bool causal, int64_t last) const { return causal ? std::min(kv_seq, last + 1) : kv_seq; }
  // Whether a key block starting at k0 holds keys before the window of the query at `last`.
  bool window_cuts(int64_t k0, int64_t last) const { return window > 0 && k0 <= last - window; }
};

// Scores of keys outside the sliding window of their query lane: keys key .. key + window - 1 < query.
inline Vec outside_window(const Vec& query, int64_t key, int64_t window, const Vec& yes, const Vec& no) {
  return select_less(splat(static_cast<float>(key + window - 1)), query, yes, no);
}

// v_head_dim, kv_seq and the k, v head and batch strides with their defaults filled in.
ops::AttentionParams with_defaults(ops::AttentionParams p) {
  if (p.v_head_dim == 0) p.v_head_dim = p.head_dim;
  if (p.kv_seq == 0) p.kv_seq = p.seq;
  if (p.k_head_stride == 0) p.k_head_stride = p.head_dim;
  if (p.v_head_stride == 0) p.v_head_stride = p.v_head_dim;
  if (p.k_batch_stride == 0) p.k_batch_stride = std::max(p.kv_seq * p.k_stride, p.kv_heads * p.k_head_stride);
  if (p.v_batch_stride == 0) p.v_batch_stride = std::max(p.kv_seq * p.v_stride, p.kv_heads * p.v_head_stride);
  // A window as long as the last query's position + 1 hides no key (and positions stay below 2^24 as floats).
  if (p.window >= p.q_offset + p.seq) p.window = 0;
  return p;
}

// A few queries against a longer cache (decoding): query tiles would leave most of their lanes idle, so the
// decode kernel keeps keys in the lanes instead. Training's square attention always takes the tiles above.
constexpr int64_t kDecodeMaxQueries = 16;
bool use_decode_kernel(const ops::AttentionParams& p) {
  return p.seq <= kDecodeMaxQueries && (p.kv_seq != p.seq || p.q_offset != 0);
}

bool supports(const ops::AttentionParams& p, bool backward, std::string* reason) {
  using ops::refuse;
  if (!(p.batch > 0 && p.seq > 0 && p.heads > 0 && p.kv_heads > 0 && p.head_dim > 0))
    return refuse(reason, "attention: empty shape batch={} seq={} heads={} kv_heads={} head_dim={}", p.batch,
                  p.seq, p.heads, p.kv_heads, p.head_dim);
  if (p.heads % p.kv_heads != 0)
    return refuse(reason, "attention: heads {} not a multiple of kv_heads {}", p.heads, p.kv_heads);
  if (p.v_head_dim < 0) return refuse(reason, "attention: negative v_head_dim {}", p.v_head_dim);
  if (p.window < 0) return refuse(reason, "attention: negative window {}", p.window);
  if (!(p.softcap >= 0.0f && std::isfinite(p.softcap)))
    return refuse(reason, "attention: softcap {} must be finite and >= 0", p.softcap);
  const int64_t v_dim = p.v_head_dim == 0 ? p.head_dim : p.v_head_dim;
  if (!(p.kv_seq >= 0 && p.q_offset >= 0 && p.k_batch_stride >= 0 && p.v_batch_stride >= 0 &&
        p.k_head_stride >= 0 && p.v_head_stride >= 0))
    return refuse(reason, "attention: negative kv_seq {}, q_offset {} or stride", p.kv_seq, p.q_offset);
  const int64_t kv_seq = p.kv_seq == 0 ? p.seq : p.kv_seq;
  if (p.causal && p.q_offset + p.seq > kv_seq)
    return refuse(reason, "attention: queries at positions {}..{} need their keys, but kv_seq is {}",
                  p.q_offset, p.q_offset + p.seq - 1, kv_seq);
  if (!(p.q_offset + p.seq < (int64_t{1} << 24) && kv_seq < (int64_t{1} << 24)))
    return refuse(reason, "attention: seq {} / kv_seq {} too long (positions are compared as floats)",
                  p.q_offset + p.seq, kv_seq);
  if (!(p.q && p.k && p.v && p.out)) return refuse(reason, "attention: q, k, v and out must be set");
  if (!(p.k.dtype() == p.dtype() && p.v.dtype() == p.dtype() && p.out.dtype() == p.dtype()))
    return refuse(reason, "attention: q, k, v and out must hold one dtype (q {}, k {}, v {}, out {})",
                  dtype_name(p.q.dtype()), dtype_name(p.k.dtype()), dtype_name(p.v.dtype()),
                  dtype_name(p.out.dtype()));
  if (!p.lse && backward) return refuse(reason, "attention backward: lse must be set");
  const int64_t q_width = p.heads * p.head_dim, kv_width = p.kv_heads * p.head_dim;
  const int64_t out_width = p.heads * v_dim, v_width = p.kv_heads * v_dim;
  if (!(p.q_stride >= q_width && p.out_stride >= out_width))
    return refuse(reason, "attention: q_stride {} / out_stride {} < {} / {}", p.q_stride, p.out_stride,
                  q_width, out_width);
  // Heads side by side within a token need a token stride of all of them; heads apart need at least one.
  const int64_t k_head = p.k_head_stride == 0 ? p.head_dim : p.k_head_stride;
  const int64_t v_head = p.v_head_stride == 0 ? v_dim : p.v_head_stride;
  if (!(k_head >= p.head_dim && v_head >= v_dim))
    return refuse(reason, "attention: head strides {} / {} < head_dim {} / v_head_dim {}", k_head, v_head,
                  p.head_dim, v_dim);
  // (One key per sequence: its token stride is never stepped, so a cache of one position, whose heads lie
  // head_dim apart, passes whichever layout it reads as.)
  if (!(kv_seq == 1 || (p.k_stride >= (k_head == p.head_dim ? kv_width : p.head_dim) &&
                        p.v_stride >= (v_head == v_dim ? v_width : v_dim))))
    return refuse(reason, "attention: k_stride {} / v_stride {} too small for {} kv heads of {} / {}",
                  p.k_stride, p.v_stride, p.kv_heads, p.head_dim, v_dim);
  if (!(p.batch == 1 ||
        ((p.k_batch_stride == 0 || p.k_batch_stride >= std::max(kv_seq * p.k_stride, p.kv_heads * k_head)) &&
         (p.v_batch_stride == 0 || p.v_batch_stride >= std::max(kv_seq * p.v_stride, p.kv_heads * v_head)))))
    return refuse(reason, "attention: batch strides {} / {} overlap sequences of {} keys", p.k_batch_stride,
                  p.v_batch_stride, kv_seq);
  if (p.dtype() != DType::f32 && use_decode_kernel(with_defaults(p)))
    return refuse(reason,
                  "attention: decoding over a key/value cache takes fp32 queries, keys and values, not {}",
                  dtype_name(p.dtype()));
  if (!backward) return true;
  if (!(kv_seq == p.seq && (p.q_offset == 0 || !p.causal) && k_head == p.head_dim && v_head == v_dim &&
        (p.k_batch_stride == 0 || p.k_batch_stride == p.seq * p.k_stride) &&
        (p.v_batch_stride == 0 || p.v_batch_stride == p.seq * p.v_stride)))
    return refuse(
        reason,
        "attention backward: only square attention (no kv_seq, head or batch strides; q_offset only "
        "without the causal mask) is supported");
  if (!(p.dout && p.dq && p.dk && p.dv))
    return refuse(reason, "attention backward: dout, dq, dk and dv must be set");
  if (!(p.dout.dtype() == p.dtype() && p.dq.dtype() == p.dtype() && p.dk.dtype() == p.dtype() &&
        p.dv.dtype() == p.dtype()))
    return refuse(reason, "attention backward: dout, dq, dk and dv must hold q's dtype {}",
                  dtype_name(p.dtype()));
  if (!(p.dout_stride >= out_width && p.dq_stride >= q_width))
    return refuse(reason, "attention backward: dout_stride {} / dq_stride {} < {} / {}", p.dout_stride,
                  p.dq_stride, out_width, q_width);
  if (!(p.dk_stride >= kv_width && p.dv_stride >= v_width))
    return refuse(reason, "attention backward: dk_stride {} / dv_stride {} < {} / {}", p.dk_stride,
                  p.dv_stride, kv_width, v_width);
  return true;
}

void check_params(const ops::AttentionParams& p, bool backward) {
  if (std::string why; !supports(p, backward, &why)) fail("{}", why);
}

// Work items, numbered so that each (batch, kv head) pair's items are adjacent (a thread stages the pair's
// rows once and reuses them) and, within the pair, the costliest blocks come first: a dynamic schedule
// then fills the tail with cheap items and the triangular causal work balances across threads.
struct Item {
  int64_t pair, batch, kv_head, block, member;  // member: query head within the kv head's group, or 0
};
Item item_at(int64_t n, const Geometry& g, int64_t members, bool heavy_blocks_last) {
  const int64_t per_pair = g.blocks * members, pair = n / per_pair, rank = n % per_pair / members;
  return {pair, pair / g.kv_heads, pair % g.kv_heads, heavy_blocks_last ? g.blocks - 1 - rank : rank,
          n % members};
}

// ---- forward: one item = (batch, head, query block) ----

int64_t forward_tile_floats(int64_t dim, int64_t v_dim) { return (dim + v_dim) * kBlock + kBlock * kBlock; }

template <typename T>
void forward_block(const ops::AttentionParams& p, const Geometry& g, const Item& it, float* tiles,
                   RowStage& stage) {
  const int64_t dim = g.head_dim, v_dim = g.v_dim, h = it.kv_head * g.group + it.member, b = it.batch;
  const int64_t q0 = it.block * kBlock, nq = std::min<int64_t>(kBlock, g.seq - q0);
  float* qt = tiles;                // [dim, kBlock] queries, pre-scaled into base-2 logits
  float* ot = qt + dim * kBlock;    // [v_dim, kBlock] unnormalised output
  float* st = ot + v_dim * kBlock;  // [kBlock keys, kBlock queries] scores, then probabilities
  const T* k = typed<T>(p.k) + b * p.k_batch_stride + it.kv_head * p.k_head_stride;
  const T* v = typed<T>(p.v) + b * p.v_batch_stride + it.kv_head * p.v_head_stride;
  pack_transposed(typed<T>(p.q) + g.at(b, q0, h, p.q_stride), p.q_stride, nq, dim, p.scale * kLog2e, qt);

  // Queries of this block sit at key positions q_offset + q0 + i.
  const int64_t first_query = g.q_offset + q0;
  const int64_t last_query = first_query + nq - 1;
  const LaneIndex query(first_query);
  Vec m[kVectors], l[kVectors];
  for (int i = 0; i < kVectors; ++i) m[i] = splat(-kInfinity), l[i] = splat(0.0f);
  const int64_t key_begin = g.keys_begin(first_query), key_end = g.keys_end(p.causal, last_query);
  // Without the causal mask a window may leave a block of queries no key at all (a ring block).
  if (key_begin >= key_end) std::fill(ot, ot + v_dim * kBlock, 0.0f);
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kBlock) {
    const int64_t nk = std::min<int64_t>(kBlock, key_end - k0);
    const float* kr = stage.rows(it.pair, 0, k, p.k_stride, k0, nk);
    const float* vr = stage.rows(it.pair, 1, v, p.v_stride, k0, nk);
    tile_gemm<true, Init::zero>(nk, kr, dim, dim, qt, st);
    // Online softmax per query lane: running max m and sum l, the old output rescaled by alpha.
    const bool masked = p.causal && k0 + nk - 1 > first_query, cut = g.window_cuts(k0, last_query);
    const bool capped = g.softcap.on();
    Vec m_new[kVectors];
    for (int i = 0; i < kVectors; ++i) m_new[i] = m[i];
    for (int64_t j = 0; j < nk; ++j) {
      const Vec key = splat(static_cast<float>(k0 + j));
      for (int i = 0; i < kVectors; ++i) {
        Vec s = load(st + j * kBlock + i * kLanes);
        if (capped) s = g.softcap.apply(s);
        if (masked) s = select_less(query.v[i], key, splat(-kInfinity), s);
        if (cut) s = outside_window(query.v[i], k0 + j, g.window, splat(-kInfinity), s);
        if (masked || cut || capped) store(st + j * kBlock + i * kLanes, s);
        m_new[i] = max(m_new[i], s);
      }
    }
    // A lane that has seen no key yet (a window starting after this block's first keys) keeps m = -inf;
    // its exponentials are taken against 0 instead, so that they come out 0 rather than NaN.
    Vec alpha[kVectors], sum[kVectors], base[kVectors];
    for (int i = 0; i < kVectors; ++i) {
      base[i] = select_less(m_new[i], splat(-std::numeric_limits<float>::max()), splat(0.0f), m_new[i]);
      alpha[i] = pow2(sub(m[i], base[i])), m[i] = m_new[i], sum[i] = splat(0.0f);
    }
    for (int64_t j = 0; j < nk; ++j)
      for (int i = 0; i < kVectors; ++i) {
        Vec e = pow2(sub(load(st + j * kBlock + i * kLanes), base[i]));
        store(st + j * kBlock + i * kLanes, e);
        sum[i] = add(sum[i], e);
      }
    for (int i = 0; i < kVectors; ++i) l[i] = fmadd(l[i], alpha[i], sum[i]);
    // ot[d, i] = alpha_i ot[d, i] + sum_j v[j, d] st[j, i]
    if (k0 == key_begin)
      tile_gemm<false, Init::zero>(v_dim, vr, v_dim, nk, st, ot);
    else
      tile_gemm<false, Init::scaled>(v_dim, vr, v_dim, nk, st, ot, alpha);
  }

  float m_lanes[kBlock], l_lanes[kBlock], inverse_l[kBlock];
  for (int i = 0; i < kVectors; ++i) store(m_lanes + i * kLanes, m[i]), store(l_lanes + i * kLanes, l[i]);
  for (int64_t i = 0; i < nq; ++i) inverse_l[i] = l_lanes[i] > 0.0f ? 1.0f / l_lanes[i] : 0.0f;  // no key: 0
  if (p.lse) {
    float* lse = p.lse + (b * g.heads + h) * g.seq + q0;
    for (int64_t i = 0; i < nq; ++i) lse[i] = (m_lanes[i] + std::log2(l_lanes[i])) * kLn2;
  }
  unpack_transposed(ot, nq, v_dim, 1.0f, inverse_l, typed<T>(p.out) + g.at_v(b, q0, h, p.out_stride),
                    p.out_stride);
}

// ---- backward ----

// Under soft-capping a score's gradient is the capped score's times 1 - tanh^2.
inline Vec capped_slope(const Vec& tanh) { return sub(splat(1.0f), mul(tanh, tanh)); }

// delta[b, h, t] = <dout_t, out_t> for every row (FlashAttention-2's D = rowsum(dO o O)).
template <typename T>
void row_dots(const ops::AttentionParams& p, const Geometry& g, float* delta) {
#pragma omp parallel for schedule(static)
  for (int64_t token = 0; token < g.batch * g.seq; ++token) {
    const int64_t b = token / g.seq, t = token % g.seq;
    for (int64_t h = 0; h < g.heads; ++h) {
      const T* dout = typed<T>(p.dout) + g.at_v(b, t, h, p.dout_stride);
      const T* out = typed<T>(p.out) + g.at_v(b, t, h, p.out_stride);
      Vec lanes = splat(0.0f);
      int64_t d = 0;
      for (; d + kLanes <= g.v_dim; d += kLanes) lanes = fmadd(load(dout + d), load(out + d), lanes);
      float partial[kLanes], s = 0.0f;
      store(partial, lanes);
      for (float x : partial) s += x;
      for (; d < g.v_dim; ++d) s += load_float(dout, d) * load_float(out, d);
      delta[(b * g.heads + h) * g.seq + t] = s;
    }
  }
}

// Columns of the dQ accumulator rows: head_dim rounded up to whole tiles of lanes.
int64_t padded_dim(int64_t dim) { return (dim + kBlock - 1) / kBlock * kBlock; }

int64_t backward_tile_floats(int64_t dim, int64_t v_dim) {
  return 2 * (dim + v_dim) * kBlock + 2 * kBlock * kBlock + 2 * kBlock + kBlock * padded_dim(dim);
}

// Pass 1: one item = (batch, kv head, key block); dK and dV, accumulated over the group's query heads and
// every query block that sees these keys. With dq_rows set (the fused scheme, whose item owns the whole
// (batch, kv head) pair) it also adds this key block's dS K to the group's dQ rows [group, seq, padded_dim].
//
// Scores here are q k^T with q pre-scaled (the dQ pass computes k q^T the same way), so that both schemes
// form every P, dS and dQ sum from the same operands in the same order: their dQ agree bitwise.
template <typename T>
void backward_key_block(const ops::AttentionParams& p, const Geometry& g, const Item& it, const float* delta,
                        float* tiles, RowStage& stage, float* dq_rows) {
  const int64_t dim = g.head_dim, v_dim = g.v_dim, b = it.batch, kvh = it.kv_head, dq_width = padded_dim(dim);
  const int64_t k0 = it.block * kBlock, nk = std::min<int64_t>(kBlock, g.seq - k0);
  float* kt = tiles;                               // [dim, kBlock] keys
  float* vt = kt + dim * kBlock;                   // [v_dim, kBlock]
  float* dkt = vt + v_dim * kBlock;                // [dim, kBlock]
  float* dvt = dkt + dim * kBlock;                 // [v_dim, kBlock]
  float* pt = dvt + v_dim * kBlock;                // [kBlock queries, kBlock keys] probabilities
  float* dst = pt + kBlock * kBlock;               // [kBlock queries, kBlock keys] dP, then dS
  float* kr = dst + kBlock * kBlock + 2 * kBlock;  // [kBlock keys, dq_width] rows of k, zero-padded
  const T* k = typed<T>(p.k) + g.at(b, k0, kvh, p.k_stride);
  pack_transposed(k, p.k_stride, nk, dim, 1.0f, kt);
  pack_transposed(typed<T>(p.v) + g.at_v(b, k0, kvh, p.v_stride), p.v_stride, nk, v_dim, 1.0f, vt);
  std::fill(dkt, dkt + (dim + v_dim) * kBlock, 0.0f);
  if (dq_rows) {
    std::fill(kr, kr + kBlock * dq_width, 0.0f);
    copy_rows(k, p.k_stride, nk, dim, 1.0f, kr, dq_width);
  }

  const LaneIndex key(k0);
  const float q_factor = p.scale * kLog2e;  // scores in base 2
  for (int64_t member = 0; member < g.group; ++member) {
    const int64_t h = kvh * g.group + member;
    const T* q = typed<T>(p.q) + g.at(b, 0, h, p.q_stride);
    const T* dout = typed<T>(p.dout) + g.at_v(b, 0, h, p.dout_stride);
    // Under the causal mask queries before k0 see none of these keys; under a window neither do queries at
    // or past k0 + nk - 1 + window.
    const int64_t q_end = g.window > 0 ? std::min(g.seq, k0 + nk - 1 + g.window - g.q_offset) : g.seq;
    for (int64_t q0 = p.causal ? k0 : 0; q0 < q_end; q0 += kBlock) {
      const int64_t nq = std::min<int64_t>(kBlock, g.seq - q0);
      const float* qr = stage.rows(it.pair, 2 * member, q, p.q_stride, q0, nq, q_factor);
      const float* dor = stage.rows(it.pair, 2 * member + 1, dout, p.dout_stride, q0, nq);
      const float* lse = p.lse + (b * g.heads + h) * g.seq + q0;
      const float* row_delta = delta + (b * g.heads + h) * g.seq + q0;
      tile_gemm<true, Init::zero>(nq, qr, dim, dim, kt, pt);        // base-2 scores
      tile_gemm<true, Init::zero>(nq, dor, v_dim, v_dim, vt, dst);  // dP = dout v^T
      // Zero the keys after the query (causal) and the padding lanes past the sequence, so that those
      // lanes of dK^T, dV^T stay finite.
      const int64_t first_query = g.q_offset + q0;
      const bool cut = g.window_cuts(k0, first_query + nq - 1);
      const bool masked = (p.causal && k0 + kBlock - 1 > q0) || k0 + kBlock > g.seq || cut;
      for (int64_t i = 0; i < nq; ++i) {
        const Vec last_key = splat(static_cast<float>(p.causal ? q0 + i : g.seq - 1));
        const Vec first_key = splat(static_cast<float>(g.first_key(first_query + i)));
        const Vec row_lse = splat(lse[i] * kLog2e), row_d = splat(row_delta[i]);
        for (int v = 0; v < kVectors; ++v) {
          Vec score = load(pt + i * kBlock + v * kLanes), slope = splat(1.0f);
          if (g.softcap.on()) score = g.softcap.apply(score, slope), slope = capped_slope(slope);
          Vec prob = pow2(sub(score, row_lse));
          if (masked) prob = select_less(last_key, key.v[v], splat(0.0f), prob);
          if (cut) prob = select_less(key.v[v], first_key, splat(0.0f), prob);
          store(pt + i * kBlock + v * kLanes, prob);
          Vec ds = mul(prob, sub(load(dst + i * kBlock + v * kLanes), row_d));
          if (g.softcap.on()) ds = mul(ds, slope);
          store(dst + i * kBlock + v * kLanes, ds);
        }
      }
      tile_gemm<false, Init::accumulate>(v_dim, dor, v_dim, nq, pt, dvt);  // dV^T += dout^T P
      tile_gemm<false, Init::accumulate>(dim, qr, dim, nq, dst, dkt);      // dK^T += (q_factor q)^T dS
      if (dq_rows) {
        float* dq = dq_rows + (member * g.seq + q0) * dq_width;
        for (int64_t chunk = 0; chunk < dq_width; chunk += kBlock)  // dQ += dS k
          tile_gemm<true, Init::accumulate>(nq, dst, kBlock, nk, kr + chunk, dq + chunk, nullptr, dq_width,
                                            dq_width);
      }
    }
  }
  // dK = scale dS^T q = ln2 dS^T (q_factor q), with no division by a zero scale.
  unpack_transposed(dkt, nk, dim, kLn2, nullptr, typed<T>(p.dk) + g.at(b, k0, kvh, p.dk_stride), p.dk_stride);
  unpack_transposed(dvt, nk, v_dim, 1.0f, nullptr, typed<T>(p.dv) + g.at_v(b, k0, kvh, p.dv_stride),
                    p.dv_stride);
}

// The fused scheme: one item = one (batch, kv head) pair, all its key blocks in order, dQ accumulated in the
// thread's rows and written at the end. Five block products per block pair instead of the two-pass
// scheme's seven, but only batch * kv_heads items.
template <typename T>
void backward_pair(const ops::AttentionParams& p, const Geometry& g, int64_t pair, const float* delta,
                   float* tiles, RowStage& stage, float* dq_rows) {
  const int64_t dq_width = padded_dim(g.head_dim);
  std::fill(dq_rows, dq_rows + g.group * g.seq * dq_width, 0.0f);
  for (int64_t kb = 0; kb < g.blocks; ++kb)
    backward_key_block<T>(p, g, item_at(pair * g.blocks + kb, g, 1, false), delta, tiles, stage, dq_rows);
  const int64_t b = pair / g.kv_heads, kvh = pair % g.kv_heads;
  for (int64_t member = 0; member < g.group; ++member) {
    T* dq = typed<T>(p.dq) + g.at(b, 0, kvh * g.group + member, p.dq_stride);
    for (int64_t t = 0; t < g.seq; ++t) {
      const float* acc = dq_rows + (member * g.seq + t) * dq_width;
      for (int64_t d = 0; d < g.head_dim; ++d) store_float(dq, t * p.dq_stride + d, acc[d] * p.scale);
    }
  }
}

// Pass 2: one item = (batch, head, query block); dQ.
template <typename T>
void backward_query_block(const ops::AttentionParams& p, const Geometry& g, const Item& it,
                          const float* delta, float* tiles, RowStage& stage) {
  const int64_t dim = g.head_dim, v_dim = g.v_dim, h = it.kv_head * g.group + it.member, b = it.batch;
  const int64_t q0 = it.block * kBlock, nq = std::min<int64_t>(kBlock, g.seq - q0);
  float* qt = tiles;                     // [dim, kBlock] queries, pre-scaled into base-2 logits
  float* dot = qt + dim * kBlock;        // [v_dim, kBlock] dout
  float* dqt = dot + v_dim * kBlock;     // [dim, kBlock]
  float* st = dqt + dim * kBlock;        // [kBlock keys, kBlock queries] scores
  float* dst = st + kBlock * kBlock;     // [kBlock keys, kBlock queries] dP, then dS
  float* lanes = dst + kBlock * kBlock;  // [2, kBlock] base-2 lse and delta per query lane
  pack_transposed(typed<T>(p.q) + g.at(b, q0, h, p.q_stride), p.q_stride, nq, dim, p.scale * kLog2e, qt);
  pack_transposed(typed<T>(p.dout) + g.at_v(b, q0, h, p.dout_stride), p.dout_stride, nq, v_dim, 1.0f, dot);
  const float* lse = p.lse + (b * g.heads + h) * g.seq + q0;
  const float* row_delta = delta + (b * g.heads + h) * g.seq + q0;
  for (int64_t i = 0; i < kBlock; ++i) {
    lanes[i] = i < nq ? lse[i] * kLog2e : 0.0f;
    lanes[kBlock + i] = i < nq ? row_delta[i] : 0.0f;
  }
  Vec lse_lanes[kVectors], delta_lanes[kVectors];
  for (int i = 0; i < kVectors; ++i)
    lse_lanes[i] = load(lanes + i * kLanes), delta_lanes[i] = load(lanes + kBlock + i * kLanes);
  const T* k = typed<T>(p.k) + g.at(b, 0, it.kv_head, p.k_stride);
  const T* v = typed<T>(p.v) + g.at_v(b, 0, it.kv_head, p.v_stride);

  const int64_t first_query = g.q_offset + q0, last_query = first_query + nq - 1;
  const LaneIndex query(first_query);
  const int64_t key_begin = g.keys_begin(first_query), key_end = g.keys_end(p.causal, last_query);
  if (key_begin >= key_end) std::fill(dqt, dqt + dim * kBlock, 0.0f);  // no key seen: dQ = 0
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kBlock) {
    const int64_t nk = std::min<int64_t>(kBlock, key_end - k0);
    const float* kr = stage.rows(it.pair, 0, k, p.k_stride, k0, nk);
    const float* vr = stage.rows(it.pair, 1, v, p.v_stride, k0, nk);
    tile_gemm<true, Init::zero>(nk, kr, dim, dim, qt, st);
    tile_gemm<true, Init::zero>(nk, vr, v_dim, v_dim, dot, dst);
    const bool masked = p.causal && k0 + nk - 1 > first_query, cut = g.window_cuts(k0, last_query);
    for (int64_t j = 0; j < nk; ++j) {
      const Vec key = splat(static_cast<float>(k0 + j));
      for (int i = 0; i < kVectors; ++i) {
        Vec score = load(st + j * kBlock + i * kLanes), slope = splat(1.0f);
        if (g.softcap.on()) score = g.softcap.apply(score, slope), slope = capped_slope(slope);
        Vec prob = pow2(sub(score, lse_lanes[i]));
        if (masked) prob = select_less(query.v[i], key, splat(0.0f), prob);
        if (cut) prob = outside_window(query.v[i], k0 + j, g.window, splat(0.0f), prob);
        Vec ds = mul(prob, sub(load(dst + j * kBlock + i * kLanes), delta_lanes[i]));
        if (g.softcap.on()) ds = mul(ds, slope);
        store(dst + j * kBlock + i * kLanes, ds);
      }
    }
    // dQ^T[d, i] += sum_j k[j, d] dS[j, i]
    if (k0 == key_begin)
      tile_gemm<false, Init::zero>(dim, kr, dim, nk, dst, dqt);
    else
      tile_gemm<false, Init::accumulate>(dim, kr, dim, nk, dst, dqt);
  }
  unpack_transposed(dqt, nq, dim, p.scale, nullptr, typed<T>(p.dq) + g.at(b, q0, h, p.dq_stride),
                    p.dq_stride);
}

}  // namespace

bool supports_attention_forward(const ops::AttentionParams& p, std::string* reason) {
  return supports(p, false, reason);
}
bool supports_attention_backward(const ops::AttentionParams& p, std::string* reason) {
  return supports(p, true, reason);
}

namespace {

template <typename T>
void run_forward(const ops::AttentionParams& p) {
  const Geometry g(p);
  // Staged rows: k (head_dim) and v (v_dim) of one (batch, kv head) pair.
  const int64_t tile_floats = forward_tile_floats(g.head_dim, g.v_dim),
                capacity = stage_capacity(g.kv_seq, g.head_dim + g.v_dim);
  ThreadScratch scratch(tile_floats + capacity * (g.head_dim + g.v_dim));
#pragma omp parallel
  {
    float* mine = scratch.mine();
    RowStage stage(mine + tile_floats, 1, capacity, g.head_dim, g.v_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < g.batch * g.heads * g.blocks; ++n)
      forward_block<T>(p, g, item_at(n, g, g.group, p.causal), mine, stage);
  }
}

}  // namespace

void attention_forward(const ops::AttentionParams& params) {
  check_params(params, false);
  const ops::AttentionParams p = with_defaults(params);
  if (use_decode_kernel(p)) return attention_forward_decode(p);
  if (p.dtype() == DType::bf16) return run_forward<uint16_t>(p);
  run_forward<float>(p);
}

// The fused scheme does 5/7 of the two-pass scheme's block products but spreads only batch * kv_heads
// items over the threads; it wins unless that leaves threads idle, and it needs a dQ accumulator of
// group * seq * head_dim floats per thread. Both give bitwise the same results, so the choice may depend
// on the thread count.
bool use_fused_backward(const Geometry& g, int threads) {
  const int64_t pairs = g.batch * g.kv_heads, rounds = (pairs + threads - 1) / threads;
  constexpr int64_t kMaxAccumulatorFloats = int64_t{1} << 20;  // 4 MiB per thread
  return 5 * rounds * threads < 7 * pairs &&
         g.group * g.seq * padded_dim(g.head_dim) <= kMaxAccumulatorFloats;
}

namespace {

template <typename T>
void run_backward(const ops::AttentionParams& p) {
  const Geometry g(p);
  std::vector<float> delta(g.batch * g.heads * g.seq);
  row_dots<T>(p, g, delta.data());
  const bool fused = use_fused_backward(g, omp_get_max_threads());
  // Staged rows: q (head_dim) and dout (v_dim) of each of the group's heads in the dK/dV pass, k and v in the
  // dQ pass.
  const int64_t tile_floats = backward_tile_floats(g.head_dim, g.v_dim);
  const int64_t row_floats = g.group * (g.head_dim + g.v_dim);
  const int64_t capacity = stage_capacity(g.seq, row_floats);
  const int64_t dq_floats = fused ? g.group * g.seq * padded_dim(g.head_dim) : 0;
  ThreadScratch scratch(tile_floats + capacity * row_floats + dq_floats);
#pragma omp parallel
  {
    float* mine = scratch.mine();
    float* staged = mine + tile_floats;
    if (fused) {
      RowStage stage(staged, g.group, capacity, g.head_dim, g.v_dim);
#pragma omp for schedule(dynamic, 1)
      for (int64_t pair = 0; pair < g.batch * g.kv_heads; ++pair)
        backward_pair<T>(p, g, pair, delta.data(), mine, stage, staged + capacity * row_floats);
    } else {
      {
        RowStage stage(staged, g.group, capacity, g.head_dim, g.v_dim);
        // Early key blocks meet the most queries under the causal mask.
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < g.batch * g.kv_heads * g.blocks; ++n)
          backward_key_block<T>(p, g, item_at(n, g, 1, false), delta.data(), mine, stage, nullptr);
      }
      RowStage stage(staged, 1, capacity, g.head_dim, g.v_dim);
#pragma omp for schedule(dynamic, 1)
      for (int64_t n = 0; n < g.batch * g.heads * g.blocks; ++n)
        backward_query_block<T>(p, g, item_at(n, g, g.group, p.causal), delta.data(), mine, stage);
    }
  }
}

}  // namespace

void attention_backward(const ops::AttentionParams& params) {
  check_params(params, true);
  const ops::AttentionParams p = with_defaults(params);
  if (p.dtype() == DType::bf16) return run_backward<uint16_t>(p);
  run_backward<float>(p);
}

}  // namespace forge::cpu
