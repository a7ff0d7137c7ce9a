// Attention for a few new queries (at most kDecodeMaxQueries) against a longer key/value cache: generation's
// decoding step. Tensor-core tiles of 128 queries would be almost empty and staging the whole cache in bf16
// would triple the memory traffic of a memory-bound step, so these kernels read the fp32 cache where it lies
// (either layout) and compute in fp32. Values have v_head_dim columns and may alias the keys (MLA's absorbed
// decode: one kv head of q/k 576 whose values are the first 512 columns of each key row); both are only read.
//
//   attention_decode_chunk_kernel    one CTA per (batch, head, chunk of kDecodeKeys keys), one thread per
//   key:
//                                    each thread's dot products with every query row (the queries in dynamic
//                                    shared memory, decode_shared_bytes), the chunk's row maxima and sums
//                                    (block reductions), then threads over v_head_dim accumulate P V.
//                                    Unnormalised partial outputs go to scratch.
//   attention_decode_combine_kernel  one CTA per (batch, head, query row): the chunks in chunk order.
// The chunk size is fixed and every reduction has a fixed order, so results are bitwise reproducible.
#ifndef FORGE_KERNELS_CUDA_ATTENTION_DECODE_CUH
#define FORGE_KERNELS_CUDA_ATTENTION_DECODE_CUH

#include <cmath>
#include <cstdint>

#include "forge/kernels/cuda/attention_tiles.cuh"

namespace forge::cuda::attention {

constexpr int kDecodeKeys = 128;  // keys per chunk = threads per CTA
constexpr int kDecodeMaxQueries = 16;
// The widest q/k rows: 16 query rows of 576 floats (36 KiB) and the static scores (8 KiB) stay under the
// 48 KiB a CTA may use without opting in. 576 is MLA's absorbed decode (512 latent + 64 rope).
constexpr int kDecodeMaxHeadDim = 576;

// Dynamic shared memory of the chunk kernel: the scaled queries [seq, head_dim].
inline int decode_shared_bytes(int64_t seq, int64_t head_dim) {
  return static_cast<int>(seq * head_dim * sizeof(float));
}

struct DecodeParams {
  const float* q = nullptr;  // [batch, seq, heads, head_dim], q_stride between tokens
  int64_t q_stride = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_stride = 0, v_stride = 0, k_head_stride = 0, v_head_stride = 0, k_batch_stride = 0,
          v_batch_stride = 0;
  float* partial = nullptr;      // [batch, heads, chunks, seq, v_head_dim]
  float* partial_max = nullptr;  // [batch, heads, chunks, seq], base 2
  float* partial_sum = nullptr;
  float* out = nullptr;
  int64_t out_stride = 0;
  float* lse = nullptr;  // optional [batch, heads, seq]
  int64_t heads = 0, group = 0, seq = 0, kv_seq = 0, q_offset = 0, chunks = 0;
  int64_t key_end = 0;               // keys [0, key_end) are visible to some row
  int head_dim = 0, v_head_dim = 0;  // columns of q and k; of v and out
  float factor = 1.0f;               // scale * log2(e)
  bool causal = true;
};

// Block-wide max and sum over kDecodeKeys threads: warp butterflies, then the four warp results in a fixed
// order; every thread gets the result. `scratch` holds 4 floats and may be reused by the next call.
__device__ __forceinline__ float decode_block_max(float x, float* scratch) {
  x = warp_max(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  const float result = fmaxf(fmaxf(scratch[0], scratch[1]), fmaxf(scratch[2], scratch[3]));
  __syncthreads();
  return result;
}
__device__ __forceinline__ float decode_block_sum(float x, float* scratch) {
  x = warp_sum(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  const float result = (scratch[0] + scratch[1]) + (scratch[2] + scratch[3]);
  __syncthreads();
  return result;
}

__global__ void __launch_bounds__(kDecodeKeys) attention_decode_chunk_kernel(const DecodeParams p) {
  static_assert(kDecodeKeys == 128, "the block reductions combine four warps");
  constexpr float kInf = INFINITY;
  float* queries = reinterpret_cast<float*>(dynamic_shared_memory());  // [seq, head_dim], scaled
  __shared__ float scores[kDecodeMaxQueries * kDecodeKeys];  // [seq, kDecodeKeys], then probabilities
  __shared__ float reduce[4];
  const int64_t chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kv_head = h / p.group;
  const int tid = threadIdx.x, dim = p.head_dim, v_dim = p.v_head_dim;
  const int rows = static_cast<int>(p.seq);
  for (int i = tid; i < rows * dim; i += kDecodeKeys) {
    const int r = i / dim, d = i % dim;
    queries[i] = p.q[(b * p.seq + r) * p.q_stride + h * dim + d] * p.factor;
  }
  __syncthreads();

  // Scores: thread tid takes key c0 + tid, its row read once for all query rows.
  const int64_t c0 = chunk * kDecodeKeys, key = c0 + tid;
  if (key < p.key_end) {
    const float* k_row = p.k + b * p.k_batch_stride + kv_head * p.k_head_stride + key * p.k_stride;
    float acc[kDecodeMaxQueries];
#pragma unroll
    for (int r = 0; r < kDecodeMaxQueries; ++r) acc[r] = 0.0f;
    for (int d = 0; d < dim; ++d) {
      const float x = k_row[d];
#pragma unroll
      for (int r = 0; r < kDecodeMaxQueries; ++r)
        if (r < rows) acc[r] = fmaf(queries[r * dim + d], x, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < kDecodeMaxQueries; ++r)
      if (r < rows) scores[r * kDecodeKeys + tid] = p.causal && key > p.q_offset + r ? -kInf : acc[r];
  } else {
    for (int r = 0; r < rows; ++r) scores[r * kDecodeKeys + tid] = -kInf;
  }
  __syncthreads();

  // Per row: the chunk's max (-inf when the row sees none of its keys) and sum of 2^(score - max).
  const int64_t item = (b * p.heads + h) * p.chunks + chunk;
  for (int r = 0; r < rows; ++r) {
    const float x = scores[r * kDecodeKeys + tid];
    const float m = decode_block_max(x, reduce);
    const float e = m == -kInf ? 0.0f : exp2f(x - m);
    scores[r * kDecodeKeys + tid] = e;
    const float l = decode_block_sum(e, reduce);
    if (tid == 0) p.partial_max[item * p.seq + r] = m, p.partial_sum[item * p.seq + r] = l;
  }
  __syncthreads();

  // partial[r, d] = sum_j P[r, j] v[j, d]: threads over head_dim, so each key's row is read coalesced.
  int64_t count = p.key_end - c0;
  if (count > kDecodeKeys) count = kDecodeKeys;
  const float* values = p.v + b * p.v_batch_stride + kv_head * p.v_head_stride + c0 * p.v_stride;
  for (int d = tid; d < v_dim; d += kDecodeKeys) {
    float acc[kDecodeMaxQueries];
#pragma unroll
    for (int r = 0; r < kDecodeMaxQueries; ++r) acc[r] = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
      const float x = values[j * p.v_stride + d];
#pragma unroll
      for (int r = 0; r < kDecodeMaxQueries; ++r)
        if (r < rows) acc[r] = fmaf(scores[r * kDecodeKeys + j], x, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < kDecodeMaxQueries; ++r)
      if (r < rows) p.partial[(item * p.seq + r) * v_dim + d] = acc[r];
  }
}

__global__ void __launch_bounds__(kDecodeKeys) attention_decode_combine_kernel(const DecodeParams p) {
  constexpr float kInf = INFINITY;
  const int64_t r = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t first = (b * p.heads + h) * p.chunks;
  float m = -kInf;
  for (int64_t c = 0; c < p.chunks; ++c) m = fmaxf(m, p.partial_max[(first + c) * p.seq + r]);
  float total = 0.0f;
  for (int64_t c = 0; c < p.chunks; ++c) {
    const float mc = p.partial_max[(first + c) * p.seq + r];
    if (mc != -kInf) total += p.partial_sum[(first + c) * p.seq + r] * exp2f(mc - m);
  }
  const float inverse = 1.0f / total;
  float* out = p.out + (b * p.seq + r) * p.out_stride + h * p.v_head_dim;
  for (int d = threadIdx.x; d < p.v_head_dim; d += kDecodeKeys) {
    float acc = 0.0f;
    for (int64_t c = 0; c < p.chunks; ++c) {
      const float mc = p.partial_max[(first + c) * p.seq + r];
      if (mc != -kInf) acc += p.partial[((first + c) * p.seq + r) * p.v_head_dim + d] * exp2f(mc - m);
    }
    out[d] = acc * inverse;
  }
  if (p.lse != nullptr && threadIdx.x == 0) p.lse[(b * p.heads + h) * p.seq + r] = (m + log2f(total)) * kLn2;
}

}  // namespace forge::cuda::attention

#endif  // FORGE_KERNELS_CUDA_ATTENTION_DECODE_CUH
