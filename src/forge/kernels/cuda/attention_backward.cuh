// Attention backward on tensor cores, FlashAttention-2's algorithm in two deterministic kernels (no atomics):
// P is recomputed from q, k and the forward's lse, D = rowsum(dout o out) comes from the staging pass
// (attention_tiles.cuh), dS = P o (dP - D) with dP = dout V^T.
//
//   attention_key_kernel    one CTA per (batch, kv head, block of keys); each warp owns 16 keys and keeps
//   their
//                           dK, dV rows in registers while it walks the group's query heads in order and, for
//                           each, the query blocks that see its keys (S^T = K Q^T and dP^T = V dO^T, so P^T
//                           and dS^T come out in the layout the dV += P^T dO and dK += dS^T Q MMAs take).
//   attention_query_kernel  one CTA per (batch, head, block of 128 queries); each warp owns 16 queries and
//                           walks the key blocks for dQ += dS K.
// Each output element is summed by one thread in an order fixed by the problem size.
//
// Scores are in base 2 (q is staged pre-scaled by scale * log2(e)); P = 2^(S - lse log2(e)) is the true
// softmax, dS the true score gradient, so dK = scale dS^T q = ln(2) dS^T (staged q) and dQ = scale dS K.
// D is the wider of head_dim and v_head_dim, padded: the staged copies are zero past their own width, so dP
// sums only v_head_dim columns and the columns of dK past head_dim and of dV past v_head_dim (zero) are not
// stored.
#ifndef FORGE_KERNELS_CUDA_ATTENTION_BACKWARD_CUH
#define FORGE_KERNELS_CUDA_ATTENTION_BACKWARD_CUH

#include <cmath>
#include <cstdint>

#include "forge/kernels/cuda/attention_tiles.cuh"

namespace forge::cuda::attention {

struct BackwardParams {
  const uint16_t* q = nullptr;     // [batch, heads, padded_seq, D], scaled by scale * log2(e)
  const uint16_t* dout = nullptr;  // [batch, heads, padded_seq, D], zero past v_head_dim
  const uint16_t* k = nullptr;     // [batch, kv_heads, padded_seq, D]
  const uint16_t* v = nullptr;     // the same, zero past v_head_dim
  const float* lse2 = nullptr;     // [batch, heads, padded_seq]: lse * log2(e)
  const float* delta = nullptr;    // [batch, heads, padded_seq]: <dout, out>
  void* dq = nullptr;              // [batch, seq, heads, head_dim]
  void* dk = nullptr;              // [batch, seq, kv_heads, head_dim]
  void* dv = nullptr;              // [batch, seq, kv_heads, v_head_dim]
  bool grads_bf16 = false;         // dq, dk and dv hold bf16 (else fp32)
  int64_t dq_stride = 0, dk_stride = 0, dv_stride = 0;
  int64_t batch = 0, heads = 0, kv_heads = 0, group = 0, seq = 0, padded_seq = 0;
  int head_dim = 0, v_head_dim = 0;  // D covers both
  float scale = 1.0f;
  bool causal = true;
};

// Per padded head dimension. Key kernel: kWarps warps of 16 keys, kQueries queries per step, and the dK, dV
// columns one CTA accumulates (kColumns; D / kColumns CTAs share a key block when D is too wide for two
// accumulators of D / 2 registers per thread, each recomputing S and dP). Query kernel: kKeys per tile.
template <int D>
struct BackwardShape {
  static constexpr int kWarps = D <= 128 ? 8 : 4;
  static constexpr int kKeysPerCta = 16 * kWarps;
  static constexpr int kQueries = D <= 128 ? 64 : 32;
  static constexpr int kColumns = D <= 128 ? D : 128;
  static constexpr int kSplits = D / kColumns;
  static constexpr int kQueryKernelKeys = D <= 128 ? 64 : 32;
  static constexpr int kStageBytes = 2 * kQueries * D * 2 + 2 * kQueries * 4;  // Q, dout, lse2, delta
  static constexpr int kKeySharedBytes = 2 * kKeysPerCta * D * 2 + 2 * kStageBytes;
  static constexpr int kQuerySharedBytes = 2 * 128 * D * 2 + 4 * kQueryKernelKeys * D * 2;
};

constexpr int kQueryRows = 128;  // queries per CTA of the query kernel
constexpr int kQueryThreads = 256;

template <int D>
__global__ void __launch_bounds__(BackwardShape<D>::kWarps * 32, 1)
    attention_key_kernel(const BackwardParams p) {
  using Shape = BackwardShape<D>;
  constexpr int kThreads = Shape::kWarps * 32, kKeys = Shape::kKeysPerCta, kQueries = Shape::kQueries;
  constexpr int kSteps = D / 16, kQueryTiles = kQueries / 8, kColumnTiles = Shape::kColumns / 8;
  constexpr int kKeyBytes = kKeys * D * 2, kRowBytes = kQueries * D * 2;

  // A 1-D grid, column splits, kv heads and sequences fastest: the first key blocks, which the most queries
  // see under the causal mask, go first.
  const int64_t linear = blockIdx.x, per_block = p.batch * p.kv_heads * Shape::kSplits;
  const int64_t n0 = linear / per_block * kKeys;
  const int column0 = static_cast<int>(linear % Shape::kSplits) * Shape::kColumns;
  const int64_t kv_head = linear / Shape::kSplits % p.kv_heads,
                b = linear / Shape::kSplits / p.kv_heads % p.batch;
  char* shared = dynamic_shared_memory();
  char* k_tile = shared;
  char* v_tile = shared + kKeyBytes;
  char* stages = shared + 2 * kKeyBytes;
  const int64_t kv_rows = ((b * p.kv_heads + kv_head) * p.padded_seq + n0) * D;
  load_tile_async<D, kKeys, kThreads>(k_tile, p.k + kv_rows);
  load_tile_async<D, kKeys, kThreads>(v_tile, p.v + kv_rows);

  // Steps: the group's query heads in order, for each the query blocks from the first that sees these keys.
  const int64_t query_blocks = (p.seq + kQueries - 1) / kQueries;
  const int64_t first_block = p.causal ? n0 / kQueries : 0;
  const int64_t per_head = query_blocks - first_block, steps = p.group * per_head;  // n0 < seq: per_head >= 1
  auto issue = [&](int64_t step) {
    char* stage = stages + (step & 1) * Shape::kStageBytes;
    const int64_t h = kv_head * p.group + step / per_head;
    const int64_t row = (b * p.heads + h) * p.padded_seq + (first_block + step % per_head) * kQueries;
    load_tile_async<D, kQueries, kThreads>(stage, p.q + row * D);
    load_tile_async<D, kQueries, kThreads>(stage + kRowBytes, p.dout + row * D);
    load_floats_async<kQueries, kThreads>(stage + 2 * kRowBytes, p.lse2 + row);
    load_floats_async<kQueries, kThreads>(stage + 2 * kRowBytes + kQueries * 4, p.delta + row);
    cp_async_commit();
  };
  issue(0);  // one group with K and V

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_key = warp * 16;
  const int64_t key = n0 + warp_key + g;  // this thread's first key row; the second is key + 8
  float dk[kColumnTiles][4], dv[kColumnTiles][4];
#pragma unroll
  for (int i = 0; i < kColumnTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;

  for (int64_t step = 0; step < steps; ++step) {
    if (step + 1 < steps) {
      issue(step + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const char* q_tile = stages + (step & 1) * Shape::kStageBytes;
    const char* dout_tile = q_tile + kRowBytes;
    const float* lse2 = reinterpret_cast<const float*>(q_tile + 2 * kRowBytes);
    const float* delta = lse2 + kQueries;
    const int64_t m0 = (first_block + step % per_head) * kQueries;

    // S^T = K Q^T and dP^T = V dO^T: rows are the warp's 16 keys, columns the step's queries.
    float s[kQueryTiles][4], dp[kQueryTiles][4];
#pragma unroll
    for (int i = 0; i < kQueryTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
    for (int step_k = 0; step_k < kSteps; ++step_k) {
      uint32_t a[4];
      ldmatrix_x4(a, a_address<D>(k_tile, warp_key, step_k * 16, lane));
#pragma unroll
      for (int pair = 0; pair < kQueryTiles / 2; ++pair) {
        uint32_t bq[4];
        ldmatrix_x4(bq, b_address<D>(q_tile, pair * 16, step_k * 16, lane));
        mma_bf16_16816(s[2 * pair], a, bq[0], bq[1]);
        mma_bf16_16816(s[2 * pair + 1], a, bq[2], bq[3]);
      }
      ldmatrix_x4(a, a_address<D>(v_tile, warp_key, step_k * 16, lane));
#pragma unroll
      for (int pair = 0; pair < kQueryTiles / 2; ++pair) {
        uint32_t bd[4];
        ldmatrix_x4(bd, b_address<D>(dout_tile, pair * 16, step_k * 16, lane));
        mma_bf16_16816(dp[2 * pair], a, bd[0], bd[1]);
        mma_bf16_16816(dp[2 * pair + 1], a, bd[2], bd[3]);
      }
    }

    // P^T = 2^(S^T - lse2), zero for queries past the sequence and (causal) keys after the query;
    // dS^T = P^T o (dP^T - delta). Keys past the sequence (zero rows, never stored) are zeroed too, so that
    // no overflow can appear even in rows that are dropped.
    const bool masked = m0 + kQueries > p.seq || n0 + kKeys > p.seq || (p.causal && n0 + kKeys - 1 > m0);
#pragma unroll
    for (int i = 0; i < kQueryTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = i * 8 + 2 * t + (e & 1);
        const int64_t query = m0 + column;
        float prob = exp2f(s[i][e] - lse2[column]);
        const int64_t row_key = key + (e >> 1) * 8;
        if (masked && (query >= p.seq || row_key >= p.seq || (p.causal && row_key > query))) prob = 0.0f;
        dp[i][e] = prob * (dp[i][e] - delta[column]);
        s[i][e] = prob;
      }

      // dV += P^T dO and dK += dS^T Q over this CTA's columns: tile rows are queries (k), columns head dims
      // (n).
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      uint32_t a_p[4], a_ds[4];
      accumulator_to_a(s, kk, a_p);
      accumulator_to_a(dp, kk, a_ds);
#pragma unroll
      for (int pair = 0; pair < kColumnTiles / 2; ++pair) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, bt_address<D>(dout_tile, kk * 16, column0 + pair * 16, lane));
        mma_bf16_16816(dv[2 * pair], a_p, b[0], b[1]);
        mma_bf16_16816(dv[2 * pair + 1], a_p, b[2], b[3]);
        ldmatrix_x4_trans(b, bt_address<D>(q_tile, kk * 16, column0 + pair * 16, lane));
        mma_bf16_16816(dk[2 * pair], a_ds, b[0], b[1]);
        mma_bf16_16816(dk[2 * pair + 1], a_ds, b[2], b[3]);
      }
    }
    __syncthreads();  // the next step's copies overwrite the stage read here
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = key + 8 * half;
    if (row >= p.seq) continue;
    const int64_t dk_row = (b * p.seq + row) * p.dk_stride + kv_head * p.head_dim;
    const int64_t dv_row = (b * p.seq + row) * p.dv_stride + kv_head * p.v_head_dim;
#pragma unroll
    for (int i = 0; i < kColumnTiles; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int column = column0 + i * 8 + 2 * t + e;
        if (column < p.head_dim)
          store_output(p.dk, p.grads_bf16, dk_row + column, dk[i][2 * half + e] * kLn2);
        if (column < p.v_head_dim) store_output(p.dv, p.grads_bf16, dv_row + column, dv[i][2 * half + e]);
      }
  }
}

template <int D>
__global__ void __launch_bounds__(kQueryThreads, 1) attention_query_kernel(const BackwardParams p) {
  using Shape = BackwardShape<D>;
  constexpr int kKeys = Shape::kQueryKernelKeys, kSteps = D / 16, kScoreTiles = kKeys / 8, kOutTiles = D / 8;
  constexpr int kRowBytes = kQueryRows * D * 2, kTileBytes = kKeys * D * 2;

  // A 1-D grid ordered as the forward's: last query blocks (the most keys) of every (batch, head) first.
  const int64_t pairs = p.batch * p.heads, linear = blockIdx.x;
  const int64_t m0 = (int64_t{gridDim.x} / pairs - 1 - linear / pairs) * kQueryRows;
  const int64_t h = linear % p.heads, b = linear / p.heads % p.batch, kv_head = h / p.group;
  char* shared = dynamic_shared_memory();
  char* q_tile = shared;
  char* dout_tile = shared + kRowBytes;
  char* kv_tiles = shared + 2 * kRowBytes;  // stage s: K at 2s tiles, V right after
  const int64_t rows = (b * p.heads + h) * p.padded_seq + m0;
  const uint16_t* k = p.k + (b * p.kv_heads + kv_head) * p.padded_seq * D;
  const uint16_t* v = p.v + (b * p.kv_heads + kv_head) * p.padded_seq * D;
  const int64_t rows_end = m0 + kQueryRows < p.seq ? m0 + kQueryRows : p.seq;
  const int64_t key_end = p.causal ? rows_end : p.seq;
  const int n_blocks = static_cast<int>((key_end + kKeys - 1) / kKeys);

  load_tile_async<D, kQueryRows, kQueryThreads>(q_tile, p.q + rows * D);
  load_tile_async<D, kQueryRows, kQueryThreads>(dout_tile, p.dout + rows * D);
  load_tile_async<D, kKeys, kQueryThreads>(kv_tiles, k);
  load_tile_async<D, kKeys, kQueryThreads>(kv_tiles + kTileBytes, v);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;
  const int64_t query = m0 + warp_row + g;  // this thread's first row; the second is query + 8
  const float lse2[2] = {p.lse2[rows + warp_row + g], p.lse2[rows + warp_row + g + 8]};
  const float delta[2] = {p.delta[rows + warp_row + g], p.delta[rows + warp_row + g + 8]};
  float dq[kOutTiles][4];
#pragma unroll
  for (int i = 0; i < kOutTiles; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;

  for (int j = 0; j < n_blocks; ++j) {
    if (j + 1 < n_blocks) {
      char* next = kv_tiles + ((j + 1) & 1) * 2 * kTileBytes;
      load_tile_async<D, kKeys, kQueryThreads>(next, k + int64_t{j + 1} * kKeys * D);
      load_tile_async<D, kKeys, kQueryThreads>(next + kTileBytes, v + int64_t{j + 1} * kKeys * D);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const char* k_tile = kv_tiles + (j & 1) * 2 * kTileBytes;
    const char* v_tile = k_tile + kTileBytes;

    // S = Q K^T and dP = dO V^T for the warp's 16 queries.
    float s[kScoreTiles][4], dp[kScoreTiles][4];
#pragma unroll
    for (int i = 0; i < kScoreTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      uint32_t a[4];
      ldmatrix_x4(a, a_address<D>(q_tile, warp_row, step * 16, lane));
#pragma unroll
      for (int pair = 0; pair < kScoreTiles / 2; ++pair) {
        uint32_t bk[4];
        ldmatrix_x4(bk, b_address<D>(k_tile, pair * 16, step * 16, lane));
        mma_bf16_16816(s[2 * pair], a, bk[0], bk[1]);
        mma_bf16_16816(s[2 * pair + 1], a, bk[2], bk[3]);
      }
      ldmatrix_x4(a, a_address<D>(dout_tile, warp_row, step * 16, lane));
#pragma unroll
      for (int pair = 0; pair < kScoreTiles / 2; ++pair) {
        uint32_t bv[4];
        ldmatrix_x4(bv, b_address<D>(v_tile, pair * 16, step * 16, lane));
        mma_bf16_16816(dp[2 * pair], a, bv[0], bv[1]);
        mma_bf16_16816(dp[2 * pair + 1], a, bv[2], bv[3]);
      }
    }

    const int64_t n0 = int64_t{j} * kKeys;
    const bool masked = n0 + kKeys > p.seq || (p.causal && n0 + kKeys - 1 > m0);
#pragma unroll
    for (int i = 0; i < kScoreTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = n0 + i * 8 + 2 * t + (e & 1);
        float prob = exp2f(s[i][e] - lse2[e >> 1]);
        if (masked && (key >= p.seq || (p.causal && key > query + (e >> 1) * 8))) prob = 0.0f;
        dp[i][e] = prob * (dp[i][e] - delta[e >> 1]);
      }

      // dQ += dS K: K tile rows are keys (k), columns head dims (n).
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t a[4];
      accumulator_to_a(dp, kk, a);
#pragma unroll
      for (int pair = 0; pair < kOutTiles / 2; ++pair) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, bt_address<D>(k_tile, kk * 16, pair * 16, lane));
        mma_bf16_16816(dq[2 * pair], a, bk[0], bk[1]);
        mma_bf16_16816(dq[2 * pair + 1], a, bk[2], bk[3]);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = query + 8 * half;
    if (row >= p.seq) continue;
    const int64_t dq_row = (b * p.seq + row) * p.dq_stride + h * p.head_dim;
#pragma unroll
    for (int i = 0; i < kOutTiles; ++i) {
      const int column = i * 8 + 2 * t;
      if (column < p.head_dim) store_output(p.dq, p.grads_bf16, dq_row + column, dq[i][2 * half] * p.scale);
      if (column + 1 < p.head_dim)
        store_output(p.dq, p.grads_bf16, dq_row + column + 1, dq[i][2 * half + 1] * p.scale);
    }
  }
}

}  // namespace forge::cuda::attention

#endif  // FORGE_KERNELS_CUDA_ATTENTION_BACKWARD_CUH
