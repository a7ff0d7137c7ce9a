// Every kernel here stages x * scale for a cache-sized piece of the input in a small fp32 buffer and hands
// it to core's bulk FP8 conversion, so the rounding is the one tested exhaustively in tests/core and the
// staging loop (multiply and amax) vectorises. amax is kept as the max of the |x| bit patterns: for
// non-negative floats the integer order is the numeric order, and every NaN pattern is above inf, so one
// integer max gives both the amax and NaN propagation, independent of the order of evaluation.
#include "forge/fp8/quantize.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "forge/core/error.h"
#include "forge/fp8/scaling.h"

namespace forge::fp8 {
namespace {

// Elements staged at a time (32 KiB of fp32, L1-sized).
constexpr int64_t kChunk = 8192;
// Cast + transpose tile: 64 x 64 elements, so each transposed row segment is one 64-byte cache line.
constexpr int64_t kTransposeTile = 64;
// Rows of a 128-wide tile staged at a time by the block kernels (kBlockRows x 128 = 4096 elements).
constexpr int64_t kBlockRows = 32;
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t{1} << 16;

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

inline uint32_t abs_bits(float x) { return std::bit_cast<uint32_t>(x) & kAbsMask; }

inline float amax_from_bits(uint32_t bits) {
  return bits > kInfBits ? std::numeric_limits<float>::quiet_NaN() : std::bit_cast<float>(bits);
}

void check_args(const char* who, DType fp8, int64_t rows, int64_t cols) {
  if (fp8 != DType::e4m3 && fp8 != DType::e5m2)
    fail("fp8::{}: {} is not an FP8 dtype (expected fp8_e4m3 or fp8_e5m2)", who, dtype_name(fp8));
  if (rows < 0 || cols < 0) fail("fp8::{}: negative shape [{}, {}]", who, rows, cols);
}

// q = fp8(staged), staged already multiplied by its scale.
inline void encode(const float* staged, uint8_t* q, int64_t n, DType fp8) {
  if (fp8 == DType::e4m3)
    convert_f32_to_e4m3(staged, q, static_cast<size_t>(n));
  else
    convert_f32_to_e5m2(staged, q, static_cast<size_t>(n));
}

inline void decode(const uint8_t* q, float* x, int64_t n, DType fp8) {
  if (fp8 == DType::e4m3)
    convert_e4m3_to_f32(q, x, static_cast<size_t>(n));
  else
    convert_e5m2_to_f32(q, x, static_cast<size_t>(n));
}

// One element of an fp32 or bf16 input as fp32 (a bf16 widens exactly: its bits are the float's top half).
inline float load(const float* x, int64_t i) { return x[i]; }
inline float load(const uint16_t* x, int64_t i) { return bf16_to_float(x[i]); }

// staged[i] = x[i] * scale; returns max(bits, max |x[i]| bits).
template <typename T>
inline uint32_t stage(const T* __restrict x, int64_t n, float scale, float* __restrict staged,
                      uint32_t bits) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(x, i);
    bits = std::max(bits, abs_bits(v));
    staged[i] = v * scale;
  }
  return bits;
}

template <typename T>
inline uint32_t amax_bits(const T* __restrict x, int64_t n) {
  uint32_t bits = 0;
  for (int64_t i = 0; i < n; ++i) bits = std::max(bits, abs_bits(load(x, i)));
  return bits;
}

inline void scale_in_place(float* __restrict x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// The scale of one block from its amax bits: fp8_max / amax, 1 for an empty, zero or non-finite block.
inline float block_scale(uint32_t bits, float max, bool power_of_two) {
  return compute_scale(amax_from_bits(bits), max, 0, 1.0f, power_of_two);
}

template <typename T>
float compute_amax_of(const T* x, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  uint32_t bits = 0;
#pragma omp parallel for schedule(static) reduction(max : bits) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    bits = std::max(bits, amax_bits(x + begin, std::min(kChunk, n - begin)));
  }
  return amax_from_bits(bits);
}

template <typename T>
float quantize_of(const T* x, int64_t n, float scale, DType fp8, uint8_t* q) {
  check_args("quantize", fp8, 1, n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  uint32_t bits = 0;
#pragma omp parallel for schedule(static) reduction(max : bits) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    alignas(64) float staged[kChunk];
    const int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
    bits = stage(x + begin, len, scale, staged, bits);
    encode(staged, q + begin, len, fp8);
  }
  return amax_from_bits(bits);
}

template <typename T>
float cast_transpose_of(const T* x, int64_t rows, int64_t cols, float scale, DType fp8, uint8_t* q_rowwise,
                        uint8_t* q_colwise) {
  check_args("cast_transpose", fp8, rows, cols);
  const int64_t row_tiles = (rows + kTransposeTile - 1) / kTransposeTile;
  const int64_t col_tiles = (cols + kTransposeTile - 1) / kTransposeTile;
  uint32_t bits = 0;
#pragma omp parallel for collapse(2) schedule(static) reduction(max : bits) if (rows * cols >= kParallelMin)
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      alignas(64) float staged[kTransposeTile * kTransposeTile];
      alignas(64) uint8_t tile[kTransposeTile * kTransposeTile];
      const int64_t r0 = rt * kTransposeTile, c0 = ct * kTransposeTile;
      const int64_t tr = std::min(kTransposeTile, rows - r0), tc = std::min(kTransposeTile, cols - c0);
      // Staged and tile are packed [tr][tc].
      for (int64_t r = 0; r < tr; ++r)
        bits = stage(x + (r0 + r) * cols + c0, tc, scale, staged + r * tc, bits);
      encode(staged, tile, tr * tc, fp8);
      for (int64_t r = 0; r < tr; ++r) std::memcpy(q_rowwise + (r0 + r) * cols + c0, tile + r * tc, tc);
      for (int64_t c = 0; c < tc; ++c) {
        uint8_t* out = q_colwise + (c0 + c) * rows + r0;
        for (int64_t r = 0; r < tr; ++r) out[r] = tile[r * tc + c];
      }
    }
  }
  return amax_from_bits(bits);
}

template <typename T>
void quantize_1x128_of(const T* x, int64_t rows, int64_t cols, DType fp8, bool power_of_two_scales,
                       uint8_t* q, float* scale_inv) {
  check_args("quantize_1x128", fp8, rows, cols);
  if (rows == 0 || cols == 0) return;
  const float max = fp8_max(fp8);
  const int64_t k_blocks = num_blocks(cols);
  // Short rows are staged several at a time (one conversion call per kChunk elements, not per row); long
  // rows in segments of kChunk, a multiple of the tile, so that a segment never splits a tile.
  const int64_t group = std::max<int64_t>(1, kChunk / cols), groups = (rows + group - 1) / group;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t g = 0; g < groups; ++g) {
    alignas(64) float staged[kChunk];
    const int64_t r0 = g * group, r1 = std::min(rows, r0 + group);
    for (int64_t seg = 0; seg < cols; seg += kChunk) {
      const int64_t seg_len = std::min(kChunk, cols - seg);
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = x + r * cols + seg;
        float* sr = staged + (r - r0) * seg_len;
        for (int64_t t = 0; t < seg_len; t += kBlockTile) {
          const int64_t len = std::min(kBlockTile, seg_len - t);
          const float scale = block_scale(amax_bits(xr + t, len), max, power_of_two_scales);
          scale_inv[r * k_blocks + (seg + t) / kBlockTile] = 1.0f / scale;
          stage(xr + t, len, scale, sr + t, 0);
        }
      }
      if (seg_len == cols) {
        encode(staged, q + r0 * cols, (r1 - r0) * cols, fp8);  // whole rows: contiguous in q
      } else {
        encode(staged, q + r0 * cols + seg, seg_len, fp8);  // group == 1
      }
    }
  }
}

template <typename T>
void quantize_1x128_transposed_of(const T* x, int64_t rows, int64_t cols, DType fp8, bool power_of_two_scales,
                                  uint8_t* q_t, float* scale_inv_t) {
  check_args("quantize_1x128_transposed", fp8, rows, cols);
  const float max = fp8_max(fp8);
  const int64_t k_blocks = num_blocks(rows);
  // A tile is 128 rows of x by kBlockRows columns, staged transposed: staged[c][r].
  const int64_t col_tiles = (cols + kBlockRows - 1) / kBlockRows;
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      alignas(64) float staged[kBlockRows * kBlockTile];
      alignas(64) uint8_t tile[kBlockRows * kBlockTile];
      const int64_t r0 = kb * kBlockTile, c0 = ct * kBlockRows;
      const int64_t tr = std::min(kBlockTile, rows - r0), tc = std::min(kBlockRows, cols - c0);
      for (int64_t r = 0; r < tr; ++r) {
        const T* xr = x + (r0 + r) * cols + c0;
        for (int64_t c = 0; c < tc; ++c) staged[c * tr + r] = load(xr, c);
      }
      for (int64_t c = 0; c < tc; ++c) {
        float* column = staged + c * tr;
        const float scale = block_scale(amax_bits(column, tr), max, power_of_two_scales);
        scale_inv_t[(c0 + c) * k_blocks + kb] = 1.0f / scale;
        scale_in_place(column, tr, scale);
      }
      encode(staged, tile, tr * tc, fp8);
      for (int64_t c = 0; c < tc; ++c) std::memcpy(q_t + (c0 + c) * rows + r0, tile + c * tr, tr);
    }
  }
}

template <typename T>
void quantize_1x128_with_transpose_of(const T* x, int64_t rows, int64_t cols, DType fp8,
                                      bool power_of_two_scales, uint8_t* q, float* scale_inv, uint8_t* q_t,
                                      float* scale_inv_t) {
  check_args("quantize_1x128_with_transpose", fp8, rows, cols);
  const float max = fp8_max(fp8);
  const int64_t row_blocks = num_blocks(rows), col_blocks = num_blocks(cols);
  // One 128 x 128 tile of x at a time (64 KiB, L2-resident): its rows are 1x128 tiles of x, its columns
  // 1x128 tiles of x^T, so both quantisations and all their amaxes come from one read of x from memory.
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t kb = 0; kb < col_blocks; ++kb) {
      alignas(64) float staged[kBlockRows * kBlockTile];
      alignas(64) uint8_t tile[kBlockRows * kBlockTile];
      uint32_t column_bits[kBlockTile] = {};
      const int64_t r0 = rb * kBlockTile, c0 = kb * kBlockTile;
      const int64_t tr = std::min(kBlockTile, rows - r0), tc = std::min(kBlockTile, cols - c0);
      // Row-wise: each row of the tile is one 1x128 tile of x; the column amaxes are gathered on the way.
      for (int64_t s = 0; s < tr; s += kBlockRows) {
        const int64_t sr = std::min(kBlockRows, tr - s);
        for (int64_t r = 0; r < sr; ++r) {
          const T* xr = x + (r0 + s + r) * cols + c0;
          for (int64_t c = 0; c < tc; ++c) column_bits[c] = std::max(column_bits[c], abs_bits(load(xr, c)));
          const float scale = block_scale(amax_bits(xr, tc), max, power_of_two_scales);
          scale_inv[(r0 + s + r) * col_blocks + kb] = 1.0f / scale;
          stage(xr, tc, scale, staged + r * tc, 0);
        }
        encode(staged, tile, sr * tc, fp8);
        for (int64_t r = 0; r < sr; ++r) std::memcpy(q + (r0 + s + r) * cols + c0, tile + r * tc, tc);
      }
      // Column-wise: kBlockRows columns at a time, staged transposed (staged[c][r]).
      for (int64_t s = 0; s < tc; s += kBlockRows) {
        const int64_t sc = std::min(kBlockRows, tc - s);
        float scales[kBlockRows];
        for (int64_t c = 0; c < sc; ++c) {
          scales[c] = block_scale(column_bits[s + c], max, power_of_two_scales);
          scale_inv_t[(c0 + s + c) * row_blocks + rb] = 1.0f / scales[c];
        }
        for (int64_t r = 0; r < tr; ++r) {
          const T* xr = x + (r0 + r) * cols + c0 + s;
          for (int64_t c = 0; c < sc; ++c) staged[c * tr + r] = load(xr, c) * scales[c];
        }
        encode(staged, tile, tr * sc, fp8);
        for (int64_t c = 0; c < sc; ++c) std::memcpy(q_t + (c0 + s + c) * rows + r0, tile + c * tr, tr);
      }
    }
  }
}

template <typename T>
void quantize_128x128_of(const T* x, int64_t rows, int64_t cols, DType fp8, bool power_of_two_scales,
                         uint8_t* q, float* scale_inv, uint8_t* q_transposed, float* scale_inv_transposed) {
  check_args("quantize_128x128", fp8, rows, cols);
  const float max = fp8_max(fp8);
  const int64_t row_blocks = num_blocks(rows), k_blocks = num_blocks(cols);
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      alignas(64) float staged[kBlockRows * kBlockTile];
      alignas(64) uint8_t tile[kBlockRows * kBlockTile];
      const int64_t r0 = rb * kBlockTile, c0 = kb * kBlockTile;
      const int64_t tr = std::min(kBlockTile, rows - r0), tc = std::min(kBlockTile, cols - c0);
      uint32_t bits = 0;
      for (int64_t r = 0; r < tr; ++r) bits = std::max(bits, amax_bits(x + (r0 + r) * cols + c0, tc));
      const float scale = block_scale(bits, max, power_of_two_scales);
      scale_inv[rb * k_blocks + kb] = 1.0f / scale;
      if (scale_inv_transposed) scale_inv_transposed[kb * row_blocks + rb] = 1.0f / scale;
      // The block is 64 KiB of fp32: stage it kBlockRows rows at a time, packed [rows][tc].
      for (int64_t s = 0; s < tr; s += kBlockRows) {
        const int64_t sr = std::min(kBlockRows, tr - s);
        for (int64_t r = 0; r < sr; ++r) stage(x + (r0 + s + r) * cols + c0, tc, scale, staged + r * tc, 0);
        encode(staged, tile, sr * tc, fp8);
        for (int64_t r = 0; r < sr; ++r) std::memcpy(q + (r0 + s + r) * cols + c0, tile + r * tc, tc);
        if (q_transposed) {
          for (int64_t c = 0; c < tc; ++c) {
            uint8_t* out = q_transposed + (c0 + c) * rows + r0 + s;
            for (int64_t r = 0; r < sr; ++r) out[r] = tile[r * tc + c];
          }
        }
      }
    }
  }
}

}  // namespace

float compute_amax(ConstElements x, int64_t n) {
  float amax = 0.0f;
  visit(x, [&](const auto* p) { amax = compute_amax_of(p, n); });
  return amax;
}

float quantize(ConstElements x, int64_t n, float scale, DType fp8, uint8_t* q) {
  float amax = 0.0f;
  visit(x, [&](const auto* p) { amax = quantize_of(p, n, scale, fp8, q); });
  return amax;
}

float cast_transpose(ConstElements x, int64_t rows, int64_t cols, float scale, DType fp8, uint8_t* q_rowwise,
                     uint8_t* q_colwise) {
  float amax = 0.0f;
  visit(x, [&](const auto* p) { amax = cast_transpose_of(p, rows, cols, scale, fp8, q_rowwise, q_colwise); });
  return amax;
}

void quantize_1x128(ConstElements x, int64_t rows, int64_t cols, DType fp8, bool power_of_two_scales,
                    uint8_t* q, float* scale_inv) {
  visit(x, [&](const auto* p) { quantize_1x128_of(p, rows, cols, fp8, power_of_two_scales, q, scale_inv); });
}

void quantize_1x128_transposed(ConstElements x, int64_t rows, int64_t cols, DType fp8,
                               bool power_of_two_scales, uint8_t* q_t, float* scale_inv_t) {
  visit(x, [&](const auto* p) {
    quantize_1x128_transposed_of(p, rows, cols, fp8, power_of_two_scales, q_t, scale_inv_t);
  });
}

void quantize_1x128_with_transpose(ConstElements x, int64_t rows, int64_t cols, DType fp8,
                                   bool power_of_two_scales, uint8_t* q, float* scale_inv, uint8_t* q_t,
                                   float* scale_inv_t) {
  visit(x, [&](const auto* p) {
    quantize_1x128_with_transpose_of(p, rows, cols, fp8, power_of_two_scales, q, scale_inv, q_t, scale_inv_t);
  });
}

void quantize_128x128(ConstElements x, int64_t rows, int64_t cols, DType fp8, bool power_of_two_scales,
                      uint8_t* q, float* scale_inv, uint8_t* q_transposed, float* scale_inv_transposed) {
  visit(x, [&](const auto* p) {
    quantize_128x128_of(p, rows, cols, fp8, power_of_two_scales, q, scale_inv, q_transposed,
                        scale_inv_transposed);
  });
}

void dequantize(const uint8_t* q, int64_t n, float scale_inv, DType fp8, float* x) {
  check_args("dequantize", fp8, 1, n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
    decode(q + begin, x + begin, len, fp8);
    scale_in_place(x + begin, len, scale_inv);
  }
}

void dequantize_1x128(const uint8_t* q, int64_t rows, int64_t cols, const float* scale_inv, DType fp8,
                      float* x) {
  check_args("dequantize_1x128", fp8, rows, cols);
  const int64_t k_blocks = num_blocks(cols);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    decode(q + r * cols, x + r * cols, cols, fp8);
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const int64_t c0 = kb * kBlockTile;
      scale_in_place(x + r * cols + c0, std::min(kBlockTile, cols - c0), scale_inv[r * k_blocks + kb]);
    }
  }
}

void dequantize_128x128(const uint8_t* q, int64_t rows, int64_t cols, const float* scale_inv, DType fp8,
                        float* x) {
  check_args("dequantize_128x128", fp8, rows, cols);
  const int64_t k_blocks = num_blocks(cols);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    decode(q + r * cols, x + r * cols, cols, fp8);
    const float* row_scales = scale_inv + (r / kBlockTile) * k_blocks;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const int64_t c0 = kb * kBlockTile;
      scale_in_place(x + r * cols + c0, std::min(kBlockTile, cols - c0), row_scales[kb]);
    }
  }
}

}  // namespace forge::fp8
