// Shared pieces of the CUDA attention kernels (attention.cu): the bf16 staging pass that turns q, k, v and
// dout into dense, zero-padded bf16 copies, and the swizzled shared-memory tiles the tensor-core kernels read
// with ldmatrix.
//
// Staging: every kernel works on copies [batch, heads, padded_tokens, D] in bf16, D the head dimension
// rounded up to 64, 128 or 256 (zeros past head_dim change no dot product) and padded_tokens a multiple of
// kRowPadding (zero rows). The copy reads q, k, v in whatever layout the caller has them (fused qkv buffers,
// either key/value cache layout), folds the softmax scale and log2(e) into q (scores come out in base 2), and
// in backward also forms each row's delta = <dout, out> in fp32 and lse * log2(e). Tiles are then plain dense
// loads that never leave a copy: cp.async, 16 bytes at a time, with no bounds checks.
#ifndef FORGE_KERNELS_CUDA_ATTENTION_TILES_CUH
#define FORGE_KERNELS_CUDA_ATTENTION_TILES_CUH

#include <cmath>
#include <cstdint>

#include "forge/kernels/cuda/attention_device.cuh"

namespace forge::cuda::attention {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.69314718055994531f;
// Rows of every bf16 copy come in multiples of this (every tile height divides it, and tiles start at
// multiples of their height, so no tile reads past its copy).
constexpr int64_t kRowPadding = 128;
constexpr int kStagingThreads = 256;  // 8 warps, one row each at a time

struct StagingParams {
  // Source rows: token t of head h of sequence b starts at src + b * batch_stride + h * head_stride +
  // t * token_stride.
  const void* src = nullptr;
  bool src_bf16 = false;  // src holds bf16 (else fp32)
  int64_t batch_stride = 0, head_stride = 0, token_stride = 0;
  int64_t batch = 0, heads = 0, tokens = 0, padded_tokens = 0;
  int head_dim = 0, padded_dim = 0;
  float factor = 1.0f;
  bool vector_loads = false;  // every row start is aligned for 4-element loads (16 bytes fp32, 8 bf16)
  uint16_t* dst = nullptr;    // [batch, heads, padded_tokens, padded_dim]
  // Backward's dout copy only (delta null otherwise): per row, delta = <src row, dot row> (unscaled, fp32;
  // dot in the same [batch, tokens, heads, head_dim] geometry with its own token stride) and
  // lse2 = lse * log2(e), both [batch, heads, padded_tokens] with zeros in the padding rows.
  const void* dot = nullptr;
  bool dot_bf16 = false;
  int64_t dot_token_stride = 0;
  bool dot_vector_loads = false;
  const float* lse = nullptr;  // [batch, heads, tokens]
  float* delta = nullptr;
  float* lse2 = nullptr;
};

// Four consecutive elements c..c+3 of a row of n, zeros past n.
__device__ __forceinline__ void load4(const float* row, int c, int n, bool vector_loads, float (&x)[4]) {
  if (vector_loads && c + 3 < n) {
    const float4 f = *reinterpret_cast<const float4*>(row + c);
    x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] = c + e < n ? row[c + e] : 0.0f;
}

// The same from a row of bf16 (widened exactly).
__device__ __forceinline__ void load4(const uint16_t* row, int c, int n, bool vector_loads, float (&x)[4]) {
  if (vector_loads && c + 3 < n) {
    const uint2 pair = *reinterpret_cast<const uint2*>(row + c);
    x[0] = __uint_as_float(pair.x << 16), x[1] = __uint_as_float(pair.x & 0xffff0000u);
    x[2] = __uint_as_float(pair.y << 16), x[3] = __uint_as_float(pair.y & 0xffff0000u);
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e)
    x[e] = c + e < n ? __uint_as_float(static_cast<uint32_t>(row[c + e]) << 16) : 0.0f;
}

// Elements offset + c .. + 3 of fp32 or bf16 activations.
__device__ __forceinline__ void load4(const void* base, bool bf16, int64_t offset, int c, int n,
                                      bool vector_loads, float (&x)[4]) {
  if (bf16)
    load4(static_cast<const uint16_t*>(base) + offset, c, n, vector_loads, x);
  else
    load4(static_cast<const float*>(base) + offset, c, n, vector_loads, x);
}

// One warp per destination row (grid-stride; the row loop is warp-uniform, so the warp sum sees every lane).
// Lane l converts columns 4l.., 4l + 128.., so a warp writes a 128-column stretch of the row at a time.
__global__ void __launch_bounds__(kStagingThreads) stage_rows_bf16_kernel(const StagingParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (kStagingThreads / 32);
  const int64_t rows = p.batch * p.heads * p.padded_tokens;
  for (int64_t row = int64_t{blockIdx.x} * (kStagingThreads / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const int64_t t = row % p.padded_tokens, bh = row / p.padded_tokens, b = bh / p.heads, h = bh % p.heads;
    const bool valid = t < p.tokens;
    const int64_t src = valid ? b * p.batch_stride + h * p.head_stride + t * p.token_stride : 0;
    const bool with_dot = p.delta != nullptr && valid;
    const int64_t dot = with_dot ? (b * p.tokens + t) * p.dot_token_stride + h * int64_t{p.head_dim} : 0;
    uint16_t* dst = p.dst + row * p.padded_dim;
    float sum = 0.0f;
    for (int c = 4 * lane; c < p.padded_dim; c += 128) {
      float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (valid) load4(p.src, p.src_bf16, src, c, p.head_dim, p.vector_loads, x);
      if (with_dot) {
        float y[4];
        load4(p.dot, p.dot_bf16, dot, c, p.head_dim, p.dot_vector_loads, y);
#pragma unroll
        for (int e = 0; e < 4; ++e) sum = fmaf(x[e], y[e], sum);
      }
      uint2 packed;
      packed.x = pack_bf16x2(x[0] * p.factor, x[1] * p.factor);
      packed.y = pack_bf16x2(x[2] * p.factor, x[3] * p.factor);
      *reinterpret_cast<uint2*>(dst + c) = packed;
    }
    if (p.delta != nullptr) {
      sum = warp_sum(sum);
      if (lane == 0) {
        p.delta[row] = sum;
        p.lse2[row] = valid ? p.lse[bh * p.tokens + t] * kLog2e : 0.0f;
      }
    }
  }
}

// ---- shared-memory tiles ----
//
// A tile holds rows of D bf16 (2D bytes) in 16-byte chunks; chunk c of row r sits at chunk c ^ (r % 8). The
// eight row addresses of one ldmatrix 8x8 matrix (same logical chunk, eight consecutive rows) then fall in
// eight different 16-byte bank groups, and so do cp.async's writes. Needs D >= 64 (eight chunks per row).

template <int D>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  static_assert(D % 64 == 0, "rows of at least eight 16-byte chunks");
  return row * (2 * D) + ((chunk ^ (row & 7)) << 4);
}

// Rows [0, kRows) of a dense bf16 matrix with rows of D elements -> tile, asynchronously (the caller
// commits).
template <int D, int kRows, int kThreads>
__device__ __forceinline__ void load_tile_async(char* tile, const uint16_t* rows) {
  constexpr int kChunks = D / 8;
  static_assert(kRows * kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    cp_async_16(tile + tile_offset<D>(row, chunk), rows + row * D + chunk * 8, true);
  }
}

// kCount floats (16-byte aligned) -> shared memory, asynchronously.
template <int kCount, int kThreads>
__device__ __forceinline__ void load_floats_async(char* shared, const float* values) {
  static_assert(kCount % 4 == 0 && kCount / 4 <= kThreads, "one 16-byte chunk per thread at most");
  if (threadIdx.x < kCount / 4) cp_async_16(shared + 16 * threadIdx.x, values + 4 * threadIdx.x, true);
}

// The address lane `lane` passes to ldmatrix for
//   a_address:  an A operand, rows row0..row0+15 x columns k0..k0+15 of the tile (ldmatrix_x4);
//   b_address:  B operands of two n-tiles n0..n0+7 and n0+8..n0+15 whose tile rows are n and columns k
//               (k0..k0+15); ldmatrix_x4 gives r[0], r[1] for the first n-tile and r[2], r[3] for the second;
//   bt_address: the same when tile rows are k (k0..k0+15) and columns n (n0..n0+15): ldmatrix_x4_trans.
template <int D>
__device__ __forceinline__ const char* a_address(const char* tile, int row0, int k0, int lane) {
  const int matrix = lane >> 3, r = lane & 7;
  return tile + tile_offset<D>(row0 + (matrix & 1) * 8 + r, (k0 >> 3) + (matrix >> 1));
}
template <int D>
__device__ __forceinline__ const char* b_address(const char* tile, int n0, int k0, int lane) {
  const int matrix = lane >> 3, r = lane & 7;
  return tile + tile_offset<D>(n0 + (matrix >> 1) * 8 + r, (k0 >> 3) + (matrix & 1));
}
template <int D>
__device__ __forceinline__ const char* bt_address(const char* tile, int k0, int n0, int lane) {
  const int matrix = lane >> 3, r = lane & 7;
  return tile + tile_offset<D>(k0 + (matrix & 1) * 8 + r, (n0 >> 3) + (matrix >> 1));
}

// The A operand of k-step kk (columns 16kk..16kk+15) taken from accumulators acc[n-tile][4] whose columns
// become k: FlashAttention-2's trick of feeding P (or dS) to the next MMA without a trip through memory.
template <int kTiles>
__device__ __forceinline__ void accumulator_to_a(const float (&acc)[kTiles][4], int kk, uint32_t (&a)[4]) {
  a[0] = pack_bf16x2(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack_bf16x2(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack_bf16x2(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack_bf16x2(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

}  // namespace forge::cuda::attention

#endif  // FORGE_KERNELS_CUDA_ATTENTION_TILES_CUH
