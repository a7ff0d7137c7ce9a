// FP8 casts on the GPU: amax, the per-tensor cast (+ transpose) with its amax, and the 1x128 / 128x128 block
// quantisations (with their transposed copies), every code and scale bitwise fp8/quantize.h's on the CPU.
//
// One kernel family does every cast that has a tile structure: a CTA of 256 threads takes a 128 x 128 tile of
// x into registers (16 float4 per thread, rows 32i + 4w + b and columns 32k + 4a + j of the tile for warp w,
// lane a + 8b), so that
//   - a row's 128 elements sit in the 8 lanes that share b: a 1x128 tile's amax is 3 shuffles away;
//   - a column's 128 elements sit in 4 lanes of each warp: a 128x1 tile's amax is 2 shuffles and a pass
//     over 8 per-warp partials in shared memory;
//   - q is written straight from registers (4 rows x 32 bytes per warp store) and q_t through a tile of
//     codes transposed in shared memory, read back along its rows (128 contiguous bytes per warp store).
// x is read from memory once per cast, as it is: fp32 in float4s or bf16 in groups of four (8 bytes), each
// bf16 widened exactly in registers, so a bf16 activation is cast without an fp32 copy and its codes are
// those of the fp32 copy. Per-tensor casts without q_t need no tile and run an element-wise kernel; amax runs
// its own reduction.
//
// Current scaling stays in stream order: amax_to reduces max |x| into device memory (a memset and one
// kernel), and the per-tensor cast that follows takes its scale from there (TensorScale): every CTA reads the
// one float and computes compute_scale's quotient itself, which costs less than a kernel between the two, and
// CTA 0 writes the scale and its inverse for the GEMM. Nothing comes back to the host.
//
// amax is kept as the integer max of |x|'s bit patterns (fp8_convert.cuh): exact, NaN-propagating, and
// independent of the order of evaluation, so the device-wide max through atomicMax on an unsigned word is
// deterministic. No floating-point atomics are used.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/fp8_convert.cuh"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::Fp8Encoding;

constexpr int kTile = 128;
static_assert(kTile == ops::kFp8BlockSize, "the block casts' tile is the FP8 block size");
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / detail::kWarpSize;
// Bytes per row of the transposed code tile: 33 words, an odd count, so the byte stores of one warp
// instruction (8 columns x 4 consecutive rows) hit 8 distinct banks and the row reads 32 distinct banks.
constexpr int kCodesPitch = kTile + 4;
constexpr int kThreads = 256;
// Grid caps; every kernel loops grid-stride, so results do not depend on them.
constexpr int64_t kMaxTileGrid = 1024;
constexpr int64_t kMaxFlatGrid = 4096;
// float4 groups each thread of a flat kernel loads before using any (memory-level parallelism).
constexpr int kUnroll = 4;

enum class TileScaling { per_tensor, tile_1x128, block_128x128 };

// Where a per-tensor cast takes its scale: the host's `scale`, or, with amax_in, the scale of the amax in
// device memory (ops::Fp8CastParams::amax_in). scaled_max = ldexp(fp8_max, -margin) comes from the host,
// computed as fp8::compute_scale computes it, so the device's quotient is the CPU's bit for bit.
struct TensorScale {
  float scale;
  const float* amax_in;
  float scaled_max;
  float* scale_out;      // optional: the scale used
  float* scale_inv_out;  // optional: its inverse
};

struct TileArgs {
  const void* x;  // float or uint16_t (bf16): the kernel's T
  int64_t rows, cols, row_blocks, col_blocks;
  uint8_t* q;
  uint8_t* q_t;
  float* scale_inv;
  float* scale_inv_t;
  TensorScale tensor_scale;  // per_tensor
  bool power_of_two;
  // Four-element loads of x (16 bytes of fp32, 8 of bf16), uint32 stores of q / q_t (shapes and alignment
  // checked on the host).
  bool vector_x, vector_q, vector_q_t;
  Fp8Encoding encoding;
  unsigned* amax;  // per_tensor, optional: the device-wide max of |x| bits
};

// Four consecutive elements of x as fp32 (one aligned load); bf16's bits are the top half of the float's.
__device__ __forceinline__ float4 load4(const float* x) { return *reinterpret_cast<const float4*>(x); }
__device__ __forceinline__ float4 load4(const uint16_t* x) {
  const uint2 u = *reinterpret_cast<const uint2*>(x);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                     __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ float load1(const float* x) { return *x; }
__device__ __forceinline__ float load1(const uint16_t* x) { return __uint_as_float(uint32_t{*x} << 16); }

__device__ __forceinline__ uint32_t pack4(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  return c0 | (c1 << 8) | (c2 << 16) | (c3 << 24);
}

// Folds one value per thread of a block of kThreads (= kTileThreads) into *amax. Every thread must call it. A
// NaN is folded as the CPU's quiet NaN, so that an amax in device memory (amax_to) is the CPU's bit for bit.
__device__ __forceinline__ void block_max_to_global(uint32_t value, unsigned* amax) {
  __shared__ uint32_t warp_max[kThreads / detail::kWarpSize];
  value = __reduce_max_sync(0xffffffffu, value);
  if (threadIdx.x % detail::kWarpSize == 0) warp_max[threadIdx.x / detail::kWarpSize] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / detail::kWarpSize; ++w) total = max(total, warp_max[w]);
    atomicMax(amax, total > detail::kFloatInfBits ? detail::kQuietNanBits : total);
  }
}

// A per-tensor cast's scale (every thread of every CTA; the amax is one float, read through the cache). CTA 0
// writes the outputs, which the caller keeps apart from amax_in, so no CTA can read a half-updated value.
__device__ __forceinline__ float resolve_scale(const TensorScale& t) {
  const float s =
      t.amax_in ? detail::scale_from_amax_bits(__float_as_uint(*t.amax_in), t.scaled_max, false) : t.scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (t.scale_out) *t.scale_out = s;
    if (t.scale_inv_out) *t.scale_inv_out = detail::inverse(s);
  }
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ x, int64_t n, bool vector, unsigned* __restrict__ amax) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t tid = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  uint32_t m = 0;
  int64_t scalar_begin = 0;
  if (vector) {
    const int64_t groups = n / 4;
    for (int64_t base = tid; base < groups; base += kUnroll * stride) {
      float4 f[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t g = base + u * stride;
        f[u] = g < groups ? load4(x + 4 * g) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        m = max(max(m, max(detail::abs_bits(f[u].x), detail::abs_bits(f[u].y))),
                max(detail::abs_bits(f[u].z), detail::abs_bits(f[u].w)));
    }
    scalar_begin = groups * 4;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) m = max(m, detail::abs_bits(load1(x + i)));
  block_max_to_global(m, amax);
}

// Per-tensor q = fp8(x * scale) over a flat array (no transpose), and the amax when asked (amax not null).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const T* __restrict__ x, int64_t n, const TensorScale tensor_scale, Fp8Encoding e,
                bool vector, uint8_t* __restrict__ q, unsigned* __restrict__ amax) {
  const float scale = resolve_scale(tensor_scale);
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t tid = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  uint32_t m = 0;
  int64_t scalar_begin = 0;
  if (vector) {
    uint32_t* q4 = reinterpret_cast<uint32_t*>(q);
    const int64_t groups = n / 4;
    for (int64_t base = tid; base < groups; base += kUnroll * stride) {
      float4 f[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t g = base + u * stride;
        f[u] = g < groups ? load4(x + 4 * g) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t g = base + u * stride;
        if (g < groups) {
          m = max(max(m, max(detail::abs_bits(f[u].x), detail::abs_bits(f[u].y))),
                  max(detail::abs_bits(f[u].z), detail::abs_bits(f[u].w)));
          q4[g] = pack4(detail::encode_product(f[u].x, scale, e), detail::encode_product(f[u].y, scale, e),
                        detail::encode_product(f[u].z, scale, e), detail::encode_product(f[u].w, scale, e));
        }
      }
    }
    scalar_begin = groups * 4;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    const float v = load1(x + i);
    m = max(m, detail::abs_bits(v));
    q[i] = static_cast<uint8_t>(detail::encode_product(v, scale, e));
  }
  if (amax) block_max_to_global(m, amax);  // the same for the whole grid: no divergent barrier
}

// The tiled casts (see the header comment). kRowwise writes q (and, for the block scalings, scale_inv);
// kColwise writes q_t (and scale_inv_t).
template <typename T, TileScaling kScaling, bool kRowwise, bool kColwise>
__global__ void __launch_bounds__(kTileThreads, 2) tile_cast_kernel(const TileArgs args) {
  constexpr bool kColumnScales = kScaling == TileScaling::tile_1x128 && kColwise;
  constexpr bool kTileScale = kScaling == TileScaling::block_128x128;
  // Shared memory is reused from tile to tile; a barrier ends every tile whose kernel uses any.
  constexpr bool kUsesShared = kColwise || kTileScale;
  // Codes of the tile transposed: byte (c, r) at c * kCodesPitch + r. Words, for the 4-byte row reads.
  __shared__ uint32_t codes_t_words[kColwise ? kTile * kCodesPitch / 4 : 1];
  __shared__ uint32_t column_partial[kColumnScales ? kTileWarps * kTile : 1];  // [warp][column] amax bits
  __shared__ float column_scale[kColumnScales ? kTile : 1];
  __shared__ uint32_t warp_max[kTileWarps];
  uint8_t* codes_t = reinterpret_cast<uint8_t*>(codes_t_words);

  const Fp8Encoding& e = args.encoding;
  const int warp = threadIdx.x / detail::kWarpSize, lane = threadIdx.x % detail::kWarpSize;
  const int a = lane & 7, b = lane >> 3;
  const int64_t rows = args.rows, cols = args.cols;
  const int64_t tiles = args.row_blocks * args.col_blocks;
  uint32_t running_amax = 0;  // per_tensor
  float tensor_scale = 1.0f;
  if constexpr (kScaling == TileScaling::per_tensor) tensor_scale = resolve_scale(args.tensor_scale);

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t rb = tile / args.col_blocks, kb = tile % args.col_blocks;
    const int64_t r0 = rb * kTile, c0 = kb * kTile;
    const int tr = static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile);
    const int tc = static_cast<int>(cols - c0 < kTile ? cols - c0 : kTile);

    // Element (i, k, j) of this thread: tile row 32i + 4*warp + b, tile column 32k + 4a + j. Elements outside
    // the valid tr x tc part read as 0, which leaves every amax unchanged and is never written out.
    float v[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 32 * i + 4 * warp + b;
      const T* src = static_cast<const T*>(args.x) + (r0 + r) * cols + c0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int c = 32 * k + 4 * a;
        if (args.vector_x) {
          // cols % 4 == 0, so tc % 4 == 0: the four columns are valid together.
          const float4 f = r < tr && c < tc ? load4(src + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          v[i][k][0] = f.x, v[i][k][1] = f.y, v[i][k][2] = f.z, v[i][k][3] = f.w;
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) v[i][k][j] = r < tr && c + j < tc ? load1(src + c + j) : 0.0f;
        }
      }
    }

    // Row-wise codes of row r (columns c .. c + 3 of group k) go to q straight from registers.
    auto store_q = [&](int i, int k, uint32_t c0_code, uint32_t c1_code, uint32_t c2_code, uint32_t c3_code) {
      const int r = 32 * i + 4 * warp + b, c = 32 * k + 4 * a;
      if (r >= tr) return;
      uint8_t* dst = args.q + (r0 + r) * cols + c0 + c;
      if (args.vector_q) {
        if (c < tc) *reinterpret_cast<uint32_t*>(dst) = pack4(c0_code, c1_code, c2_code, c3_code);
      } else {
        if (c < tc) dst[0] = static_cast<uint8_t>(c0_code);
        if (c + 1 < tc) dst[1] = static_cast<uint8_t>(c1_code);
        if (c + 2 < tc) dst[2] = static_cast<uint8_t>(c2_code);
        if (c + 3 < tc) dst[3] = static_cast<uint8_t>(c3_code);
      }
    };
    auto store_code_t = [&](int i, int k, int j, uint32_t code) {
      codes_t[(32 * k + 4 * a + j) * kCodesPitch + 32 * i + 4 * warp + b] = static_cast<uint8_t>(code);
    };

    if constexpr (kScaling == TileScaling::tile_1x128) {
      if constexpr (kRowwise) {
        // Row r's 1x128 tile: this thread's 16 values, then the 8 lanes that share b (lane bits 0..2).
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t m = 0;
#pragma unroll
          for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) m = max(m, detail::abs_bits(v[i][k][j]));
          m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
          m = max(m, __shfl_xor_sync(0xffffffffu, m, 4));
          const float s = detail::scale_from_amax_bits(m, e.max, args.power_of_two);
          const int r = 32 * i + 4 * warp + b;
          if (a == 0 && r < tr) args.scale_inv[(r0 + r) * args.col_blocks + kb] = detail::inverse(s);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            store_q(i, k, detail::encode_product(v[i][k][0], s, e), detail::encode_product(v[i][k][1], s, e),
                    detail::encode_product(v[i][k][2], s, e), detail::encode_product(v[i][k][3], s, e));
        }
      }
      if constexpr (kColwise) {
        // Column c's 128x1 tile: this thread's 4 rows, the 4 lanes that share a (lane bits 3, 4), then the 8
        // warps through shared memory.
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t m = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) m = max(m, detail::abs_bits(v[i][k][j]));
            m = max(m, __shfl_xor_sync(0xffffffffu, m, 8));
            m = max(m, __shfl_xor_sync(0xffffffffu, m, 16));
            if (b == 0) column_partial[warp * kTile + 32 * k + 4 * a + j] = m;
          }
        }
        __syncthreads();
        if (threadIdx.x < kTile) {
          const int c = threadIdx.x;
          uint32_t m = 0;
#pragma unroll
          for (int w = 0; w < kTileWarps; ++w) m = max(m, column_partial[w * kTile + c]);
          const float s = detail::scale_from_amax_bits(m, e.max, args.power_of_two);
          column_scale[c] = s;
          if (c < tc) args.scale_inv_t[(c0 + c) * args.row_blocks + rb] = detail::inverse(s);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float s = column_scale[32 * k + 4 * a + j];
#pragma unroll
            for (int i = 0; i < 4; ++i) store_code_t(i, k, j, detail::encode_product(v[i][k][j], s, e));
          }
        }
      }
    } else {
      // One scale for the whole tile: the per-tensor scale, or the 128x128 block's.
      float s = tensor_scale;
      if constexpr (kTileScale) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) m = max(m, detail::abs_bits(v[i][k][j]));
        m = __reduce_max_sync(0xffffffffu, m);
        if (lane == 0) warp_max[warp] = m;
        __syncthreads();
        m = 0;
#pragma unroll
        for (int w = 0; w < kTileWarps; ++w) m = max(m, warp_max[w]);
        s = detail::scale_from_amax_bits(m, e.max, args.power_of_two);
        if (threadIdx.x == 0) {
          const float inv = detail::inverse(s);
          args.scale_inv[rb * args.col_blocks + kb] = inv;
          if constexpr (kColwise) args.scale_inv_t[kb * args.row_blocks + rb] = inv;
        }
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) running_amax = max(running_amax, detail::abs_bits(v[i][k][j]));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          uint32_t code[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            code[j] = detail::encode_product(v[i][k][j], s, e);
            if constexpr (kColwise) store_code_t(i, k, j, code[j]);
          }
          if constexpr (kRowwise) store_q(i, k, code[0], code[1], code[2], code[3]);
        }
      }
    }

    if constexpr (kColwise) {
      __syncthreads();
      // Tile column c is q_t's row c0 + c, rows r0 .. r0 + tr - 1 of x: warp w writes columns w, w + 8, ...
      for (int c = warp; c < tc; c += kTileWarps) {
        uint8_t* dst = args.q_t + (c0 + c) * rows + r0;
        if (args.vector_q_t) {
          // rows % 4 == 0, so tr % 4 == 0: a word is valid as a whole.
          if (4 * lane < tr)
            *reinterpret_cast<uint32_t*>(dst + 4 * lane) = codes_t_words[c * (kCodesPitch / 4) + lane];
        } else {
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const int r = lane + 32 * s;
            if (r < tr) dst[r] = codes_t[c * kCodesPitch + r];
          }
        }
      }
    }
    if constexpr (kUsesShared) __syncthreads();
  }

  if constexpr (kScaling == TileScaling::per_tensor)
    if (args.amax) block_max_to_global(running_amax, args.amax);  // uniform over the grid
}

// ---- host side ----

// The sign of the host CPU's default NaN (inf * 0: negative on x86, positive on Arm), which the CPU's casts
// encode for such products; the device reproduces it (fp8_convert.cuh).
uint32_t host_default_nan_sign() {
  static const uint32_t sign = [] {
    volatile float inf = std::numeric_limits<float>::infinity(), zero = 0.0f;
    const float nan = inf * zero;
    uint32_t bits;
    std::memcpy(&bits, &nan, sizeof bits);
    return (bits >> 24) & 0x80u;
  }();
  return sign;
}

Fp8Encoding encoding_for(DType fp8) {
  return fp8 == DType::e4m3 ? detail::e4m3_encoding(host_default_nan_sign())
                            : detail::e5m2_encoding(host_default_nan_sign());
}

float amax_from_bits(uint32_t bits) {
  if (bits > detail::kFloatInfBits) return std::numeric_limits<float>::quiet_NaN();
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

bool aligned(const void* pointer, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

// Whether x can be read four elements at a time (16 bytes of fp32, 8 of bf16).
bool aligned4(ConstElements x) { return aligned(x.get(), 4 * dtype_size(x.dtype())); }

// Checks shared by every cast's predicate, after its outputs'.
bool cast_ok(const char* op, const ops::Fp8CastParams& p, std::string* reason) {
  using detail::refuse;
  if (p.fp8 != DType::e4m3 && p.fp8 != DType::e5m2)
    return refuse(reason, op,
                  std::string(dtype_name(p.fp8)) + " is not an FP8 dtype (expected fp8_e4m3 or fp8_e5m2)");
  if (p.rows < 0 || p.cols < 0)
    return refuse(reason, op,
                  "negative shape [" + std::to_string(p.rows) + ", " + std::to_string(p.cols) + "]");
  if (p.cols > 0 && p.rows > INT64_MAX / p.cols)
    return refuse(reason, op,
                  "shape [" + std::to_string(p.rows) + ", " + std::to_string(p.cols) + "] is too large");
  return p.rows == 0 || p.cols == 0 || detail::pointer_set(p.x, op, "x", reason);
}

TensorScale tensor_scale(const ops::Fp8CastParams& p) {
  TensorScale t{};
  t.scale = p.scale;
  t.amax_in = p.amax_in;
  // fp8::compute_scale's first step, in the same float arithmetic (encoding max = fp8::fp8_max).
  t.scaled_max = std::ldexp(encoding_for(p.fp8).max, -p.margin);
  t.scale_out = p.scale_out, t.scale_inv_out = p.scale_inv_out;
  return t;
}

TileArgs tile_args(const ops::Fp8CastParams& p) {
  TileArgs t{};
  t.x = p.x.get();
  t.rows = p.rows, t.cols = p.cols;
  t.row_blocks = (p.rows + kTile - 1) / kTile, t.col_blocks = (p.cols + kTile - 1) / kTile;
  t.q = p.q, t.q_t = p.q_t, t.scale_inv = p.scale_inv, t.scale_inv_t = p.scale_inv_t;
  t.tensor_scale = tensor_scale(p);
  t.power_of_two = p.power_of_two_scales;
  t.vector_x = aligned4(p.x) && p.cols % 4 == 0;
  t.vector_q = aligned(p.q, 4) && p.cols % 4 == 0;
  t.vector_q_t = aligned(p.q_t, 4) && p.rows % 4 == 0;
  t.encoding = encoding_for(p.fp8);
  t.amax = nullptr;
  return t;
}

template <TileScaling kScaling, bool kRowwise, bool kColwise>
void launch_tiles(const TileArgs& t, DType x_dtype, const char* op) {
  const int64_t tiles = t.row_blocks * t.col_blocks;
  const auto grid = static_cast<unsigned>(tiles < kMaxTileGrid ? tiles : kMaxTileGrid);
  if (x_dtype == DType::bf16)
    tile_cast_kernel<uint16_t, kScaling, kRowwise, kColwise><<<grid, kTileThreads, 0, stream()>>>(t);
  else
    tile_cast_kernel<float, kScaling, kRowwise, kColwise><<<grid, kTileThreads, 0, stream()>>>(t);
  FORGE_CUDA_CHECK_LAUNCH(op);
}

// A zeroed word for a device-wide amax, then the amax read back (the one synchronisation of the call).
class DeviceAmax {
 public:
  DeviceAmax() : scratch_(sizeof(unsigned)) {
    FORGE_CUDA_CHECK(cudaMemsetAsync(scratch_.as<unsigned>(), 0, sizeof(unsigned), stream()));
  }
  unsigned* word() const { return scratch_.as<unsigned>(); }
  float read() const {
    uint32_t bits = 0;
    FORGE_CUDA_CHECK(cudaMemcpyAsync(&bits, word(), sizeof bits, cudaMemcpyDeviceToHost, stream()));
    synchronize();
    return amax_from_bits(bits);
  }

 private:
  detail::StreamScratch scratch_;
};

// Folds max |x| bits into *word (zeroed by the caller); n > 0.
void launch_amax(const char* op, ConstElements x, int64_t n, unsigned* word) {
  const bool vector = aligned4(x);
  const unsigned grid = detail::grid_blocks((n + 3) / 4, kThreads * kUnroll, kMaxFlatGrid);
  visit(x, [&](const auto* typed) { amax_kernel<<<grid, kThreads, 0, stream()>>>(typed, n, vector, word); });
  FORGE_CUDA_CHECK_LAUNCH(op);
}

}  // namespace

bool supports_amax(const float* x, int64_t n, std::string* reason) {
  if (n < 0) return detail::refuse(reason, "amax", "negative size " + std::to_string(n));
  return n == 0 || detail::pointer_set(x, "amax", "x", reason);
}

bool supports_amax_to(ConstElements x, int64_t n, float* out, std::string* reason) {
  constexpr const char* op = "amax_to";
  if (n < 0) return detail::refuse(reason, op, "negative size " + std::to_string(n));
  return detail::pointer_set(out, op, "out", reason) && (n == 0 || detail::pointer_set(x, op, "x", reason));
}

bool supports_fp8_cast_transpose(const ops::Fp8CastParams& p, std::string* reason) {
  constexpr const char* op = "fp8_cast_transpose";
  if (!p.q && !p.q_t) return detail::refuse(reason, op, "neither q nor q_t is given");
  if (!cast_ok(op, p, reason)) return false;
  if (p.amax_in && p.margin < 0)
    return detail::refuse(reason, op, "negative margin " + std::to_string(p.margin));
  return true;
}

bool supports_fp8_quantize_1x128(const ops::Fp8CastParams& p, std::string* reason) {
  constexpr const char* op = "fp8_quantize_1x128";
  if (!p.q && !p.q_t) return detail::refuse(reason, op, "neither q nor q_t is given");
  if (p.q && !p.scale_inv) return detail::refuse(reason, op, "q is given without scale_inv");
  if (p.q_t && !p.scale_inv_t) return detail::refuse(reason, op, "q_t is given without scale_inv_t");
  return cast_ok(op, p, reason);
}

bool supports_fp8_quantize_128x128(const ops::Fp8CastParams& p, std::string* reason) {
  constexpr const char* op = "fp8_quantize_128x128";
  if (!p.q) return detail::refuse(reason, op, "q (the row-wise output) is null");
  if (!p.scale_inv) return detail::refuse(reason, op, "scale_inv is null");
  if (p.q_t && !p.scale_inv_t) return detail::refuse(reason, op, "q_t is given without scale_inv_t");
  return cast_ok(op, p, reason);
}

float amax(const float* x, int64_t n) {
  if (std::string why; !supports_amax(x, n, &why)) fail_message(why);
  if (n == 0) return 0.0f;
  const DeviceAmax result;
  launch_amax("amax", x, n, result.word());
  return result.read();
}

void amax_to(ConstElements x, int64_t n, float* out) {
  constexpr const char* op = "amax_to";
  if (std::string why; !supports_amax_to(x, n, out, &why)) fail_message(why);
  // out becomes the word the kernel max-reduces into: +0's bits, then the max of |x|'s bits, which read as a
  // float are max |x| (a NaN when some |x| is one).
  FORGE_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), stream()));
  if (n > 0) launch_amax(op, x, n, reinterpret_cast<unsigned*>(out));
}

float fp8_cast_transpose(const ops::Fp8CastParams& p) {
  constexpr const char* op = "fp8_cast_transpose";
  if (std::string why; !supports_fp8_cast_transpose(p, &why)) fail_message(why);
  const int64_t n = p.rows * p.cols;
  const bool scale_outputs = p.scale_out || p.scale_inv_out;
  if (n == 0 && !scale_outputs) return 0.0f;
  // The amax goes into the accumulator, a float >= 0 or NaN that compares as the bits of |x| do (NaN's above
  // inf's), so the kernels' integer max folds straight into it; or into a scratch word read back (a host
  // scale and no accumulator: the one synchronisation); or nowhere (a device scale: the caller has the amax).
  std::optional<DeviceAmax> result;
  unsigned* amax_word = nullptr;
  if (p.amax_accumulate)
    amax_word = reinterpret_cast<unsigned*>(p.amax_accumulate);
  else if (!p.amax_in && n > 0)
    amax_word = result.emplace().word();
  if (!p.q_t || n == 0) {
    // Row-major q alone is an element-wise cast of the flat array (an empty one still writes the scale).
    const bool vector = aligned4(p.x) && aligned(p.q, 4);
    const unsigned grid = detail::grid_blocks((n + 3) / 4, kThreads * kUnroll, kMaxFlatGrid);
    const TensorScale scale = tensor_scale(p);
    const Fp8Encoding encoding = encoding_for(p.fp8);
    visit(p.x, [&](const auto* x) {
      cast_kernel<<<grid, kThreads, 0, stream()>>>(x, n, scale, encoding, vector, p.q, amax_word);
    });
    FORGE_CUDA_CHECK_LAUNCH(op);
  } else {
    TileArgs t = tile_args(p);
    t.amax = amax_word;
    if (p.q)
      launch_tiles<TileScaling::per_tensor, true, true>(t, p.x.dtype(), op);
    else
      launch_tiles<TileScaling::per_tensor, false, true>(t, p.x.dtype(), op);
  }
  return result ? result->read() : 0.0f;
}

void fp8_quantize_1x128(const ops::Fp8CastParams& p) {
  constexpr const char* op = "fp8_quantize_1x128";
  if (std::string why; !supports_fp8_quantize_1x128(p, &why)) fail_message(why);
  if (p.rows == 0 || p.cols == 0) return;
  const TileArgs t = tile_args(p);
  if (p.q && p.q_t)
    launch_tiles<TileScaling::tile_1x128, true, true>(t, p.x.dtype(), op);
  else if (p.q)
    launch_tiles<TileScaling::tile_1x128, true, false>(t, p.x.dtype(), op);
  else
    launch_tiles<TileScaling::tile_1x128, false, true>(t, p.x.dtype(), op);
}

void fp8_quantize_128x128(const ops::Fp8CastParams& p) {
  constexpr const char* op = "fp8_quantize_128x128";
  if (std::string why; !supports_fp8_quantize_128x128(p, &why)) fail_message(why);
  if (p.rows == 0 || p.cols == 0) return;
  const TileArgs t = tile_args(p);
  if (p.q_t)
    launch_tiles<TileScaling::block_128x128, true, true>(t, p.x.dtype(), op);
  else
    launch_tiles<TileScaling::block_128x128, true, false>(t, p.x.dtype(), op);
}

}  // namespace forge::cuda
