// Grouped-query attention on CPU, flash style: tiled over query and key blocks with an online softmax, so
// no seq x seq matrix ever exists; each thread holds a few block-sized tiles.
//
// Layout: every tile keeps one block dimension (kBlock queries or kBlock keys) in SIMD lanes, and every
// matrix product is "rows of a matrix, broadcast element by element, times a packed lane panel"
// (tile_gemm, a register-blocked micro-kernel). Per-query softmax statistics then live in lanes (no
// horizontal reductions). The operand that becomes the panel is transposed once per work item; the rows
// that items read again and again are staged per thread in contiguous copies (RowStage).
//
// Backward is FlashAttention-2 in two race-free passes that both recompute P from q, k and lse: one per
// (batch, kv head, key block) accumulating dK, dV over the group's query heads and all query blocks, one
// per (batch, head, query block) for dQ. Each output element is written once, by the item that owns it,
// so results do not depend on the thread count or the schedule.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"

#if defined(__AVX512F__)
// GCC 12 flags its own _mm512_undefined_ps() placeholders as maybe-uninitialized once inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace forge::cpu {
namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 64;  // queries or keys per tile
constexpr int kVectors = kBlock / kLanes;
constexpr int kRows = 6;  // rows per micro-kernel call: kRows x kVectors = 24 accumulators (of 32 zmm)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.69314718055994531f;
constexpr float kInfinity = std::numeric_limits<float>::infinity();

// ---- 16-lane vectors: AVX-512 intrinsics, or GCC/Clang vector extensions elsewhere ----

#if defined(__AVX512F__)
using Vec = __m512;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec splat(float s) { return _mm512_set1_ps(s); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // NaN in a gives b
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
// Lanes where a < b take `yes`, the others `no`.
inline Vec select_less(Vec a, Vec b, Vec yes, Vec no) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), no, yes);
}
inline Vec round_nearest(Vec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^n for integral n in [-127, 127], and exactly 0 where n <= -127.
inline Vec scale_by_pow2(Vec p, Vec n) {
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(n, splat(-127.0f), _CMP_GT_OQ), p, n);
}
#else
#pragma GCC diagnostic ignored "-Wpsabi"  // internal functions only: the vector ABI change does not matter
using Vec = float __attribute__((vector_size(64)));
using VecInt = int32_t __attribute__((vector_size(64)));
inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, const Vec& x) { std::memcpy(p, &x, sizeof x); }
inline Vec splat(float s) { return Vec{} + s; }
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return a * b + c; }
inline Vec add(const Vec& a, const Vec& b) { return a + b; }
inline Vec sub(const Vec& a, const Vec& b) { return a - b; }
inline Vec mul(const Vec& a, const Vec& b) { return a * b; }
inline Vec max(const Vec& a, const Vec& b) { return a > b ? a : b; }
inline Vec min(const Vec& a, const Vec& b) { return a < b ? a : b; }
inline Vec select_less(const Vec& a, const Vec& b, const Vec& yes, const Vec& no) { return a < b ? yes : no; }
// Adding and removing 1.5 * 2^23 rounds to the nearest integer for |x| < 2^22.
inline Vec round_nearest(const Vec& x) { return (x + 12582912.0f) - 12582912.0f; }
inline Vec scale_by_pow2(const Vec& p, const Vec& n) {
  VecInt e = (__builtin_convertvector(n, VecInt) + 127) << 23;  // 2^n in the exponent field; 0 at n = -127
  Vec v;
  std::memcpy(&v, &e, sizeof v);
  return p * v;
}
#endif

// 2^x with relative error below 2e-7. Inputs at or below -127 (including -inf from the causal mask) give
// exactly 0, and so does NaN. x = n + f with |f| <= 1/2; 2^f by a degree-5 polynomial fitted for minimal
// relative error on [-1/2, 1/2] (max 1.6e-7).
inline Vec pow2(const Vec& exponent) {
  const Vec x = min(max(exponent, splat(-127.0f)), splat(127.0f));
  const Vec n = round_nearest(x), f = sub(x, n);
  Vec p = splat(1.327647129e-3f);
  p = fmadd(p, f, splat(9.675540961e-3f));
  p = fmadd(p, f, splat(5.550713092e-2f));
  p = fmadd(p, f, splat(2.402212024e-1f));
  p = fmadd(p, f, splat(6.931469440e-1f));
  p = fmadd(p, f, splat(1.000000119e+00f));
  return scale_by_pow2(p, n);
}

// Lane l of vector v holds index first + v * kLanes + l (queries or keys of a tile), as floats for compares.
struct LaneIndex {
  Vec v[kVectors];
  explicit LaneIndex(int64_t first) {
    float lanes[kBlock];
    for (int i = 0; i < kBlock; ++i) lanes[i] = static_cast<float>(first + i);
    for (int i = 0; i < kVectors; ++i) v[i] = load(lanes + i * kLanes);
  }
};

// ---- the micro-kernel ----

enum class Init { zero, accumulate, scaled };  // C = A@P, C += A@P, C = C * lane_scale + A@P

// C[R, kBlock] (init)= A[R, depth] @ P[depth, kBlock], P and C with row strides panel_stride and c_stride:
// R x kVectors accumulators in registers, one panel row loaded and one element of A broadcast per step. A's
// element (r, k) sits at a[r * stride + k] when kDepthContiguous (token rows of k, v, q or dout), else at
// a[r + k * stride] (the transposed view: head-dim rows of the same tokens).
template <int R, bool kDepthContiguous, Init kInit>
inline void tile_rows(const float* a, int64_t stride, int64_t depth, const float* panel, int64_t panel_stride,
                      float* c, int64_t c_stride, const Vec* lane_scale) {
  Vec acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) {
      if constexpr (kInit == Init::zero) acc[r][v] = splat(0.0f);
      if constexpr (kInit == Init::accumulate) acc[r][v] = load(c + r * c_stride + v * kLanes);
      if constexpr (kInit == Init::scaled)
        acc[r][v] = mul(load(c + r * c_stride + v * kLanes), lane_scale[v]);
    }
  const float* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = a + r * (kDepthContiguous ? stride : 1);
  int64_t k = 0;
  do {  // depth >= 1 always; a do-loop lets GCC keep the accumulators in registers through the epilogue
    Vec b[kVectors];
    for (int v = 0; v < kVectors; ++v) b[v] = load(panel + k * panel_stride + v * kLanes);
    for (int r = 0; r < R; ++r) {
      Vec ar = splat(kDepthContiguous ? rows[r][k] : rows[r][k * stride]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = fmadd(ar, b[v], acc[r][v]);
    }
  } while (++k < depth);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) store(c + r * c_stride + v * kLanes, acc[r][v]);
}

template <int R, bool kDepthContiguous, Init kInit>
void tile_rows_tail(int64_t rows, const float* a, int64_t stride, int64_t depth, const float* panel,
                    int64_t panel_stride, float* c, int64_t c_stride, const Vec* lane_scale) {
  if constexpr (R > 0) {
    if (rows == R)
      return tile_rows<R, kDepthContiguous, kInit>(a, stride, depth, panel, panel_stride, c, c_stride,
                                                   lane_scale);
    tile_rows_tail<R - 1, kDepthContiguous, kInit>(rows, a, stride, depth, panel, panel_stride, c, c_stride,
                                                   lane_scale);
  }
}

// C[rows, kBlock] (init)= A[rows, depth] @ P[depth, kBlock]: kRows rows per micro-kernel call. P and C have
// row stride kBlock unless given.
template <bool kDepthContiguous, Init kInit>
void tile_gemm(int64_t rows, const float* a, int64_t stride, int64_t depth, const float* panel, float* c,
               const Vec* lane_scale = nullptr, int64_t panel_stride = kBlock, int64_t c_stride = kBlock) {
  const int64_t row_step = kDepthContiguous ? stride : 1;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    tile_rows<kRows, kDepthContiguous, kInit>(a + r * row_step, stride, depth, panel, panel_stride,
                                              c + r * c_stride, c_stride, lane_scale);
  tile_rows_tail<kRows - 1, kDepthContiguous, kInit>(rows - r, a + r * row_step, stride, depth, panel,
                                                     panel_stride, c + r * c_stride, c_stride, lane_scale);
}

// Rows of q, k, v, out, dout sit a token stride apart, usually on separate pages, where the hardware
// prefetchers do not follow; the copy loops below request rows a few ahead to keep more misses in flight.
constexpr int64_t kRowsAhead = 8;
inline void prefetch_row(const float* row, int64_t dim, bool for_write = false) {
  for (int64_t d = 0; d < dim; d += 64 / sizeof(float)) {
    if (for_write)
      __builtin_prefetch(row + d, 1, 3);
    else
      __builtin_prefetch(row + d, 0, 3);
  }
}

// panel[d, i] = rows[i * stride + d] * factor for i < count; lanes count..kBlock-1 are zero. The rows are
// usually cold (fresh q, k, v, dout): gathering 16 rows at once keeps 16 cache misses in flight, where
// scalar transposing stores would fill the store buffer and serialise them.
void pack_transposed(const float* rows, int64_t stride, int64_t count, int64_t dim, float factor,
                     float* panel) {
#if defined(__AVX512F__)
  if (stride < std::numeric_limits<int32_t>::max() / kLanes) {
    const __m512i offsets =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(static_cast<int32_t>(stride)));
    for (int g = 0; g < kVectors; ++g) {
      const int64_t lanes = std::clamp<int64_t>(count - g * kLanes, 0, kLanes);
      if (lanes == 0) {
        for (int64_t d = 0; d < dim; ++d) store(panel + d * kBlock + g * kLanes, splat(0.0f));
        continue;
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
      const float* base = rows + g * kLanes * stride;
      for (int64_t i = (g + 1) * kLanes; i < std::min<int64_t>(count, (g + 2) * kLanes); ++i)
        prefetch_row(rows + i * stride, dim);
      for (int64_t d = 0; d < dim; ++d) {
        Vec x = _mm512_mask_i32gather_ps(splat(0.0f), mask, offsets, base + d, 4);
        store(panel + d * kBlock + g * kLanes, mul(x, splat(factor)));
      }
    }
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) std::fill(panel + d * kBlock + count, panel + (d + 1) * kBlock, 0.0f);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t d = 0; d < dim; ++d) panel[d * kBlock + i] = rows[i * stride + d] * factor;
}

// rows[i * stride + d] = panel[d, i] * factor * row_factor[i] (row_factor may be null) for i < count: the
// inverse of pack_transposed. Gathers from the L1-resident panel so that each output row is written with
// full-vector stores. (Streaming stores past the cache measured 2x slower here.)
void unpack_transposed(const float* panel, int64_t count, int64_t dim, float factor, const float* row_factor,
                       float* rows, int64_t stride) {
#if defined(__AVX512F__)
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kBlock));
#endif
  for (int64_t i = 0; i < count; ++i) {
    if (i + kRowsAhead < count) prefetch_row(rows + (i + kRowsAhead) * stride, dim, true);
    const float f = row_factor ? factor * row_factor[i] : factor;
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + kLanes <= dim; d += kLanes)
      store(rows + i * stride + d, mul(_mm512_i32gather_ps(offsets, panel + d * kBlock + i, 4), splat(f)));
#endif
    for (; d < dim; ++d) rows[i * stride + d] = panel[d * kBlock + i] * f;
  }
}

// tile[i * tile_stride + d] = rows[i * stride + d] * factor for i < count, d < dim.
void copy_rows(const float* rows, int64_t stride, int64_t count, int64_t dim, float factor, float* tile,
               int64_t tile_stride) {
  for (int64_t i = 0; i < count; ++i) {
    if (i + kRowsAhead < count) prefetch_row(rows + (i + kRowsAhead) * stride, dim);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes)
      store(tile + i * tile_stride + d, mul(load(rows + i * stride + d), splat(factor)));
    for (; d < dim; ++d) tile[i * tile_stride + d] = rows[i * stride + d] * factor;
  }
}

// A thread's contiguous copies of the rows that one (batch, kv head) pair's work items read again and again:
// k and v in the forward and dQ passes, q and dout of the group's heads in the dK/dV pass. In the fused
// buffers consecutive rows sit a token stride apart (4 KiB at the training shape), so fetched block by block
// they keep missing cache: the hardware prefetchers do not cross pages and the rows alias in the cache sets.
// Each source keeps a window of up to `capacity` consecutive rows. A pair's items run back to back, the
// costliest first, so after a thread's first item of a pair the window usually covers all the rows it needs.
class RowStage {
 public:
  RowStage(float* buffer, int64_t sources, int64_t capacity, int64_t dim)
      : buffer_(buffer), capacity_(capacity), dim_(dim), windows_(sources) {}

  // Rows [first, first + count) of `source` (row r at base + r * stride), times `factor` (fixed per source),
  // as a [count, dim] block. `owner` identifies the (batch, kv head) pair; a new owner drops every window.
  const float* rows(int64_t owner, int64_t source, const float* base, int64_t stride, int64_t first,
                    int64_t count, float factor = 1.0f) {
    if (owner != owner_) {
      owner_ = owner;
      for (Window& w : windows_) w = {0, 0};
    }
    Window& w = windows_[source];
    float* staged = buffer_ + source * capacity_ * dim_;
    if (first < w.first || first + count > w.first + w.count) {
      if (first != w.first + w.count || w.count + count > capacity_) w = {first, 0};
      const int64_t from = w.first + w.count;  // rows before `from` are already staged
      copy_rows(base + from * stride, stride, first + count - from, dim_, factor, staged + w.count * dim_,
                dim_);
      w.count = first + count - w.first;
    }
    return staged + (first - w.first) * dim_;
  }

 private:
  struct Window {
    int64_t first, count;
  };
  float* buffer_;
  int64_t capacity_, dim_, owner_ = -1;
  std::vector<Window> windows_;
};

// Staged rows per source: the whole sequence while the copies fit in 4 MiB per thread, else a sliding
// window (correct either way; only reuse drops).
int64_t stage_capacity(int64_t seq, int64_t sources, int64_t dim) {
  constexpr int64_t kStageFloats = int64_t{1} << 20;
  return std::clamp<int64_t>(kStageFloats / (sources * dim), kBlock, seq);
}

// ---- shapes, work items, scratch ----

struct Geometry {
  int64_t batch, seq, heads, kv_heads, head_dim, group, blocks;
  explicit Geometry(const ops::AttentionParams& p)
      : batch(p.batch),
        seq(p.seq),
        heads(p.heads),
        kv_heads(p.kv_heads),
        head_dim(p.head_dim),
        group(p.heads / p.kv_heads),
        blocks((p.seq + kBlock - 1) / kBlock) {}
  // Offset of token t of batch b, head h in a [batch, seq, heads, head_dim] view with token stride `stride`.
  int64_t at(int64_t b, int64_t t, int64_t h, int64_t stride) const {
    return (b * seq + t) * stride + h * head_dim;
  }
};

void check_params(const ops::AttentionParams& p, bool backward) {
  FORGE_CHECK(p.batch > 0 && p.seq > 0 && p.heads > 0 && p.kv_heads > 0 && p.head_dim > 0,
              "attention: empty shape batch={} seq={} heads={} kv_heads={} head_dim={}", p.batch, p.seq,
              p.heads, p.kv_heads, p.head_dim);
  FORGE_CHECK(p.heads % p.kv_heads == 0, "attention: heads {} not a multiple of kv_heads {}", p.heads,
              p.kv_heads);
  FORGE_CHECK(p.seq < (int64_t{1} << 24), "attention: seq {} too long (positions are compared as floats)",
              p.seq);
  FORGE_CHECK(p.q && p.k && p.v && p.out && p.lse, "attention: q, k, v, out and lse must be set");
  const int64_t q_width = p.heads * p.head_dim, kv_width = p.kv_heads * p.head_dim;
  FORGE_CHECK(p.q_stride >= q_width && p.out_stride >= q_width, "attention: q_stride {} / out_stride {} < {}",
              p.q_stride, p.out_stride, q_width);
  FORGE_CHECK(p.k_stride >= kv_width && p.v_stride >= kv_width, "attention: k_stride {} / v_stride {} < {}",
              p.k_stride, p.v_stride, kv_width);
  if (!backward) return;
  FORGE_CHECK(p.dout && p.dq && p.dk && p.dv, "attention backward: dout, dq, dk and dv must be set");
  FORGE_CHECK(p.dout_stride >= q_width && p.dq_stride >= q_width,
              "attention backward: dout_stride {} / dq_stride {} < {}", p.dout_stride, p.dq_stride, q_width);
  FORGE_CHECK(p.dk_stride >= kv_width && p.dv_stride >= kv_width,
              "attention backward: dk_stride {} / dv_stride {} < {}", p.dk_stride, p.dv_stride, kv_width);
}

// One 64-byte aligned region of scratch per thread (tiles, then staged rows), allocated before the parallel
// region so that an allocation failure throws where it can be caught.
class ThreadScratch {
 public:
  explicit ThreadScratch(int64_t floats_per_thread)
      : stride_((floats_per_thread + 15) / 16 * 16), buffer_(stride_ * omp_get_max_threads() + 16) {}
  float* mine() {
    auto base = reinterpret_cast<uintptr_t>(buffer_.data());
    auto aligned = reinterpret_cast<float*>((base + 63) / 64 * 64);
    return aligned + stride_ * omp_get_thread_num();
  }

 private:
  int64_t stride_;
  std::vector<float> buffer_;
};

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

int64_t forward_tile_floats(int64_t dim) { return 2 * dim * kBlock + kBlock * kBlock; }

void forward_block(const ops::AttentionParams& p, const Geometry& g, const Item& it, float* tiles,
                   RowStage& stage) {
  const int64_t dim = g.head_dim, h = it.kv_head * g.group + it.member, b = it.batch;
  const int64_t q0 = it.block * kBlock, nq = std::min<int64_t>(kBlock, g.seq - q0);
  float* qt = tiles;              // [dim, kBlock] queries, pre-scaled into base-2 logits
  float* ot = qt + dim * kBlock;  // [dim, kBlock] unnormalised output
  float* st = ot + dim * kBlock;  // [kBlock keys, kBlock queries] scores, then probabilities
  const float* k = p.k + g.at(b, 0, it.kv_head, p.k_stride);
  const float* v = p.v + g.at(b, 0, it.kv_head, p.v_stride);
  pack_transposed(p.q + g.at(b, q0, h, p.q_stride), p.q_stride, nq, dim, p.scale * kLog2e, qt);

  const LaneIndex query(q0);
  Vec m[kVectors], l[kVectors];
  for (int i = 0; i < kVectors; ++i) m[i] = splat(-kInfinity), l[i] = splat(0.0f);
  const int64_t key_end = p.causal ? q0 + nq : g.seq;
  for (int64_t k0 = 0; k0 < key_end; k0 += kBlock) {
    const int64_t nk = std::min<int64_t>(kBlock, key_end - k0);
    const float* kr = stage.rows(it.pair, 0, k, p.k_stride, k0, nk);
    const float* vr = stage.rows(it.pair, 1, v, p.v_stride, k0, nk);
    tile_gemm<true, Init::zero>(nk, kr, dim, dim, qt, st);
    // Online softmax per query lane: running max m and sum l, the old output rescaled by alpha.
    const bool masked = p.causal && k0 + nk - 1 > q0;
    Vec m_new[kVectors];
    for (int i = 0; i < kVectors; ++i) m_new[i] = m[i];
    for (int64_t j = 0; j < nk; ++j) {
      const Vec key = splat(static_cast<float>(k0 + j));
      for (int i = 0; i < kVectors; ++i) {
        Vec s = load(st + j * kBlock + i * kLanes);
        if (masked) {
          s = select_less(query.v[i], key, splat(-kInfinity), s);
          store(st + j * kBlock + i * kLanes, s);
        }
        m_new[i] = max(m_new[i], s);
      }
    }
    Vec alpha[kVectors], sum[kVectors];
    for (int i = 0; i < kVectors; ++i)
      alpha[i] = pow2(sub(m[i], m_new[i])), m[i] = m_new[i], sum[i] = splat(0.0f);
    for (int64_t j = 0; j < nk; ++j)
      for (int i = 0; i < kVectors; ++i) {
        Vec e = pow2(sub(load(st + j * kBlock + i * kLanes), m[i]));
        store(st + j * kBlock + i * kLanes, e);
        sum[i] = add(sum[i], e);
      }
    for (int i = 0; i < kVectors; ++i) l[i] = fmadd(l[i], alpha[i], sum[i]);
    // ot[d, i] = alpha_i ot[d, i] + sum_j v[j, d] st[j, i]
    if (k0 == 0)
      tile_gemm<false, Init::zero>(dim, vr, dim, nk, st, ot);
    else
      tile_gemm<false, Init::scaled>(dim, vr, dim, nk, st, ot, alpha);
  }

  float m_lanes[kBlock], l_lanes[kBlock], inverse_l[kBlock];
  for (int i = 0; i < kVectors; ++i) store(m_lanes + i * kLanes, m[i]), store(l_lanes + i * kLanes, l[i]);
  float* lse = p.lse + (b * g.heads + h) * g.seq + q0;
  for (int64_t i = 0; i < nq; ++i) {
    inverse_l[i] = 1.0f / l_lanes[i];
    lse[i] = (m_lanes[i] + std::log2(l_lanes[i])) * kLn2;
  }
  unpack_transposed(ot, nq, dim, 1.0f, inverse_l, p.out + g.at(b, q0, h, p.out_stride), p.out_stride);
}

// ---- backward ----

// delta[b, h, t] = <dout_t, out_t> for every row (FlashAttention-2's D = rowsum(dO o O)).
void row_dots(const ops::AttentionParams& p, const Geometry& g, float* delta) {
#pragma omp parallel for schedule(static)
  for (int64_t token = 0; token < g.batch * g.seq; ++token) {
    const int64_t b = token / g.seq, t = token % g.seq;
    for (int64_t h = 0; h < g.heads; ++h) {
      const float* dout = p.dout + g.at(b, t, h, p.dout_stride);
      const float* out = p.out + g.at(b, t, h, p.out_stride);
      float s = 0.0f;
      for (int64_t d = 0; d < g.head_dim; ++d) s += dout[d] * out[d];
      delta[(b * g.heads + h) * g.seq + t] = s;
    }
  }
}

// Columns of the dQ accumulator rows: head_dim rounded up to whole tiles of lanes.
int64_t padded_dim(int64_t dim) { return (dim + kBlock - 1) / kBlock * kBlock; }

int64_t backward_tile_floats(int64_t dim) {
  return 4 * dim * kBlock + 2 * kBlock * kBlock + 2 * kBlock + kBlock * padded_dim(dim);
}

// Pass 1: one item = (batch, kv head, key block); dK and dV, accumulated over the group's query heads and
// every query block that sees these keys. With dq_rows set (the fused scheme, whose item owns the whole
// (batch, kv head) pair) it also adds this key block's dS K to the group's dQ rows [group, seq, padded_dim].
//
// Scores here are q k^T with q pre-scaled (the dQ pass computes k q^T the same way), so that both schemes
// form every P, dS and dQ sum from the same operands in the same order: their dQ agree bitwise.
void backward_key_block(const ops::AttentionParams& p, const Geometry& g, const Item& it, const float* delta,
                        float* tiles, RowStage& stage, float* dq_rows) {
  const int64_t dim = g.head_dim, b = it.batch, kvh = it.kv_head, dq_width = padded_dim(dim);
  const int64_t k0 = it.block * kBlock, nk = std::min<int64_t>(kBlock, g.seq - k0);
  float* kt = tiles;              // [dim, kBlock] keys
  float* vt = kt + dim * kBlock;  // [dim, kBlock]
  float* dkt = vt + dim * kBlock;
  float* dvt = dkt + dim * kBlock;
  float* pt = dvt + dim * kBlock;                  // [kBlock queries, kBlock keys] probabilities
  float* dst = pt + kBlock * kBlock;               // [kBlock queries, kBlock keys] dP, then dS
  float* kr = dst + kBlock * kBlock + 2 * kBlock;  // [kBlock keys, dq_width] rows of k, zero-padded
  const float* k = p.k + g.at(b, k0, kvh, p.k_stride);
  pack_transposed(k, p.k_stride, nk, dim, 1.0f, kt);
  pack_transposed(p.v + g.at(b, k0, kvh, p.v_stride), p.v_stride, nk, dim, 1.0f, vt);
  std::fill(dkt, dkt + 2 * dim * kBlock, 0.0f);
  if (dq_rows) {
    std::fill(kr, kr + kBlock * dq_width, 0.0f);
    copy_rows(k, p.k_stride, nk, dim, 1.0f, kr, dq_width);
  }

  const LaneIndex key(k0);
  const float q_factor = p.scale * kLog2e;  // scores in base 2
  for (int64_t member = 0; member < g.group; ++member) {
    const int64_t h = kvh * g.group + member;
    const float* q = p.q + g.at(b, 0, h, p.q_stride);
    const float* dout = p.dout + g.at(b, 0, h, p.dout_stride);
    // Under the causal mask queries before k0 see none of these keys.
    for (int64_t q0 = p.causal ? k0 : 0; q0 < g.seq; q0 += kBlock) {
      const int64_t nq = std::min<int64_t>(kBlock, g.seq - q0);
      const float* qr = stage.rows(it.pair, 2 * member, q, p.q_stride, q0, nq, q_factor);
      const float* dor = stage.rows(it.pair, 2 * member + 1, dout, p.dout_stride, q0, nq);
      const float* lse = p.lse + (b * g.heads + h) * g.seq + q0;
      const float* row_delta = delta + (b * g.heads + h) * g.seq + q0;
      tile_gemm<true, Init::zero>(nq, qr, dim, dim, kt, pt);    // base-2 scores
      tile_gemm<true, Init::zero>(nq, dor, dim, dim, vt, dst);  // dP = dout v^T
      // Zero the keys after the query (causal) and the padding lanes past the sequence, so that those
      // lanes of dK^T, dV^T stay finite.
      const bool masked = (p.causal && k0 + kBlock - 1 > q0) || k0 + kBlock > g.seq;
      for (int64_t i = 0; i < nq; ++i) {
        const Vec last_key = splat(static_cast<float>(p.causal ? q0 + i : g.seq - 1));
        const Vec row_lse = splat(lse[i] * kLog2e), row_d = splat(row_delta[i]);
        for (int v = 0; v < kVectors; ++v) {
          Vec prob = pow2(sub(load(pt + i * kBlock + v * kLanes), row_lse));
          if (masked) prob = select_less(last_key, key.v[v], splat(0.0f), prob);
          store(pt + i * kBlock + v * kLanes, prob);
          store(dst + i * kBlock + v * kLanes, mul(prob, sub(load(dst + i * kBlock + v * kLanes), row_d)));
        }
      }
      tile_gemm<false, Init::accumulate>(dim, dor, dim, nq, pt, dvt);  // dV^T += dout^T P
      tile_gemm<false, Init::accumulate>(dim, qr, dim, nq, dst, dkt);  // dK^T += (q_factor q)^T dS
      if (dq_rows) {
        float* dq = dq_rows + (member * g.seq + q0) * dq_width;
        for (int64_t chunk = 0; chunk < dq_width; chunk += kBlock)  // dQ += dS k
          tile_gemm<true, Init::accumulate>(nq, dst, kBlock, nk, kr + chunk, dq + chunk, nullptr, dq_width,
                                            dq_width);
      }
    }
  }
  unpack_transposed(dkt, nk, dim, p.scale / q_factor, nullptr, p.dk + g.at(b, k0, kvh, p.dk_stride),
                    p.dk_stride);
  unpack_transposed(dvt, nk, dim, 1.0f, nullptr, p.dv + g.at(b, k0, kvh, p.dv_stride), p.dv_stride);
}

// The fused scheme: one item = one (batch, kv head) pair, all its key blocks in order, dQ accumulated in the
// thread's rows and written at the end. Five block products per block pair instead of the two-pass
// scheme's seven, but only batch * kv_heads items.
void backward_pair(const ops::AttentionParams& p, const Geometry& g, int64_t pair, const float* delta,
                   float* tiles, RowStage& stage, float* dq_rows) {
  const int64_t dq_width = padded_dim(g.head_dim);
  std::fill(dq_rows, dq_rows + g.group * g.seq * dq_width, 0.0f);
  for (int64_t kb = 0; kb < g.blocks; ++kb)
    backward_key_block(p, g, item_at(pair * g.blocks + kb, g, 1, false), delta, tiles, stage, dq_rows);
  const int64_t b = pair / g.kv_heads, kvh = pair % g.kv_heads;
  for (int64_t member = 0; member < g.group; ++member) {
    float* dq = p.dq + g.at(b, 0, kvh * g.group + member, p.dq_stride);
    for (int64_t t = 0; t < g.seq; ++t) {
      const float* acc = dq_rows + (member * g.seq + t) * dq_width;
      for (int64_t d = 0; d < g.head_dim; ++d) dq[t * p.dq_stride + d] = acc[d] * p.scale;
    }
  }
}

// Pass 2: one item = (batch, head, query block); dQ.
void backward_query_block(const ops::AttentionParams& p, const Geometry& g, const Item& it,
                          const float* delta, float* tiles, RowStage& stage) {
  const int64_t dim = g.head_dim, h = it.kv_head * g.group + it.member, b = it.batch;
  const int64_t q0 = it.block * kBlock, nq = std::min<int64_t>(kBlock, g.seq - q0);
  float* qt = tiles;                     // [dim, kBlock] queries, pre-scaled into base-2 logits
  float* dot = qt + dim * kBlock;        // [dim, kBlock] dout
  float* dqt = dot + dim * kBlock;       // [dim, kBlock]
  float* st = dqt + dim * kBlock;        // [kBlock keys, kBlock queries] scores
  float* dst = st + kBlock * kBlock;     // [kBlock keys, kBlock queries] dP, then dS
  float* lanes = dst + kBlock * kBlock;  // [2, kBlock] base-2 lse and delta per query lane
  pack_transposed(p.q + g.at(b, q0, h, p.q_stride), p.q_stride, nq, dim, p.scale * kLog2e, qt);
  pack_transposed(p.dout + g.at(b, q0, h, p.dout_stride), p.dout_stride, nq, dim, 1.0f, dot);
  const float* lse = p.lse + (b * g.heads + h) * g.seq + q0;
  const float* row_delta = delta + (b * g.heads + h) * g.seq + q0;
  for (int64_t i = 0; i < kBlock; ++i) {
    lanes[i] = i < nq ? lse[i] * kLog2e : 0.0f;
    lanes[kBlock + i] = i < nq ? row_delta[i] : 0.0f;
  }
  Vec lse_lanes[kVectors], delta_lanes[kVectors];
  for (int i = 0; i < kVectors; ++i)
    lse_lanes[i] = load(lanes + i * kLanes), delta_lanes[i] = load(lanes + kBlock + i * kLanes);
  const float* k = p.k + g.at(b, 0, it.kv_head, p.k_stride);
  const float* v = p.v + g.at(b, 0, it.kv_head, p.v_stride);

  const LaneIndex query(q0);
  const int64_t key_end = p.causal ? q0 + nq : g.seq;
  for (int64_t k0 = 0; k0 < key_end; k0 += kBlock) {
    const int64_t nk = std::min<int64_t>(kBlock, key_end - k0);
    const float* kr = stage.rows(it.pair, 0, k, p.k_stride, k0, nk);
    const float* vr = stage.rows(it.pair, 1, v, p.v_stride, k0, nk);
    tile_gemm<true, Init::zero>(nk, kr, dim, dim, qt, st);
    tile_gemm<true, Init::zero>(nk, vr, dim, dim, dot, dst);
    const bool masked = p.causal && k0 + nk - 1 > q0;
    for (int64_t j = 0; j < nk; ++j) {
      const Vec key = splat(static_cast<float>(k0 + j));
      for (int i = 0; i < kVectors; ++i) {
        Vec prob = pow2(sub(load(st + j * kBlock + i * kLanes), lse_lanes[i]));
        if (masked) prob = select_less(query.v[i], key, splat(0.0f), prob);
        store(dst + j * kBlock + i * kLanes,
              mul(prob, sub(load(dst + j * kBlock + i * kLanes), delta_lanes[i])));
      }
    }
    // dQ^T[d, i] += sum_j k[j, d] dS[j, i]
    if (k0 == 0)
      tile_gemm<false, Init::zero>(dim, kr, dim, nk, dst, dqt);
    else
      tile_gemm<false, Init::accumulate>(dim, kr, dim, nk, dst, dqt);
  }
  unpack_transposed(dqt, nq, dim, p.scale, nullptr, p.dq + g.at(b, q0, h, p.dq_stride), p.dq_stride);
}

}  // namespace

void attention_forward(const ops::AttentionParams& p) {
  check_params(p, false);
  const Geometry g(p);
  const int64_t tile_floats = forward_tile_floats(g.head_dim),
                capacity = stage_capacity(g.seq, 2, g.head_dim);
  ThreadScratch scratch(tile_floats + 2 * capacity * g.head_dim);
#pragma omp parallel
  {
    float* mine = scratch.mine();
    RowStage stage(mine + tile_floats, 2, capacity, g.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < g.batch * g.heads * g.blocks; ++n)
      forward_block(p, g, item_at(n, g, g.group, p.causal), mine, stage);
  }
}

// The fused scheme does 5/7 of the two-pass scheme's block products but spreads only batch * kv_heads
// items over the threads; it wins unless that leaves threads idle, and it needs a dQ accumulator of
// group * seq * head_dim floats per thread. Both give bitwise the same results, so the choice may depend
// on the thread count.
bool use_fused_backward(const Geometry& g, int threads) {
  const int64_t pairs = g.batch * g.kv_heads, rounds = (pairs + threads - 1) / threads;
  constexpr int64_t kMaxAccumulatorFloats = int64_t{4} << 20;
  return 5 * rounds * threads < 7 * pairs &&
         g.group * g.seq * padded_dim(g.head_dim) <= kMaxAccumulatorFloats;
}

void attention_backward(const ops::AttentionParams& p) {
  check_params(p, true);
  const Geometry g(p);
  std::vector<float> delta(g.batch * g.heads * g.seq);
  row_dots(p, g, delta.data());
  const bool fused = use_fused_backward(g, omp_get_max_threads());
  const int64_t tile_floats = backward_tile_floats(g.head_dim), sources = std::max<int64_t>(2 * g.group, 2);
  const int64_t capacity = stage_capacity(g.seq, sources, g.head_dim);
  const int64_t dq_floats = fused ? g.group * g.seq * padded_dim(g.head_dim) : 0;
  ThreadScratch scratch(tile_floats + sources * capacity * g.head_dim + dq_floats);
#pragma omp parallel
  {
    float* mine = scratch.mine();
    float* staged = mine + tile_floats;
    if (fused) {
      RowStage stage(staged, 2 * g.group, capacity, g.head_dim);
#pragma omp for schedule(dynamic, 1)
      for (int64_t pair = 0; pair < g.batch * g.kv_heads; ++pair)
        backward_pair(p, g, pair, delta.data(), mine, stage, staged + sources * capacity * g.head_dim);
    } else {
      {
        RowStage stage(staged, 2 * g.group, capacity, g.head_dim);
        // Early key blocks meet the most queries under the causal mask.
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < g.batch * g.kv_heads * g.blocks; ++n)
          backward_key_block(p, g, item_at(n, g, 1, false), delta.data(), mine, stage, nullptr);
      }
      RowStage stage(staged, 2, capacity, g.head_dim);
#pragma omp for schedule(dynamic, 1)
      for (int64_t n = 0; n < g.batch * g.heads * g.blocks; ++n)
        backward_query_block(p, g, item_at(n, g, g.group, p.causal), delta.data(), mine, stage);
    }
  }
}

}  // namespace forge::cpu
