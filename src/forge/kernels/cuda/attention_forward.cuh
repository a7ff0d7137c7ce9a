// Attention forward on tensor cores, FlashAttention-2 style (attention.cu launches it on the bf16 copies of
// attention_tiles.cuh). One CTA = one (batch, head, block of 128 queries); 8 warps of 16 query rows each. The
// CTA walks the key blocks in order with K and V tiles double-buffered by cp.async; per block each warp forms
// S = Q K^T (bf16 MMA, fp32 accumulators), updates its rows' running max and sum (online softmax, base 2),
// rescales O and adds P V, with P handed from the score accumulators to the next MMA in registers. Nothing of
// size seq x seq exists anywhere.
//
// D is the wider of head_dim and v_head_dim, padded; q and k are zero past head_dim and v past v_head_dim, so
// S sums head_dim columns and O has v_head_dim (the rest zero, not stored).
//
// Every row's scores, maxima and sums are reduced in an order fixed by the problem size, so results are
// bitwise reproducible.
#ifndef FORGE_KERNELS_CUDA_ATTENTION_FORWARD_CUH
#define FORGE_KERNELS_CUDA_ATTENTION_FORWARD_CUH

#include <cmath>
#include <cstdint>

#include "forge/kernels/cuda/attention_tiles.cuh"

namespace forge::cuda::attention {

struct ForwardParams {
  const uint16_t* q = nullptr;  // [batch, heads, padded_seq, D], scaled by scale * log2(e)
  const uint16_t* k = nullptr;  // [batch, kv_heads, padded_kv_seq, D]
  const uint16_t* v = nullptr;  // the same, zero past v_head_dim
  void* out = nullptr;          // [batch, seq, heads, v_head_dim], out_stride between tokens
  bool out_bf16 = false;        // out holds bf16 (else fp32)
  int64_t out_stride = 0;
  float* lse = nullptr;  // optional [batch, heads, seq]
  int64_t batch = 0, heads = 0, kv_heads = 0, group = 0, seq = 0, kv_seq = 0, q_offset = 0, padded_seq = 0,
          padded_kv_seq = 0;
  int head_dim = 0, v_head_dim = 0;  // D covers both
  bool causal = true;
};

constexpr int kForwardRows = 128;  // queries per CTA
constexpr int kForwardThreads = 256;

// Keys per tile and whether each warp keeps its Q fragments in registers, by padded head dimension: registers
// hold O (D / 2 per thread), S (kKeys / 2) and the Q fragments (D / 4) under the 255 a thread may have.
template <int D>
struct ForwardShape {
  static constexpr int kKeys = D <= 128 ? 64 : 32;
  static constexpr bool kQInRegisters = D <= 128;
  static constexpr int kSharedBytes = (kForwardRows + 4 * kKeys) * D * 2;  // Q, then 2 stages of K and V
};

template <int D>
__global__ void __launch_bounds__(kForwardThreads, 1) attention_forward_kernel(const ForwardParams p) {
  using Shape = ForwardShape<D>;
  constexpr int kKeys = Shape::kKeys, kSteps = D / 16, kScoreTiles = kKeys / 8, kOutTiles = D / 8;
  constexpr int kTileBytes = kKeys * D * 2;
  constexpr float kInf = INFINITY;

  // A 1-D grid, heads and sequences fastest: every (batch, head)'s last query block, which sees the most keys
  // under the causal mask, is handed out before any second-to-last one, and so on (longest first).
  const int64_t pairs = p.batch * p.heads, linear = blockIdx.x;
  const int64_t m0 = (int64_t{gridDim.x} / pairs - 1 - linear / pairs) * kForwardRows;
  const int64_t h = linear % p.heads, b = linear / p.heads % p.batch, kv_head = h / p.group;
  char* shared = dynamic_shared_memory();
  char* q_tile = shared;
  char* kv_tiles = shared + kForwardRows * D * 2;  // stage s: K at 2s tiles, V right after
  const uint16_t* k = p.k + (b * p.kv_heads + kv_head) * p.padded_kv_seq * D;
  const uint16_t* v = p.v + (b * p.kv_heads + kv_head) * p.padded_kv_seq * D;

  const int64_t rows_end = m0 + kForwardRows < p.seq ? m0 + kForwardRows : p.seq;
  int64_t key_end = p.kv_seq;  // keys [0, key_end) are visible to some row of this block
  if (p.causal && p.q_offset + rows_end < key_end) key_end = p.q_offset + rows_end;
  const int n_blocks = static_cast<int>((key_end + kKeys - 1) / kKeys);

  load_tile_async<D, kForwardRows, kForwardThreads>(q_tile,
                                                    p.q + ((b * p.heads + h) * p.padded_seq + m0) * D);
  load_tile_async<D, kKeys, kForwardThreads>(kv_tiles, k);
  load_tile_async<D, kKeys, kForwardThreads>(kv_tiles + kTileBytes, v);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;
  // Key position of this thread's first row (g); its second row (g + 8) sits 8 further.
  const int64_t position = p.q_offset + m0 + warp_row + g;

  float o[kOutTiles][4];
#pragma unroll
  for (int i = 0; i < kOutTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};  // row_sum: this thread's columns only
  uint32_t q_fragments[Shape::kQInRegisters ? kSteps : 1][4];

  for (int j = 0; j < n_blocks; ++j) {
    if (j + 1 < n_blocks) {
      char* next = kv_tiles + ((j + 1) & 1) * 2 * kTileBytes;
      load_tile_async<D, kKeys, kForwardThreads>(next, k + int64_t{j + 1} * kKeys * D);
      load_tile_async<D, kKeys, kForwardThreads>(next + kTileBytes, v + int64_t{j + 1} * kKeys * D);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const char* k_tile = kv_tiles + (j & 1) * 2 * kTileBytes;
    const char* v_tile = k_tile + kTileBytes;
    if constexpr (Shape::kQInRegisters) {
      if (j == 0) {
#pragma unroll
        for (int step = 0; step < kSteps; ++step)
          ldmatrix_x4(q_fragments[step], a_address<D>(q_tile, warp_row, step * 16, lane));
      }
    }

    // S = Q K^T for the warp's 16 rows and the tile's kKeys keys.
    float s[kScoreTiles][4];
#pragma unroll
    for (int i = 0; i < kScoreTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      uint32_t a[4];
      if constexpr (Shape::kQInRegisters) {
        a[0] = q_fragments[step][0], a[1] = q_fragments[step][1];
        a[2] = q_fragments[step][2], a[3] = q_fragments[step][3];
      } else {
        ldmatrix_x4(a, a_address<D>(q_tile, warp_row, step * 16, lane));
      }
#pragma unroll
      for (int pair = 0; pair < kScoreTiles / 2; ++pair) {
        uint32_t bk[4];
        ldmatrix_x4(bk, b_address<D>(k_tile, pair * 16, step * 16, lane));
        mma_bf16_16816(s[2 * pair], a, bk[0], bk[1]);
        mma_bf16_16816(s[2 * pair + 1], a, bk[2], bk[3]);
      }
    }

    // Mask keys past kv_seq (the ragged last tile) and, under the causal mask, keys after each row's
    // position.
    const int64_t n0 = int64_t{j} * kKeys;
    if (n0 + kKeys > p.kv_seq || (p.causal && n0 + kKeys - 1 > p.q_offset + m0)) {
#pragma unroll
      for (int i = 0; i < kScoreTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = n0 + i * 8 + 2 * t + (e & 1);
          if (key >= p.kv_seq || (p.causal && key > position + (e >> 1) * 8)) s[i][e] = -kInf;
        }
    }

    // Online softmax: new running max, P = 2^(S - max), rescale the running sum and O by 2^(old - new).
    float alpha[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = row_max[half];
#pragma unroll
      for (int i = 0; i < kScoreTiles; ++i) m = fmaxf(m, fmaxf(s[i][2 * half], s[i][2 * half + 1]));
      m = quad_max(m);
      const float base = m == -kInf ? 0.0f : m;  // a row with nothing visible yet stays at zero
      alpha[half] = exp2f(row_max[half] - base);
      row_max[half] = m;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kScoreTiles; ++i) {
        s[i][2 * half] = exp2f(s[i][2 * half] - base);
        s[i][2 * half + 1] = exp2f(s[i][2 * half + 1] - base);
        sum += s[i][2 * half] + s[i][2 * half + 1];
      }
      row_sum[half] = row_sum[half] * alpha[half] + sum;
    }
#pragma unroll
    for (int i = 0; i < kOutTiles; ++i) {
      o[i][0] *= alpha[0], o[i][1] *= alpha[0];
      o[i][2] *= alpha[1], o[i][3] *= alpha[1];
    }

    // O += P V: P from the score registers (rounded to bf16), V tile rows are keys (k), columns head dims
    // (n).
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t a[4];
      accumulator_to_a(s, kk, a);
#pragma unroll
      for (int pair = 0; pair < kOutTiles / 2; ++pair) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, bt_address<D>(v_tile, kk * 16, pair * 16, lane));
        mma_bf16_16816(o[2 * pair], a, bv[0], bv[1]);
        mma_bf16_16816(o[2 * pair + 1], a, bv[2], bv[3]);
      }
    }
    __syncthreads();  // the next iteration's copies overwrite the stage read here
  }

  // out = O / sum (rows inside the sequence, columns inside v_head_dim); lse = ln(sum) + max in natural
  // units.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float total = quad_sum(row_sum[half]);
    const int64_t row = m0 + warp_row + g + 8 * half;
    if (row >= p.seq) continue;
    const float inverse = 1.0f / total;
    const int64_t out = (b * p.seq + row) * p.out_stride + h * p.v_head_dim;
#pragma unroll
    for (int i = 0; i < kOutTiles; ++i) {
      const int column = i * 8 + 2 * t;
      if (column < p.v_head_dim) store_output(p.out, p.out_bf16, out + column, o[i][2 * half] * inverse);
      if (column + 1 < p.v_head_dim)
        store_output(p.out, p.out_bf16, out + column + 1, o[i][2 * half + 1] * inverse);
    }
    if (p.lse != nullptr && t == 0)
      p.lse[(b * p.heads + h) * p.seq + row] = (row_max[half] + log2f(total)) * kLn2;
  }
}

}  // namespace forge::cuda::attention

#endif  // FORGE_KERNELS_CUDA_ATTENTION_FORWARD_CUH
