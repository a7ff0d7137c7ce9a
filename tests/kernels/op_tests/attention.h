// Attention (ops::attention_forward / attention_backward), written once for every backend (op_harness.h). On
// the CPU against a double-precision reference (gradients also against central finite differences on small
// cases); elsewhere against the CPU kernel on the same inputs, within bounds derived below. q, k, v live in
// one inputs array, either strided inside a fused qkv buffer (as in training) or as separate tensors with
// padded token strides, or as a key/value cache (forward only) in either layout; the gradients land in the
// same places of a grads array. Shapes are ragged (never multiples of the GPU's 128-query / 64-key tiles),
// cover GQA groups of 1, 2, 4 and 8, head dims from 4 to 256, causal and full attention and the cache forward
// (prefill tiles and decode kernels), and values of another width than queries and keys (v_head_dim: MLA's
// 192 / 128 in training, and its absorbed decode at 576 / 512 with v aliasing the keys).
//
// Bounds against the CPU (derived for the CUDA kernels; the device emulation runs the CPU kernels and meets
// them trivially). The tensor-core kernels round q (pre-scaled), k, v, dout, P and dS to bf16, unit roundoff
// u = 2^-9; everything else is fp32. So, for row i and key j with a_ij = scale sum_d |q_id k_jd|:
//   score error      |ds_ij| <= e_ij = (2u + (head_dim + 8) 2^-24) a_ij            (q and k rounded)
//   lse error        <= E_i = max_j e_ij                                           (lse moves by a P-average)
//   P relative error <= expm1(e_ij + E_i) + 2u (P rounded for the MMA; the sum uses unrounded P) + fp32 terms
//   out_id           <= sum_j P_ij (that + 2u) |v_jd|                              (v rounded)
// and in backward (both backends get the CPU forward's out and lse), dP_ij = <dout_i, v_j> errs by
// 2u sum_d |dout_id v_jd|, D_i = <dout_i, out_i> only by fp32 order, dS_ij = P_ij (dP_ij - D_i) by
// |dP - D| dP_err + P (dP_err + D_err), and dq, dk, dv sum those errors (plus 2u for the bf16 rounding of dS
// or P and of k, q or dout) against |k|, |q| and |dout|. These are worst-case bounds (every rounding
// aligned), with a safety factor of 1.5 for second-order terms, so they hold on any GPU; an indexing or
// masking bug moves values by O(|value|) and breaks them. A scale-free similarity 1 - 2<x,y>/(|x|^2+|y|^2) ~
// (relative RMS error)^2 / 2 checks the bulk: random roundings give a relative RMS of a few u (~0.01 at
// most), i.e. < 5e-5, so the forward must stay under 1e-4 and gradients (one more rounded product,
// cancellation in dP - D) under 4e-4. The decode kernels compute in fp32: there u is replaced by 2^-20 (16
// fp32 ulps for the CPU's SIMD exponential and the different summation orders) and the similarity bound is
// 1e-9.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::attention {

using testing::DeviceArray;

constexpr double kBf16Unit = 1.0 / (1 << 9);     // bf16 unit roundoff
constexpr double kFp32Unit = 1.0 / (1 << 24);    // fp32 unit roundoff
constexpr double kDecodeUnit = 1.0 / (1 << 20);  // the decode kernels' stand-in for u (fp32, see above)
constexpr double kSafety = 1.5;
constexpr float kSentinel = -777.0f;

struct Case {
  int64_t batch, seq, heads, kv_heads, head_dim;
  bool causal = true;
  bool fused =
      false;        // q, k, v (and dq, dk, dv) inside one [batch, seq, heads + 2 kv_heads, head_dim] buffer
  int64_t pad = 0;  // extra elements per token in q, out, dout and k, v (padded token strides)
  int64_t kv_seq = 0;  // > 0: key/value cache of this many positions (forward only)
  int64_t q_offset = 0;
  bool head_major = false;    // cache [batch, kv_heads, capacity, head_dim] instead of [batch, capacity, ...]
  float scale_factor = 1.0f;  // scale = scale_factor / sqrt(head_dim); > 1 makes the softmax peaky
  int64_t v_head_dim = 0;     // columns of v and out per head (0 = head_dim)
  bool v_aliases_k = false;   // v = the first v_head_dim columns of each key row (MLA's absorbed decode)
  int64_t window = 0;         // > 0: the query at position p sees keys j > p - window (sliding window)
  float softcap = 0.0f;       // > 0: scores s become softcap * tanh(s / softcap) (Gemma 2)
  std::string name() const {
    std::string s = "b" + std::to_string(batch) + "_t" + std::to_string(seq) + "_h" + std::to_string(heads) +
                    "_kvh" + std::to_string(kv_heads) + "_d" + std::to_string(head_dim) +
                    (causal ? "_causal" : "_full") + (fused ? "_fused" : "") +
                    (pad ? "_pad" + std::to_string(pad) : "");
    if (kv_seq)
      s += "_kv" + std::to_string(kv_seq) + "_at" + std::to_string(q_offset) +
           (head_major ? "_headmajor" : "_tokenmajor");
    if (scale_factor != 1.0f) s += "_x" + std::to_string(static_cast<int>(scale_factor));
    if (v_head_dim) s += "_v" + std::to_string(v_head_dim);
    if (v_aliases_k) s += "_alias";
    if (window) s += "_w" + std::to_string(window) + (kv_seq ? "" : "_at" + std::to_string(q_offset));
    if (softcap > 0.0f) s += "_cap" + std::to_string(static_cast<int>(softcap * 10));
    return s;
  }
};

// Training's square attention: ragged lengths, GQA 1/2/4/8, head dims 4 to 256 and padded ones.
inline const std::vector<Case> kCases = {
    {1, 1, 2, 2, 16, true, true, 3},                         // one token
    {2, 7, 4, 2, 16, true, true, 3},                         // GQA, batch 2
    {1, 33, 4, 1, 64, true, true, 3},                        // MQA
    {2, 100, 2, 2, 64, true, true, 3},                       // MHA, two CPU blocks (one partial)
    {1, 130, 4, 2, 16, true, true, 3, 0, 0, false, 4.0f},    // three CPU blocks, peaky softmax
    {1, 64, 2, 1, 64, true, true, 3},                        // exactly one CPU block
    {2, 7, 4, 2, 16, false, true, 3},                        // non-causal
    {1, 100, 4, 1, 64, false, true, 3},                      // non-causal MQA, partial block
    {1, 130, 2, 2, 24, false, true, 3, 0, 0, false, 3.0f},   // head_dim not a multiple of 16
    {1, 6, 4, 2, 16, true, true, 3, 0, 0, false, 2.0f},      // finite differences, causal
    {2, 5, 2, 1, 16, false, true, 3, 0, 0, false, 2.0f},     // finite differences, full
    {1, 67, 1, 1, 4, true, true, 3, 0, 0, false, 2.0f},      // finite differences across a block boundary
    {1, 37, 2, 1, 64, true},                                 // one tile, GQA 2
    {2, 150, 4, 1, 64, true},                                // GQA 4, two key blocks, batch 2
    {1, 200, 2, 2, 128, false},                              // MHA, full attention
    {1, 300, 8, 1, 128, true},                               // GQA 8, three query blocks
    {1, 130, 4, 1, 40, true, true},                          // odd head_dim in a fused qkv buffer
    {1, 70, 4, 2, 128, true, false, 5},                      // padded token strides
    {1, 64, 4, 2, 128, true},                                // exact tile multiples
    {1, 129, 2, 1, 200, true},                               // head_dim 200: the 256-wide kernels
    {1, 50, 2, 2, 256, false},                               // head_dim 256, full
    {2, 100, 4, 4, 64, false, false, 0, 0, 0, false, 4.0f},  // sharp softmax (scale x4)
    {1, 96, 8, 8, 72, true, true, 3},                        // fused and padded, head_dim 72
    // v_head_dim != head_dim (MLA's values): narrower and wider, GQA, causal and full, fused and separate.
    {1, 6, 4, 2, 16, true, true, 3, 0, 0, false, 2.0f, 8},       // finite differences, causal, narrower v
    {2, 5, 2, 1, 8, false, true, 3, 0, 0, false, 2.0f, 24},      // finite differences, full, wider v
    {1, 67, 1, 1, 4, true, true, 3, 0, 0, false, 2.0f, 12},      // finite differences across a block boundary
    {1, 7, 2, 2, 12, false, false, 2, 0, 0, false, 2.0f, 20},    // finite differences, separate tensors
    {1, 130, 4, 2, 192, true, true, 3, 0, 0, false, 1.0f, 128},  // DeepSeek-V3's training shape 192 / 128
    {2, 100, 4, 2, 64, false, false, 5, 0, 0, false, 1.0f, 40},  // full, padded, v not a multiple of 16
    {1, 70, 2, 1, 40, true, false, 0, 0, 0, false, 1.0f, 64},    // wider v, MQA
    {1, 50, 2, 2, 128, false, true, 0, 0, 0, false, 1.0f, 256},  // v 256: the 256-wide kernels for v alone
    {1, 150, 8, 2, 24, true, true, 3, 0, 0, false, 3.0f, 16},    // GQA 4, three CPU blocks, peaky softmax
};

// The key/value-cache forward: queries at q_offset.. against a cache holding more positions than kv_seq, in
// both layouts. On the GPU up to 16 queries with an offset run the fp32 decode kernels, more the tensor-core
// tiles.
inline const std::vector<Case> kCacheCases = {
    {2, 40, 4, 2, 64, true, false, 3, 100, 60},          // prefill tiles, token-major
    {1, 70, 2, 1, 128, true, false, 0, 300, 230, true},  // prefill tiles, head-major
    {1, 33, 2, 2, 40, false, false, 0, 90, 10, true},    // full attention over a cache
    {2, 1, 4, 1, 64, true, false, 0, 300, 299},          // one decode step, several chunks
    {1, 5, 8, 2, 128, true, false, 2, 200, 150, true},   // short chunk, GQA 4, head-major
    {1, 16, 2, 1, 72, false, false, 0, 129, 7},          // 16 queries, full
    {1, 3, 2, 2, 256, true, false, 0, 17, 14, true},     // head_dim 256 decode
    {1, 4, 8, 1, 128, true, false, 0, 1000, 996},        // GQA 8, eight chunks
    // The CPU cache test's shapes (padded q and out rows). Decode: a few queries against a longer cache.
    {2, 1, 4, 2, 16, true, false, 3, 37, 36},                // one new token, GQA, batch 2
    {1, 1, 2, 2, 16, true, false, 3, 1, 0},                  // the first token
    {1, 1, 4, 1, 64, true, false, 3, 300, 299},              // MQA, two chunks (one partial)
    {2, 3, 6, 2, 24, true, false, 3, 70, 67},                // three new tokens, head_dim 24 (padded)
    {1, 2, 2, 1, 8, true, false, 3, 600, 598, false, 4.0f},  // three chunks, peaky softmax
    {1, 1, 2, 2, 200, true, false, 3, 65, 64},         // head_dim 200: more output vectors than registers
    {2, 2, 4, 4, 16, false, false, 3, 50, 48},         // non-causal: every cached key
    {1, 16, 8, 2, 32, true, false, 3, 116, 100},       // the largest decode chunk, 32 rows per pair
    {1, 1, 4, 2, 16, true, false, 3, 300, 10},         // causal: a query early in a longer cache
    {2, 1, 8, 2, 64, true, false, 3, 300, 299, true},  // head-major cache (forge's KvCache)
    {1, 3, 4, 4, 24, true, false, 3, 43, 40, true},    // head-major, staged head_dim
    // Flash tiles with an offset: prefill onto a cache.
    {1, 40, 4, 2, 16, true, false, 3, 100, 60},  // a chunk of prompt after earlier tokens
    {2, 17, 4, 1, 16, true, false, 3, 17, 0},    // prompt into an empty cache (MQA)
    {1, 130, 2, 2, 64, true, false, 3, 135, 5, false,
     3.0f},                                           // three query blocks, offset not a block multiple
    {1, 20, 2, 1, 16, false, false, 3, 90, 0},        // non-causal, kv longer than the queries
    {2, 33, 4, 2, 16, true, false, 3, 43, 10, true},  // head-major prefill
    // v_head_dim != head_dim: prefill tiles and decode, both layouts, rows staged or read in place.
    {2, 40, 4, 2, 48, true, false, 3, 100, 60, false, 1.0f, 32},  // prefill tiles, token-major, narrower v
    {1, 70, 2, 1, 64, true, false, 0, 300, 230, true, 1.0f, 96},  // prefill tiles, head-major, wider v
    {2, 1, 4, 1, 64, true, false, 0, 300, 299, false, 1.0f, 48},  // one decode step, several chunks
    {1, 5, 8, 2, 40, true, false, 2, 200, 150, true, 1.0f, 24},   // GQA 4, head-major, both rows staged
    {2, 2, 4, 4, 16, false, false, 3, 50, 48, false, 1.0f, 40},   // non-causal, only v staged
    {1, 3, 2, 1, 24, true, false, 0, 43, 40, false, 1.0f, 32},    // only k staged
    // MLA's absorbed decode: one kv head, v the first v_head_dim columns of each key row (v = k).
    {1, 3, 4, 1, 40, true, false, 0, 90, 87, false, 1.0f, 32, true},      // small, k staged, v in place
    {2, 1, 16, 1, 40, true, false, 3, 300, 299, true, 1.0f, 32, true},    // 16 heads, head-major, two chunks
    {1, 20, 4, 1, 40, true, false, 0, 60, 40, false, 1.0f, 32, true},     // prefill tiles over the alias
    {1, 2, 16, 1, 576, true, false, 0, 70, 68, false, 1.0f, 512, true},   // the real widths, 16 heads
    {1, 1, 128, 1, 576, true, false, 0, 40, 39, false, 1.0f, 512, true},  // 128 heads, one token
    {1, 16, 16, 1, 576, true, false, 0, 140, 124, false, 1.0f, 512, true},  // 16 queries: the widest rows
};

// Sliding windows (CPU only: the CUDA kernels refuse a window that hides keys). Training's square attention
// with windows shorter and longer than a CPU block, and across several blocks; a ring block of context
// parallelism (no causal mask, queries `q_offset` after their keys, forward and backward); and the cache
// forward (prefill tiles and decode) over a window.
inline const std::vector<Case> kWindowCases = {
    {1, 12, 4, 2, 8, true, true, 3, 0, 0, false, 2.0f, 0, false, 5},      // Mistral's golden shape
    {1, 67, 1, 1, 4, true, true, 3, 0, 0, false, 2.0f, 0, false, 20},     // finite differences, two blocks
    {2, 7, 2, 1, 16, true, true, 3, 0, 0, false, 2.0f, 0, false, 1},      // window 1: each query sees itself
    {2, 150, 4, 2, 16, true, true, 3, 0, 0, false, 1.0f, 0, false, 40},   // three blocks, window < a block
    {1, 200, 4, 1, 24, true, false, 5, 0, 0, false, 3.0f, 0, false, 90},  // window > a block, padded, peaky
    {1, 130, 2, 2, 16, true, true, 3, 0, 0, false, 1.0f, 8, false, 64},   // window = a block, narrower v
    {1, 20, 2, 1, 8, false, true, 3, 0, 20, false, 2.0f, 0, false, 25},   // ring block: finite differences
    {1, 150, 4, 2, 16, false, true, 3, 0, 150, false, 1.0f, 0, false, 200},  // ring block over three blocks
    {1, 16, 2, 1, 16, false, true, 0, 0, 16, false, 1.0f, 0, false, 20},  // ring block of 16: decode kernel
};
// Logit soft-capping (CPU only: the CUDA kernels refuse it). Caps small enough to bend most scores (the
// op tests' scores reach about +-8 at scale x2), on training's square attention (one and several blocks,
// GQA, with a window), a ring block, the cache's prefill tiles and decode.
inline const std::vector<Case> kSoftcapCases = {
    {1, 6, 4, 2, 16, true, true, 3, 0, 0, false, 2.0f, 0, false, 0, 2.0f},      // finite differences
    {2, 5, 2, 1, 16, false, true, 3, 0, 0, false, 2.0f, 0, false, 0, 1.0f},     // full, cap 1
    {1, 67, 1, 1, 4, true, true, 3, 0, 0, false, 2.0f, 0, false, 20, 3.0f},     // two blocks, window
    {2, 150, 4, 2, 16, true, true, 3, 0, 0, false, 3.0f, 0, false, 0, 5.0f},    // three blocks, peaky
    {1, 130, 2, 2, 24, true, false, 5, 0, 0, false, 1.0f, 8, false, 0, 50.0f},  // Gemma 2's cap, narrower v
    {1, 20, 2, 1, 8, false, true, 3, 0, 20, false, 2.0f, 0, false, 25, 2.0f},   // ring block
};
inline const std::vector<Case> kSoftcapCacheCases = {
    {1, 40, 4, 2, 16, true, false, 3, 100, 60, false, 2.0f, 0, false, 0, 2.0f},  // prefill tiles
    {2, 1, 4, 2, 16, true, false, 3, 300, 299, true, 2.0f, 0, false, 70, 2.0f},  // decode, window
    {1, 3, 4, 4, 24, true, false, 3, 43, 40, true, 3.0f, 0, false, 0, 1.5f},     // three queries
};

inline const std::vector<Case> kWindowCacheCases = {
    {1, 40, 4, 2, 16, true, false, 3, 100, 60, false, 1.0f, 0, false, 30},  // prefill tiles onto a cache
    {2, 1, 4, 2, 16, true, false, 3, 300, 299, true, 1.0f, 0, false, 70},   // decode step, chunks cut
    {1, 3, 4, 4, 24, true, false, 3, 43, 40, true, 1.0f, 0, false, 2},      // three queries, window 2
};

// One problem: q, k, v live in one `inputs` array at offsets with their strides (so a fused qkv buffer and
// separate tensors are the same code), gradients in `grads` at the same places. Padding and gaps hold random
// values in inputs and kSentinel in the outputs (which must stay untouched). v has v_dim columns per head
// (v_head_dim, or head_dim), out and dout too; with v_aliases_k (forward only) v is the first v_dim columns
// of k, with k's strides.
struct Problem {
  Case c;
  int64_t kv_seq, v_dim, q_stride, out_stride, k_stride, v_stride, k_head_stride, v_head_stride,
      k_batch_stride, v_batch_stride, k_offset, v_offset, capacity;
  std::vector<float> inputs, dout, out, lse, grads;

  Problem(const Case& cc, uint32_t seed) : c(cc) {
    const int64_t d = c.head_dim, q_width = c.heads * d, kv_width = c.kv_heads * d;
    kv_seq = c.kv_seq ? c.kv_seq : c.seq;
    v_dim = c.v_head_dim ? c.v_head_dim : d;
    const int64_t v_width = c.kv_heads * v_dim;
    out_stride = c.heads * v_dim + c.pad;
    size_t total;
    if (c.fused) {
      q_stride = k_stride = v_stride = q_width + kv_width + v_width + c.pad;
      k_head_stride = d, v_head_stride = v_dim, capacity = c.seq;
      k_batch_stride = v_batch_stride = c.seq * q_stride;
      k_offset = q_width, v_offset = q_width + kv_width;
      total = c.batch * c.seq * q_stride;
    } else {
      q_stride = q_width + c.pad;
      capacity = c.kv_seq ? kv_seq + 5 : kv_seq;  // a cache holds more positions than are filled
      const int64_t gap = c.kv_seq ? 8 : 0;
      k_stride = c.head_major ? d : kv_width + c.pad;
      k_head_stride = c.head_major ? capacity * d + 4 : d;
      k_batch_stride = (c.head_major ? c.kv_heads * k_head_stride : capacity * k_stride) + gap;
      v_stride = c.head_major ? v_dim : v_width + c.pad;
      v_head_stride = c.head_major ? capacity * v_dim + 4 : v_dim;
      v_batch_stride = (c.head_major ? c.kv_heads * v_head_stride : capacity * v_stride) + gap;
      k_offset = c.batch * c.seq * q_stride;
      v_offset = k_offset + c.batch * k_batch_stride;
      total = v_offset + c.batch * v_batch_stride;
    }
    if (c.v_aliases_k) {  // v reads the keys: no v region of its own
      EXPECT_TRUE(!c.fused && c.kv_seq && v_dim <= d) << c.name();
      v_stride = k_stride, v_head_stride = k_head_stride, v_batch_stride = k_batch_stride;
      v_offset = k_offset;
      total = k_offset + c.batch * k_batch_stride;
    }
    inputs = testing::random_floats(total, seed, -2.0f, 2.0f);
    // v in [-1, 1]: rescale its region (fused: every v element) so outputs are O(1)
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t j = 0; j < kv_seq; ++j)
        for (int64_t g = 0; g < c.kv_heads; ++g)
          for (int64_t e = 0; e < v_dim; ++e) inputs[v_at(b, j, g) + e] *= 0.5f;
    dout = testing::random_floats(c.batch * c.seq * out_stride, seed + 1);
    out.assign(c.batch * c.seq * out_stride, kSentinel);
    lse.assign(c.batch * c.heads * c.seq, kSentinel);
    grads.assign(total, kSentinel);
  }
  int64_t q_at(int64_t b, int64_t t, int64_t h) const { return (b * c.seq + t) * q_stride + h * c.head_dim; }
  int64_t o_at(int64_t b, int64_t t, int64_t h) const { return (b * c.seq + t) * out_stride + h * v_dim; }
  int64_t k_at(int64_t b, int64_t j, int64_t g) const {
    return k_offset + b * k_batch_stride + g * k_head_stride + j * k_stride;
  }
  int64_t v_at(int64_t b, int64_t j, int64_t g) const {
    return v_offset + b * v_batch_stride + g * v_head_stride + j * v_stride;
  }
  bool decode() const { return c.seq <= 16 && (kv_seq != c.seq || c.q_offset != 0); }
  double scale() const { return c.scale_factor / std::sqrt(static_cast<float>(c.head_dim)); }

  // Parameters over base pointers to (a copy of) inputs, dout, out, lse, grads.
  ops::AttentionParams params(const float* in, const float* dout_base, float* out_base, float* lse_base,
                              float* grads_base) const {
    ops::AttentionParams p;
    p.batch = c.batch, p.seq = c.seq, p.heads = c.heads, p.kv_heads = c.kv_heads, p.head_dim = c.head_dim;
    p.v_head_dim = c.v_head_dim;  // 0 in most cases: the default must work as head_dim
    p.q = in, p.k = in + k_offset, p.v = in + v_offset;
    p.q_stride = q_stride, p.k_stride = k_stride, p.v_stride = v_stride;
    p.out = out_base, p.out_stride = out_stride, p.lse = lse_base;
    p.scale = c.scale_factor / std::sqrt(static_cast<float>(c.head_dim));
    p.causal = c.causal;
    p.window = c.window;
    p.softcap = c.softcap;
    p.q_offset = c.q_offset;  // square attention: only without the causal mask (a ring block)
    if (c.kv_seq) {
      p.kv_seq = kv_seq, p.q_offset = c.q_offset;
      p.k_head_stride = c.head_major ? k_head_stride : 0;
      p.v_head_stride = c.head_major || c.v_aliases_k ? v_head_stride : 0;
      p.k_batch_stride = k_batch_stride, p.v_batch_stride = v_batch_stride;
    }
    p.dout = dout_base, p.dout_stride = out_stride;
    p.dq = grads_base, p.dk = grads_base + k_offset, p.dv = grads_base + v_offset;
    p.dq_stride = q_stride, p.dk_stride = k_stride, p.dv_stride = v_stride;
    return p;
  }
  ops::AttentionParams host_params() {
    return params(inputs.data(), dout.data(), out.data(), lse.data(), grads.data());
  }

  // The element indices of q, of k and of v (the first kv_seq positions) in inputs and grads, and of the
  // written part of out: whatever is not listed is padding no op may touch.
  std::vector<size_t> q_elements() const {
    std::vector<size_t> at;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = 0; t < c.seq; ++t)
        for (int64_t h = 0; h < c.heads; ++h)
          for (int64_t e = 0; e < c.head_dim; ++e) at.push_back(q_at(b, t, h) + e);
    return at;
  }
  std::vector<size_t> k_elements() const { return kv_elements(&Problem::k_at, c.head_dim); }
  std::vector<size_t> v_elements() const { return kv_elements(&Problem::v_at, v_dim); }
  std::vector<size_t> out_elements() const {
    std::vector<size_t> at;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = 0; t < c.seq; ++t)
        for (int64_t h = 0; h < c.heads; ++h)
          for (int64_t e = 0; e < v_dim; ++e) at.push_back(o_at(b, t, h) + e);
    return at;
  }

 private:
  std::vector<size_t> kv_elements(int64_t (Problem::*row_at)(int64_t, int64_t, int64_t) const,
                                  int64_t width) const {
    std::vector<size_t> at;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t j = 0; j < kv_seq; ++j)
        for (int64_t g = 0; g < c.kv_heads; ++g)
          for (int64_t e = 0; e < width; ++e) at.push_back((this->*row_at)(b, j, g) + e);
    return at;
  }
};

template <typename T, typename From>
std::vector<T> pick(const std::vector<From>& values, const std::vector<size_t>& at) {
  std::vector<T> picked(at.size());
  for (size_t i = 0; i < at.size(); ++i) picked[i] = static_cast<T>(values[at[i]]);
  return picked;
}

// The double-precision softmax attention on `in` (the inputs array, in double) and the problem's dout, laid
// out like out, lse and grads (zero where no op writes): out and lse, and with `backward` the analytic
// gradient of <dout, out>: dV = P^T dO, dS = P o (dO V^T - rowsum(dO o O)), dQ = s dS K, dK = s dS^T Q,
// summed over the query heads that share a kv head.
struct Reference {
  std::vector<double> out, lse, grads;
};
inline Reference reference(const Problem& pr, const std::vector<double>& in, bool backward) {
  const Case& c = pr.c;
  const int64_t d = c.head_dim, dv = pr.v_dim, group = c.heads / c.kv_heads;
  const double scale = c.scale_factor / std::sqrt(double(d));
  Reference r;
  r.out.assign(pr.out.size(), 0.0), r.lse.assign(pr.lse.size(), 0.0);
  if (backward) r.grads.assign(pr.grads.size(), 0.0);
  std::vector<double> s(pr.kv_seq), dp(pr.kv_seq), capped(pr.kv_seq);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t t = 0; t < c.seq; ++t) {
        const int64_t g = h / group, keys = c.causal ? c.q_offset + t + 1 : pr.kv_seq;
        // The sliding window: keys before `first` are masked (every case leaves each row a key).
        const int64_t first = c.window ? std::max<int64_t>(0, c.q_offset + t - c.window + 1) : 0;
        const double* q = &in[pr.q_at(b, t, h)];
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = first; j < keys; ++j) {
          const double* k = &in[pr.k_at(b, j, g)];
          double x = 0;
          for (int64_t i = 0; i < d; ++i) x += q[i] * k[i];
          s[j] = scale * x;
          if (c.softcap > 0) s[j] = c.softcap * std::tanh(s[j] / c.softcap);
          m = std::max(m, s[j]);
        }
        for (int64_t j = first; j < keys; ++j) capped[j] = s[j];
        double sum = 0;
        for (int64_t j = first; j < keys; ++j) sum += std::exp(s[j] - m);
        r.lse[(b * c.heads + h) * c.seq + t] = m + std::log(sum);
        double* out = &r.out[pr.o_at(b, t, h)];
        for (int64_t j = first; j < keys; ++j) {
          s[j] = std::exp(s[j] - m) / sum;  // now P
          const double* v = &in[pr.v_at(b, j, g)];
          for (int64_t i = 0; i < dv; ++i) out[i] += s[j] * v[i];
        }
        if (!backward) continue;
        const float* dout = &pr.dout[pr.o_at(b, t, h)];
        double delta = 0;
        for (int64_t j = first; j < keys; ++j) {
          const double* v = &in[pr.v_at(b, j, g)];
          dp[j] = 0;
          for (int64_t i = 0; i < dv; ++i) dp[j] += double{dout[i]} * v[i];
          delta += s[j] * dp[j];
        }
        for (int64_t j = first; j < keys; ++j) {
          double ds = s[j] * (dp[j] - delta);
          if (c.softcap > 0) {  // d(capped)/ds = 1 - tanh^2, from the capped score kept in cap[j]
            const double t = capped[j] / c.softcap;
            ds *= 1 - t * t;
          }
          const double* k = &in[pr.k_at(b, j, g)];
          for (int64_t i = 0; i < dv; ++i) r.grads[pr.v_at(b, j, g) + i] += s[j] * dout[i];
          for (int64_t i = 0; i < d; ++i) {
            r.grads[pr.q_at(b, t, h) + i] += scale * ds * k[i];
            r.grads[pr.k_at(b, j, g) + i] += scale * ds * q[i];
          }
        }
      }
  return r;
}

// relative_error with a floor on the reference scale. Inputs are O(1), so gradients are O(0.1..10), but
// with a single visible key the softmax is constant: dq and dk are exactly zero and only fp32 round-off
// (~3e-8) remains, which a plain relative error would divide by zero.
inline double gradient_error(const std::vector<float>& got, const std::vector<double>& want) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(got[i] - want[i]));
    max_ref = std::max(max_ref, std::abs(want[i]));
  }
  return max_diff / std::max(max_ref, 0.05);
}

// Padding of out, lse-free; and with `backward` of grads: every element outside q, k, v must hold the
// sentinel.
inline void expect_padding_untouched(const Problem& pr, bool backward) {
  std::vector<bool> written(pr.out.size());
  for (size_t i : pr.out_elements()) written[i] = true;
  for (size_t i = 0; i < pr.out.size(); ++i)
    if (!written[i]) {
      ASSERT_EQ(pr.out[i], kSentinel) << "out padding written at " << i;
    }
  if (!backward) return;
  written.assign(pr.grads.size(), false);
  for (size_t i : pr.q_elements()) written[i] = true;
  for (size_t i : pr.k_elements()) written[i] = true;
  for (size_t i : pr.v_elements()) written[i] = true;
  for (size_t i = 0; i < pr.grads.size(); ++i)
    if (!written[i]) {
      ASSERT_EQ(pr.grads[i], kSentinel) << "grads padding written at " << i;
    }
}

// The CPU kernel's forward (and backward) on pr, run on the host, against the double reference: fp32 dot
// products of length head_dim and an fp32 online softmax give ~1e-6 relative, bound 1e-5; backward chains
// three fp32 products per element (and the forward's lse): relative ~1e-6, bound 2e-5.
inline void expect_matches_reference(Problem& pr, bool backward, const std::string& what) {
  const ops::AttentionParams p = pr.host_params();
  FORGE_TEST_OP(attention_forward, Device::cpu, p);
  if (backward) FORGE_TEST_OP(attention_backward, Device::cpu, p);
  const Reference want = reference(pr, testing::to_double(pr.inputs), backward);
  const std::vector<size_t> out_at = pr.out_elements();
  EXPECT_LT(testing::relative_error(pick<float>(pr.out, out_at), pick<double>(want.out, out_at)), 1e-5)
      << what << " out";
  EXPECT_LT(testing::relative_error(pr.lse, want.lse), 1e-5) << what << " lse";
  expect_padding_untouched(pr, backward);
  if (!backward) return;
  for (const auto& [name, at] :
       {std::pair{"dq", pr.q_elements()}, std::pair{"dk", pr.k_elements()}, std::pair{"dv", pr.v_elements()}})
    EXPECT_LT(gradient_error(pick<float>(pr.grads, at), pick<double>(want.grads, at)), 2e-5)
        << what << " " << name;
}

// The arrays of a problem on a device (host memory for the CPU).
struct Buffers {
  DeviceArray<float> inputs, dout, out, lse, grads;
  Buffers(Device on, const Problem& pr)
      : inputs(on, pr.inputs), dout(on, pr.dout), out(on, pr.out), lse(on, pr.lse), grads(on, pr.grads) {}
  ops::AttentionParams params(const Problem& pr) {
    return pr.params(inputs.data(), dout.data(), out.data(), lse.data(), grads.data());
  }
};

// Error bounds (see the top of the file) for out, lse and the gradients, laid out like the arrays they bound;
// -1 marks elements no output may touch. `forward_out` is the out the backward runs on (the CPU's).
struct Bounds {
  std::vector<double> out, lse, grads;
};

inline Bounds error_bounds(const Problem& pr, bool backward, const std::vector<float>& forward_out) {
  const Case& c = pr.c;
  const int64_t d = c.head_dim, dv = pr.v_dim, group = c.heads / c.kv_heads;
  const double u = pr.decode() ? kDecodeUnit : kBf16Unit;
  const double fp32 = (pr.kv_seq + d + 32) * kFp32Unit;  // fp32 accumulation and roundings, either backend
  const double dot_unit = 2 * u + (d + 8) * kFp32Unit;
  const double scale = pr.scale();
  Bounds bd;
  bd.out.assign(pr.out.size(), -1.0);
  bd.lse.assign(pr.lse.size(), -1.0);
  bd.grads.assign(pr.grads.size(), -1.0);
  std::vector<double> s(pr.kv_seq), e(pr.kv_seq), prob(pr.kv_seq);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t t = 0; t < c.seq; ++t) {
        const int64_t g = h / group, keys = c.causal ? c.q_offset + t + 1 : pr.kv_seq;
        const float* q = &pr.inputs[pr.q_at(b, t, h)];
        double m = -std::numeric_limits<double>::infinity(), worst = 0;
        for (int64_t j = 0; j < keys; ++j) {
          const float* k = &pr.inputs[pr.k_at(b, j, g)];
          double x = 0, a = 0;
          for (int64_t i = 0; i < d; ++i) x += double{q[i]} * k[i], a += std::abs(double{q[i]} * k[i]);
          s[j] = scale * x, e[j] = dot_unit * scale * a;
          m = std::max(m, s[j]), worst = std::max(worst, e[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < keys; ++j) l += std::exp(s[j] - m);
        for (int64_t j = 0; j < keys; ++j) prob[j] = std::exp(s[j] - m) / l;
        const double lse = m + std::log(l);
        bd.lse[(b * c.heads + h) * c.seq + t] = kSafety * (worst + 64 * kFp32Unit * (std::abs(lse) + 1));
        double* out_bound = &bd.out[pr.o_at(b, t, h)];
        for (int64_t i = 0; i < dv; ++i) out_bound[i] = 0;
        for (int64_t j = 0; j < keys; ++j) {
          const double rel = std::expm1(e[j] + worst) + 4 * u + fp32;
          const float* v = &pr.inputs[pr.v_at(b, j, g)];
          for (int64_t i = 0; i < dv; ++i) out_bound[i] += kSafety * prob[j] * rel * std::abs(v[i]);
        }
        if (!backward) continue;
        const float* dout = &pr.dout[pr.o_at(b, t, h)];
        const float* out = &forward_out[pr.o_at(b, t, h)];
        double delta = 0, delta_abs = 0;
        for (int64_t i = 0; i < dv; ++i)
          delta += double{dout[i]} * out[i], delta_abs += std::abs(double{dout[i]} * out[i]);
        const double delta_error = (dv + 8) * kFp32Unit * delta_abs;
        double* dq = &bd.grads[pr.q_at(b, t, h)];
        for (int64_t i = 0; i < d; ++i)
          if (dq[i] < 0) dq[i] = 0;
        for (int64_t j = 0; j < keys; ++j) {
          const float* k = &pr.inputs[pr.k_at(b, j, g)];
          const float* v = &pr.inputs[pr.v_at(b, j, g)];
          double dp = 0, dp_abs = 0;
          for (int64_t i = 0; i < dv; ++i)
            dp += double{dout[i]} * v[i], dp_abs += std::abs(double{dout[i]} * v[i]);
          const double p_error = prob[j] * (std::expm1(e[j]) + fp32);  // same lse on both backends
          const double dp_error = (2 * u + (dv + 8) * kFp32Unit) * dp_abs;
          const double ds = prob[j] * (dp - delta);
          const double ds_error = p_error * std::abs(dp - delta) +
                                  (prob[j] + p_error) * (dp_error + delta_error) +
                                  (2 * u + fp32) * std::abs(ds);
          double* dk = &bd.grads[pr.k_at(b, j, g)];
          double* dvb = &bd.grads[pr.v_at(b, j, g)];
          for (int64_t i = 0; i < d; ++i) {
            if (dk[i] < 0) dk[i] = 0;
            dq[i] += kSafety * scale * ds_error * std::abs(k[i]);
            dk[i] += kSafety * scale * ds_error * std::abs(q[i]);
          }
          for (int64_t i = 0; i < dv; ++i) {
            if (dvb[i] < 0) dvb[i] = 0;
            dvb[i] += kSafety * (p_error + (2 * u + fp32) * prob[j]) * std::abs(dout[i]);
          }
        }
      }
  if (backward)  // keys no query sees (none in square attention, but keep every gradient element bounded)
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t j = 0; j < c.seq; ++j)
        for (int64_t g = 0; g < c.kv_heads; ++g) {
          for (int64_t i = 0; i < d; ++i)
            bd.grads[pr.k_at(b, j, g) + i] = std::max(bd.grads[pr.k_at(b, j, g) + i], 0.0);
          for (int64_t i = 0; i < dv; ++i)
            bd.grads[pr.v_at(b, j, g) + i] = std::max(bd.grads[pr.v_at(b, j, g) + i], 0.0);
        }
  return bd;
}

// One EXPECT per array naming the first offender: bounded elements within their bound (and finite), the rest
// bitwise equal (both untouched); then the similarity over the bounded elements.
inline void expect_within(const std::vector<float>& got, const std::vector<float>& cpu,
                          const std::vector<double>& bound, double max_dissimilarity,
                          const std::string& what) {
  ASSERT_EQ(got.size(), cpu.size()) << what;
  size_t bad = 0, first = 0;
  double xy = 0, xx = 0, yy = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    bool ok;
    if (bound[i] < 0) {
      ok = std::bit_cast<uint32_t>(got[i]) == std::bit_cast<uint32_t>(cpu[i]);
    } else {
      ok = std::isfinite(got[i]) && std::abs(double{got[i]} - double{cpu[i]}) <= bound[i];
      xy += double{got[i]} * cpu[i], xx += double{got[i]} * got[i], yy += double{cpu[i]} * cpu[i];
    }
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements off; first at " << first
                     << ": got " << testing::show(got[first]) << ", cpu " << testing::show(cpu[first])
                     << ", bound "
                     << (bound[first] < 0 ? std::string("untouched") : std::to_string(bound[first]));
  const double dissimilarity = 1.0 - 2.0 * xy / (xx + yy + 1e-300);
  EXPECT_LE(dissimilarity, max_dissimilarity) << what;
}

class AttentionOp : public testing::OpTest<Case> {
 protected:
  // Forward on device(): out and lse within their bounds of the CPU's, untouched elements untouched.
  void check_forward(Problem& pr, const std::string& what) {
    Buffers on(device(), pr);
    FORGE_TEST_OP(attention_forward, device(), on.params(pr));
    const auto out = on.out.download();
    const auto lse = on.lse.download();
    FORGE_TEST_OP(attention_forward, Device::cpu, pr.host_params());
    const Bounds bd = error_bounds(pr, false, pr.out);
    expect_within(out, pr.out, bd.out, pr.decode() ? 1e-9 : 1e-4, what + " out");
    expect_within(lse, pr.lse, bd.lse, 1.0, what + " lse");
  }
  // Backward on device() from the CPU forward's out and lse.
  void check_backward(Problem& pr, const std::string& what) {
    FORGE_TEST_OP(attention_forward, Device::cpu, pr.host_params());  // out and lse for both backwards
    Buffers on(device(), pr);
    FORGE_TEST_OP(attention_backward, device(), on.params(pr));
    const auto grads = on.grads.download();
    FORGE_TEST_OP(attention_backward, Device::cpu, pr.host_params());
    const Bounds bd = error_bounds(pr, true, pr.out);
    expect_within(grads, pr.grads, bd.grads, 4e-4, what + " dq, dk, dv");
  }
};

TEST_P(AttentionOp, Forward) {
  const Case& c = test_case();
  Problem pr(c, 11);
  if (on_cpu())
    expect_matches_reference(pr, false, "attention_forward " + c.name());
  else
    check_forward(pr, "attention_forward " + c.name());
}

// Gradients of the scalar loss <dout, out(q, k, v)> by central differences on the double reference, against
// the kernel's dq, dk, dv (after a backward on pr). Differences in double are exact to ~1e-10 here, so the
// bound is the kernel's fp32 error. Small problems only.
inline void expect_gradients_match_finite_differences(const Problem& pr) {
  if (pr.inputs.size() > 2000) return;
  const std::vector<double> w = testing::to_double(pr.dout);
  const std::vector<double> numeric = testing::finite_difference(
      [&](const std::vector<double>& in) { return testing::dot(w, reference(pr, in, false).out); },
      testing::to_double(pr.inputs));
  std::vector<size_t> at = pr.q_elements();
  for (const auto& kv : {pr.k_elements(), pr.v_elements()}) at.insert(at.end(), kv.begin(), kv.end());
  EXPECT_LT(testing::relative_error(pick<float>(pr.grads, at), pick<double>(numeric, at)), 2e-5)
      << pr.c.name();
}

TEST_P(AttentionOp, Backward) {
  const Case& c = test_case();
  Problem pr(c, 23);
  if (!on_cpu()) return check_backward(pr, "attention_backward " + c.name());
  expect_matches_reference(pr, true, "attention_backward " + c.name());
  expect_gradients_match_finite_differences(pr);
}

// bf16 tensors (a bf16 run's q|k|v, core output and their gradients, AttentionParams's dtype): on inputs that
// bf16 holds exactly, a backend's bf16 kernel is its fp32 kernel with other loads and stores (the CPU widens
// into the same fp32 tiles; the GPU stages the same bf16 copies), so it must write that device's fp32 results
// rounded once, bit for bit: out and every padding element (the sentinel, rounded) from the forward, the same
// lse, and dq, dk, dv from a backward that reads the rounded out.
TEST_P(AttentionOp, Bf16TensorsHoldTheFp32ResultRoundedOnce) {
  const Case& c = test_case();
  Problem pr(c, 31);
  const auto exact = [](std::vector<float>& v) {
    for (float& x : v) x = bf16_to_float(float_to_bf16(x));
  };
  const auto to_bits = [](const std::vector<float>& v) {
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = float_to_bf16(v[i]);
    return bits;
  };
  exact(pr.inputs), exact(pr.dout);
  // fp32 on the device: forward, then backward over the forward's out rounded to bf16.
  Buffers f32(device(), pr);
  FORGE_TEST_OP(attention_forward, device(), f32.params(pr));
  std::vector<float> out = f32.out.download();
  const std::vector<float> lse = f32.lse.download();
  const std::vector<uint16_t> out_bits = to_bits(out);
  exact(out);
  f32.out.upload(out);
  FORGE_TEST_OP(attention_backward, device(), f32.params(pr));
  const std::vector<uint16_t> grads_bits = to_bits(f32.grads.download());
  // bf16 on the device.
  DeviceArray<uint16_t> in(device(), to_bits(pr.inputs)), dout(device(), to_bits(pr.dout)),
      out16(device(), to_bits(pr.out)), grads16(device(), to_bits(pr.grads));
  DeviceArray<float> lse16(device(), pr.lse);
  const auto bf16_params = [&] {
    ops::AttentionParams p = f32.params(pr);
    p.q = in.data(), p.k = in.data() + pr.k_offset, p.v = in.data() + pr.v_offset;
    p.out = out16.data(), p.lse = lse16.data(), p.dout = dout.data();
    p.dq = grads16.data(), p.dk = grads16.data() + pr.k_offset, p.dv = grads16.data() + pr.v_offset;
    return p;
  };
  FORGE_TEST_OP(attention_forward, device(), bf16_params());
  EXPECT_EQ(out16.download(), out_bits) << c.name() << " out";
  EXPECT_EQ(lse16.download(), lse) << c.name() << " lse";
  FORGE_TEST_OP(attention_backward, device(), bf16_params());
  EXPECT_EQ(grads16.download(), grads_bits) << c.name() << " dq, dk, dv";
}

class AttentionCacheOp : public AttentionOp {};

TEST_P(AttentionCacheOp, Forward) {
  const Case& c = test_case();
  Problem pr(c, 17);
  if (on_cpu())
    expect_matches_reference(pr, false, "attention_forward " + c.name());
  else
    check_forward(pr, "attention_forward " + c.name());
}

// lse may be null in the cache forward too; out must not change (bitwise).
TEST_P(AttentionCacheOp, LseIsOptional) {
  const Case& c = test_case();
  Problem pr(c, 29);
  Buffers on(device(), pr);
  FORGE_TEST_OP(attention_forward, device(), on.params(pr));
  const auto with = on.out.download();
  on.out.upload(pr.out);
  auto p = on.params(pr);
  p.lse = nullptr;
  FORGE_TEST_OP(attention_forward, device(), p);
  const auto without = on.out.download();
  EXPECT_EQ(0, std::memcmp(with.data(), without.data(), with.size() * sizeof(float))) << c.name();
}

class AttentionFixed : public testing::OpTest<testing::FixedCase> {};

// Determinism: no atomics, fixed reduction orders; two identical runs agree bitwise (backward on the CPU's
// lse and out).
TEST_P(AttentionFixed, BitwiseRepeatable) {
  for (const Case& c : {Case{2, 300, 8, 2, 128, true}, Case{1, 3, 4, 1, 64, true, false, 0, 600, 500},
                        Case{1, 200, 4, 2, 192, true, true, 0, 0, 0, false, 1.0f, 128},
                        Case{1, 2, 16, 1, 576, true, false, 0, 300, 298, false, 1.0f, 512, true}}) {
    Problem pr(c, 400);
    FORGE_TEST_OP(attention_forward, Device::cpu, pr.host_params());
    Buffers on(device(), pr);
    std::vector<std::vector<float>> runs;
    for (int run = 0; run < 2; ++run) {
      const auto p = on.params(pr);
      FORGE_TEST_OP(attention_forward, device(), p);
      runs.push_back(on.out.download());
      runs.push_back(on.lse.download());
      if (pr.decode()) continue;
      on.lse.upload(pr.lse), on.out.upload(pr.out);
      FORGE_TEST_OP(attention_backward, device(), p);
      runs.push_back(on.grads.download());
    }
    const size_t per_run = runs.size() / 2;
    for (size_t i = 0; i < per_run; ++i)
      EXPECT_EQ(0, std::memcmp(runs[i].data(), runs[per_run + i].data(), runs[i].size() * sizeof(float)))
          << c.name() << " array " << i;
  }
}

// v_head_dim = head_dim is the default (0), bitwise: forward (flash tiles and decode) and backward.
TEST_P(AttentionFixed, VHeadDimDefaultsToHeadDim) {
  for (Case c : {Case{1, 70, 4, 2, 40, true, true, 3}, Case{1, 3, 4, 2, 64, true, false, 0, 90, 87, true}}) {
    std::vector<std::vector<float>> runs;
    for (int64_t v_head_dim : {int64_t{0}, c.head_dim}) {
      c.v_head_dim = v_head_dim;
      Problem pr(c, 450);
      FORGE_TEST_OP(attention_forward, Device::cpu, pr.host_params());  // out and lse for the backward
      Buffers on(device(), pr);
      FORGE_TEST_OP(attention_forward, device(), on.params(pr));
      runs.push_back(on.out.download());
      runs.push_back(on.lse.download());
      if (pr.decode()) continue;
      on.lse.upload(pr.lse), on.out.upload(pr.out);
      FORGE_TEST_OP(attention_backward, device(), on.params(pr));
      runs.push_back(on.grads.download());
    }
    const size_t per_run = runs.size() / 2;
    for (size_t i = 0; i < per_run; ++i)
      EXPECT_EQ(0, std::memcmp(runs[i].data(), runs[per_run + i].data(), runs[i].size() * sizeof(float)))
          << c.name() << " array " << i;
  }
}

// lse may be null in the forward; out must not change.
TEST_P(AttentionFixed, LseIsOptional) {
  for (const Case& c : {Case{1, 70, 4, 2, 64, true}, Case{1, 2, 4, 2, 64, true, false, 0, 50, 40}}) {
    Problem pr(c, 500);
    Buffers on(device(), pr);
    FORGE_TEST_OP(attention_forward, device(), on.params(pr));
    const auto with = on.out.download();
    on.out.upload(pr.out);
    auto p = on.params(pr);
    p.lse = nullptr;
    FORGE_TEST_OP(attention_forward, device(), p);
    const auto without = on.out.download();
    EXPECT_EQ(0, std::memcmp(with.data(), without.data(), with.size() * sizeof(float))) << c.name();
  }
}

// Under the causal mask, changing the tokens after position t leaves rows up to t bitwise unchanged (masked
// probabilities are exact zeros): forward out and lse, and backward's dq.
TEST_P(AttentionFixed, LaterTokensDoNotLeak) {
  // rows 0..cut must not see the tokens after cut
  for (const auto& [c, cut] : {std::pair{Case{1, 150, 4, 2, 64, true}, int64_t{77}},
                               std::pair{Case{1, 90, 2, 1, 16, true}, int64_t{40}}}) {
    Problem a(c, 600), b(c, 600);
    for (int64_t t = cut + 1; t < c.seq; ++t)
      for (int64_t i = 0; i < b.q_stride; ++i) b.inputs[t * b.q_stride + i] += 1.0f;
    for (int64_t j = cut + 1; j < c.seq; ++j)
      for (int64_t g = 0; g < c.kv_heads; ++g) {
        for (int64_t i = 0; i < c.head_dim; ++i) b.inputs[b.k_at(0, j, g) + i] *= -1.0f;
        for (int64_t i = 0; i < b.v_dim; ++i) b.inputs[b.v_at(0, j, g) + i] += 0.5f;
      }
    std::vector<std::vector<float>> out, lse, dq;
    for (Problem* pr : {&a, &b}) {
      FORGE_TEST_OP(attention_forward, Device::cpu, pr->host_params());  // same lse for rows <= cut on both
      Buffers on(device(), *pr);
      FORGE_TEST_OP(attention_forward, device(), on.params(*pr));
      out.push_back(on.out.download());
      lse.push_back(on.lse.download());
      on.out.upload(pr->out), on.lse.upload(pr->lse);
      FORGE_TEST_OP(attention_backward, device(), on.params(*pr));
      dq.push_back(on.grads.download());
    }
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), (cut + 1) * a.out_stride * sizeof(float)))
        << c.name();
    for (int64_t h = 0; h < c.heads; ++h)
      EXPECT_EQ(0,
                std::memcmp(lse[0].data() + h * c.seq, lse[1].data() + h * c.seq, (cut + 1) * sizeof(float)))
          << c.name() << " lse of head " << h;
    // dq rows <= cut depend on later tokens only through dout and out of later rows: none.
    for (int64_t t = 0; t <= cut; ++t)
      EXPECT_EQ(0, std::memcmp(dq[0].data() + t * a.q_stride, dq[1].data() + t * a.q_stride,
                               c.heads * c.head_dim * sizeof(float)))
          << c.name() << " dq row " << t;
  }
}

// Cache positions past kv_seq (stale or never written) take no part, in both kernels and both layouts.
TEST_P(AttentionFixed, IgnoresCachePositionsPastKvSeq) {
  for (const Case& c :
       {Case{1, 1, 2, 2, 16, true, false, 0, 41, 40}, Case{1, 1, 2, 2, 16, true, false, 0, 41, 40, true},
        Case{1, 1, 2, 2, 64, true, false, 0, 41, 40}, Case{1, 1, 2, 2, 64, true, false, 0, 41, 40, true},
        Case{1, 30, 2, 1, 64, true, false, 0, 41, 11}, Case{1, 30, 2, 1, 64, true, false, 0, 41, 11, true}}) {
    Problem a(c, 700), b(c, 700);
    for (int64_t j = c.kv_seq; j < b.capacity; ++j)
      for (int64_t g = 0; g < c.kv_heads; ++g) {
        for (int64_t i = 0; i < b.v_dim; ++i) b.inputs[b.v_at(0, j, g) + i] = 1e30f;
        for (int64_t i = 0; i < c.head_dim; ++i)
          b.inputs[b.k_at(0, j, g) + i] = std::numeric_limits<float>::quiet_NaN();
      }
    std::vector<std::vector<float>> out;
    for (Problem* pr : {&a, &b}) {
      Buffers on(device(), *pr);
      FORGE_TEST_OP(attention_forward, device(), on.params(*pr));
      out.push_back(on.out.download());
    }
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float))) << c.name();
  }
}

}  // namespace forge::op_tests::attention
