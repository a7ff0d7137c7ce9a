// Building blocks of the CPU flash attention (attention.cpp): 16-lane vectors (AVX-512 intrinsics, or
// GCC/Clang vector extensions elsewhere), a base-2 exponential, the register-blocked tile micro-kernel,
// transposing packs, and per-thread staging of rows that work items read again and again.
#pragma once

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/element_ptr.h"
#include "forge/kernels/cpu/element_access.h"

#if defined(__AVX512F__)
// GCC 12 flags its own _mm512_undefined_ps() placeholders as maybe-uninitialized once inlined.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace forge::cpu::attention_tiles {

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
// 16 bf16 (their bits) widened.
inline Vec load(const uint16_t* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec splat(float s) { return _mm512_set1_ps(s); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
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
inline Vec load(const uint16_t* p) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = std::bit_cast<float>(static_cast<uint32_t>(p[i]) << 16);
  return v;
}
inline void store(float* p, const Vec& x) { std::memcpy(p, &x, sizeof x); }
inline Vec splat(float s) { return Vec{} + s; }
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return a * b + c; }
inline Vec add(const Vec& a, const Vec& b) { return a + b; }
inline Vec sub(const Vec& a, const Vec& b) { return a - b; }
inline Vec mul(const Vec& a, const Vec& b) { return a * b; }
inline Vec div(const Vec& a, const Vec& b) { return a / b; }
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

// Horizontal maximum and sum of the lanes.
#if defined(__AVX512F__)
inline float reduce_max(Vec x) { return _mm512_reduce_max_ps(x); }
inline float reduce_add(Vec x) { return _mm512_reduce_add_ps(x); }
#else
inline float reduce_max(const Vec& x) {
  float m = x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, x[i]);
  return m;
}
inline float reduce_add(const Vec& x) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
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

// tanh(x), relative error below 1e-6: x (1 - x^2/3 + 2x^4/15 - 17x^6/315 + 62x^8/2835) where |x| < 1/8, else
// sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= exp(-1/4), which cancels at most 4.5 times there.
inline Vec tanh_approx(const Vec& x) {
  const Vec zero = splat(0.0f), one = splat(1.0f);
  const Vec a = max(x, sub(zero, x));
  const Vec e = pow2(mul(a, splat(-2.0f * kLog2e)));
  const Vec large = div(sub(one, e), add(one, e));
  const Vec x2 = mul(x, x);
  Vec p = splat(62.0f / 2835.0f);
  p = fmadd(p, x2, splat(-17.0f / 315.0f));
  p = fmadd(p, x2, splat(2.0f / 15.0f));
  p = fmadd(p, x2, splat(-1.0f / 3.0f));
  p = fmadd(p, x2, one);
  return select_less(a, splat(0.125f), mul(p, x), select_less(x, zero, sub(zero, large), large));
}

// Logit soft-capping of base-2 scores (AttentionParams::softcap): a natural score s = t ln 2 becomes
// c tanh(s / c), which in base 2 is C tanh(t / C) with C = c log2(e). `tanh` receives tanh(t / C), which the
// backward's 1 - tanh^2 needs.
struct SoftCap {
  float cap = 0.0f, inverse = 0.0f;  // C and 1 / C; cap 0: off
  explicit SoftCap(float softcap)
      : cap(softcap > 0.0f ? softcap * kLog2e : 0.0f), inverse(softcap > 0.0f ? 1.0f / cap : 0.0f) {}
  bool on() const { return cap > 0.0f; }
  Vec apply(const Vec& t, Vec& tanh) const {
    tanh = tanh_approx(mul(t, splat(inverse)));
    return mul(splat(cap), tanh);
  }
  Vec apply(const Vec& t) const {
    Vec tanh;
    return apply(t, tanh);
  }
};

// Lane l of vector v holds index first + v * kLanes + l (queries or keys of a tile), as floats for compares.
struct LaneIndex {
  Vec v[kVectors];
  explicit LaneIndex(int64_t first) {
    float lanes[kBlock];
    for (int i = 0; i < kBlock; ++i) lanes[i] = static_cast<float>(first + i);
    for (int i = 0; i < kVectors; ++i) v[i] = load(lanes + i * kLanes);
  }
};

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
template <typename T>
inline void prefetch_row(const T* row, int64_t dim, bool for_write = false) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) {
    if (for_write)
      __builtin_prefetch(bytes + b, 1, 3);
    else
      __builtin_prefetch(bytes + b, 0, 3);
  }
}

// The typed pointer behind a kernel parameter that may hold either (core/element_ptr.h).
template <typename T>
const T* typed(const ConstElements& p) {
  if constexpr (std::is_same_v<T, float>)
    return p.f32();
  else
    return p.bf16();
}
template <typename T>
T* typed(const Elements& p) {
  if constexpr (std::is_same_v<T, float>)
    return p.f32();
  else
    return p.bf16();
}

// panel[d, i] = rows[i * stride + d] * factor for i < count; lanes count..kBlock-1 are zero. The rows are
// usually cold (fresh q, k, v, dout): gathering 16 rows at once keeps 16 cache misses in flight, where
// scalar transposing stores would fill the store buffer and serialise them. bf16 rows (T = uint16_t) are
// widened in the scalar loop: one pass over rows that the tiles then reuse a whole block of times.
template <typename T>
inline void pack_transposed(const T* rows, int64_t stride, int64_t count, int64_t dim, float factor,
                            float* panel) {
#if defined(__AVX512F__)
  if (std::is_same_v<T, float> && stride < std::numeric_limits<int32_t>::max() / kLanes) {
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
      const float* base = reinterpret_cast<const float*>(rows) + g * kLanes * stride;
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
    for (int64_t d = 0; d < dim; ++d) panel[d * kBlock + i] = load_float(rows, i * stride + d) * factor;
}

// rows[i * stride + d] = panel[d, i] * factor * row_factor[i] (row_factor may be null) for i < count: the
// inverse of pack_transposed. Gathers from the L1-resident panel so that each output row is written with
// full-vector stores. (Streaming stores past the cache measured 2x slower here.) bf16 rows (T = uint16_t)
// get each value rounded once.
template <typename T>
inline void unpack_transposed(const float* panel, int64_t count, int64_t dim, float factor,
                              const float* row_factor, T* rows, int64_t stride) {
#if defined(__AVX512F__)
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kBlock));
#endif
  for (int64_t i = 0; i < count; ++i) {
    if (i + kRowsAhead < count) prefetch_row(rows + (i + kRowsAhead) * stride, dim, true);
    const float f = row_factor ? factor * row_factor[i] : factor;
    int64_t d = 0;
    if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
      for (; d + kLanes <= dim; d += kLanes)
        store(rows + i * stride + d, mul(_mm512_i32gather_ps(offsets, panel + d * kBlock + i, 4), splat(f)));
#endif
    }
    for (; d < dim; ++d) store_float(rows, i * stride + d, panel[d * kBlock + i] * f);
  }
}

// tile[i * tile_stride + d] = rows[i * stride + d] * factor for i < count, d < dim (bf16 rows widened).
template <typename T>
inline void copy_rows(const T* rows, int64_t stride, int64_t count, int64_t dim, float factor, float* tile,
                      int64_t tile_stride) {
  for (int64_t i = 0; i < count; ++i) {
    if (i + kRowsAhead < count) prefetch_row(rows + (i + kRowsAhead) * stride, dim);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes)
      store(tile + i * tile_stride + d, mul(load(rows + i * stride + d), splat(factor)));
    for (; d < dim; ++d) tile[i * tile_stride + d] = load_float(rows, i * stride + d) * factor;
  }
}

// A thread's contiguous copies of the rows that one (batch, kv head) pair's work items read again and again:
// k and v in the forward and dQ passes, q and dout of the group's heads in the dK/dV pass. In the fused
// buffers consecutive rows sit a token stride apart (4 KiB at the training shape), so fetched block by block
// they keep missing cache: the hardware prefetchers do not cross pages and the rows alias in the cache sets.
// Each source keeps a window of up to `capacity` consecutive rows. A pair's items run back to back, the
// costliest first, so after a thread's first item of a pair the window usually covers all the rows it needs.
// Sources come in pairs (k and v, or q and dout of one query head): even sources hold rows of even_dim floats
// (head_dim), odd ones of odd_dim (v_head_dim); the buffer holds capacity * pairs * (even_dim + odd_dim).
class RowStage {
 public:
  RowStage(float* buffer, int64_t pairs, int64_t capacity, int64_t even_dim, int64_t odd_dim)
      : buffer_(buffer), capacity_(capacity), even_dim_(even_dim), odd_dim_(odd_dim), windows_(2 * pairs) {}

  // Rows [first, first + count) of `source` (row r at base + r * stride), times `factor` (fixed per source),
  // as a [count, dim] block, dim the source's width. `owner` identifies the (batch, kv head) pair; a new
  // owner drops every window.
  template <typename T>
  const float* rows(int64_t owner, int64_t source, const T* base, int64_t stride, int64_t first,
                    int64_t count, float factor = 1.0f) {
    if (owner != owner_) {
      owner_ = owner;
      for (Window& w : windows_) w = {0, 0};
    }
    Window& w = windows_[source];
    const int64_t dim = source % 2 == 0 ? even_dim_ : odd_dim_;
    float* staged = buffer_ + capacity_ * (source / 2 * (even_dim_ + odd_dim_) + source % 2 * even_dim_);
    if (first < w.first || first + count > w.first + w.count) {
      if (first != w.first + w.count || w.count + count > capacity_) w = {first, 0};
      const int64_t from = w.first + w.count;  // rows before `from` are already staged
      copy_rows(base + from * stride, stride, first + count - from, dim, factor, staged + w.count * dim, dim);
      w.count = first + count - w.first;
    }
    return staged + (first - w.first) * dim;
  }

 private:
  struct Window {
    int64_t first, count;
  };
  float* buffer_;
  int64_t capacity_, even_dim_, odd_dim_, owner_ = -1;
  std::vector<Window> windows_;
};

// Staged rows per source, for sources whose rows together take row_floats: the whole sequence while the
// copies fit in 4 MiB per thread, else a sliding window (correct either way; only reuse drops).
inline int64_t stage_capacity(int64_t seq, int64_t row_floats) {
  constexpr int64_t kStageFloats = int64_t{1} << 20;
  return std::clamp<int64_t>(kStageFloats / row_floats, kBlock, seq);
}

}  // namespace forge::cpu::attention_tiles
