// The FP8 casts (ops::fp8_cast_transpose, fp8_quantize_1x128, fp8_quantize_128x128), written once for every
// backend (op_harness.h). FP8 conversion and block scales are exact functions of their inputs, so there is no
// tolerance to reason about: on every backend every code, every scale_inv and the returned amax must be those
// of the CPU table (fp8/quantize.h, whose functions it runs; tests/fp8/quantize_test.cpp checks them) run on
// plain aligned host arrays, bitwise. On the CPU that holds its kernels to the same bits through unaligned
// pointers and shows any write outside its outputs; elsewhere it compares that backend's kernels with the
// CPU's. Inputs are built to hit the edges: ragged shapes (partial tiles on both axes, sizes that rule out
// vector loads), values with few mantissa bits so that power-of-two scales put many products exactly on FP8
// rounding ties, FP8 subnormal and saturating products, fp32 subnormal inputs (an all-subnormal tile's scale
// overflows to FLT_MAX), NaN of both signs, +-inf, -0 and all-zero tiles. Outputs sit between guard bytes
// filled with a sentinel: an element a backend fails to write or a write out of bounds both show up. A bf16 x
// (the activations of a bf16 run) is read as it is: its codes, scales and amax must be the CPU table's on the
// fp32 copy of the same values, bitwise (every bf16 is an fp32). The amax
// alone (ops::amax) is an element-wise op test (op_tests/elementwise.h); casts whose scale comes from an amax
// in memory are in op_tests/fp8_current_scaling.h.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "kernels/cuda/bitwise_compare.h"
#include "op_harness.h"

namespace forge::op_tests::fp8_cast {

using testing::DeviceArray;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kTile = ops::kFp8BlockSize;
// Bytes on each side of every device output that the kernels must leave alone.
constexpr size_t kGuard = 64;

inline int64_t blocks(int64_t n) { return (n + kTile - 1) / kTile; }

inline std::string shape_name(int64_t rows, int64_t cols) {
  std::ostringstream out;
  out << "[" << rows << ", " << cols << "]";
  return out.str();
}

// A cheap deterministic generator (inputs reach 17M elements; mt19937 would dominate the test time).
struct Random {
  uint64_t state;
  explicit Random(uint64_t seed) : state(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint32_t next() {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return static_cast<uint32_t>(state >> 16);
  }
};

// x [rows, cols]: +-(1 + m/64) * 2^e, six fraction bits (products with a power-of-two scale land exactly on
// E4M3 / E5M2 ties for 1/8 resp. 1/4 of the values), e in [-6, 6] shifted by up to +-8 per 128x128 block so
// that block scales differ. With `specials`: NaN of both signs, +-inf, -0, near-FLT_MAX, an all-zero row
// tile, column tile and 128x128 block, and a row tile of fp32 subnormals (its amax is subnormal: scale
// FLT_MAX or 2^127, products in FP8 range).
inline std::vector<float> make_input(int64_t rows, int64_t cols, uint64_t seed, bool specials = true,
                                     bool nan = true) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  Random random(seed);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t bits = random.next();
      const int block_shift = static_cast<int>((r / kTile * 7 + c / kTile * 13) % 17) - 8;
      const int exponent = static_cast<int>(bits % 13) - 6 + block_shift;  // normal: [-14, 14]
      x[r * cols + c] = std::bit_cast<float>(((bits >> 20) & 1u) << 31 | uint32_t(127 + exponent) << 23 |
                                             ((bits >> 8) % 64) << 17);
    }
  }
  if (!specials || rows * cols == 0) return x;
  auto at = [&](int64_t r, int64_t c) -> float& {
    return x[std::min(r, rows - 1) * cols + std::min(c, cols - 1)];
  };
  const int64_t row_tile = std::min(cols, kTile), column_tile = std::min(rows, kTile);
  for (int64_t c = 0; c < row_tile; ++c) at(1, c) = 0.0f;     // a zero 1x128 tile of q
  for (int64_t r = 0; r < column_tile; ++r) at(r, 3) = 0.0f;  // a zero 128x1 tile of q_t
  for (int64_t c = 0; c < row_tile; ++c) {                    // a subnormal 1x128 tile
    const uint32_t bits = random.next();
    at(2, c) = std::bit_cast<float>((bits & 0x807fffffu) | 1u);  // sign and mantissa random, exponent 0
  }
  if (rows > kTile && cols > kTile)
    for (int64_t r = kTile; r < std::min(rows, 2 * kTile); ++r)
      for (int64_t c = kTile; c < std::min(cols, 2 * kTile); ++c) x[r * cols + c] = 0.0f;  // zero block
  at(rows / 3, 0) = -kInf;
  at(rows - 1, cols - 1) = kInf;
  at(4, cols / 2) = -0.0f;
  at(rows - 1, 0) = 3e38f;
  if (nan) {
    at(5, 7) = kNaN;
    at(rows / 2, cols / 2) = std::bit_cast<float>(0xffc00001u);  // negative NaN with a payload
    at(rows / 2 + 1, 1) = std::bit_cast<float>(0x7f800001u);     // signalling NaN
  }
  return x;
}

// An output of n elements of T on a device with kGuard sentinel bytes before and after, at a byte offset
// (0 for aligned; a few bytes to force the kernels' scalar paths).
template <typename T>
class GuardedOutput {
 public:
  GuardedOutput(Device on, size_t n, uint8_t sentinel, size_t offset = 0)
      : n_(n),
        offset_(offset),
        sentinel_(sentinel),
        buffer_(on, std::vector<uint8_t>(n * sizeof(T) + 2 * kGuard + offset, sentinel)) {}
  T* data() { return reinterpret_cast<T*>(buffer_.data() + kGuard + offset_); }
  // The n elements; reports guard bytes that changed.
  std::vector<T> download(const std::string& what) {
    const std::vector<uint8_t> all = buffer_.download();
    const size_t begin = kGuard + offset_, end = begin + n_ * sizeof(T);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < all.size(); ++i)
      if ((i < begin || i >= end) && all[i] != sentinel_ && bad++ == 0) first = i;
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " guard bytes written, first at byte " << first << " of the "
                       << (first < begin ? "leading" : "trailing") << " guard";
    std::vector<T> out(n_);
    if (n_ > 0) std::memcpy(out.data(), all.data() + begin, n_ * sizeof(T));
    return out;
  }

 private:
  size_t n_, offset_;
  uint8_t sentinel_;
  DeviceArray<uint8_t> buffer_;
};

inline void expect_same_amax(float got, float cpu, const std::string& what) {
  // The CPU returns the canonical quiet NaN for a NaN amax; every backend must return the same bits.
  EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(cpu))
      << what << ": amax " << got << " (" << test::hex(std::bit_cast<uint32_t>(got)) << "), cpu " << cpu;
}

enum class Cast { per_tensor, tile_1x128, block_128x128 };

inline const char* cast_name(Cast cast) {
  switch (cast) {
    case Cast::per_tensor:
      return "fp8_cast_transpose";
    case Cast::tile_1x128:
      return "fp8_quantize_1x128";
    case Cast::block_128x128:
      return "fp8_quantize_128x128";
  }
  return "?";
}

struct CastCase {
  Cast cast = Cast::per_tensor;
  int64_t rows = 0, cols = 0;
  DType fp8 = DType::e4m3;
  DType x_dtype = DType::f32;  // bf16: x rounded to bf16 and cast from there
  bool q = true, q_t = true;
  float scale = 1.0f;
  bool power_of_two = false;
  // Offsets of x (in elements), q and q_t (in bytes) from aligned addresses: nonzero forces the scalar paths.
  size_t x_offset = 0, q_offset = 0, q_t_offset = 0;
  uint8_t sentinel = 0xa5;

  std::string name() const {
    std::ostringstream out;
    out << cast_name(cast) << " " << shape_name(rows, cols) << " " << dtype_name(fp8) << (q ? " q" : "")
        << (q_t ? " q_t" : "") << " from " << dtype_name(x_dtype);
    if (cast == Cast::per_tensor)
      out << " scale " << scale << " (" << test::hex(std::bit_cast<uint32_t>(scale)) << ")";
    else
      out << (power_of_two ? " pow2" : " exact");
    if (x_offset || q_offset || q_t_offset)
      out << " offsets " << x_offset << "/" << q_offset << "/" << q_t_offset;
    return out.str();
  }
  int64_t scale_count() const {
    return cast == Cast::tile_1x128 ? rows * blocks(cols) : blocks(rows) * blocks(cols);
  }
  int64_t scale_t_count() const {
    return cast == Cast::tile_1x128 ? cols * blocks(rows) : blocks(rows) * blocks(cols);
  }
};

struct CastResult {
  std::vector<uint8_t> q, q_t;
  std::vector<float> scale_inv, scale_inv_t;
  float amax = 0;
};

inline ops::Fp8CastParams params_of(const CastCase& c) {
  ops::Fp8CastParams p;
  p.rows = c.rows, p.cols = c.cols, p.fp8 = c.fp8, p.scale = c.scale, p.power_of_two_scales = c.power_of_two;
  return p;
}

// The CPU table on plain aligned host arrays: what every backend must give.
inline CastResult run_cpu(const CastCase& c, const std::vector<float>& x) {
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  const bool block = c.cast != Cast::per_tensor;
  CastResult r;
  if (c.q) r.q.assign(n, 0);
  if (c.q_t) r.q_t.assign(n, 0);
  if (block && c.q) r.scale_inv.assign(static_cast<size_t>(c.scale_count()), 0.0f);
  if (block && c.q_t) r.scale_inv_t.assign(static_cast<size_t>(c.scale_t_count()), 0.0f);
  ops::Fp8CastParams p = params_of(c);
  p.x = x.data();
  p.q = c.q ? r.q.data() : nullptr;
  p.q_t = c.q_t ? r.q_t.data() : nullptr;
  p.scale_inv = r.scale_inv.empty() ? nullptr : r.scale_inv.data();
  p.scale_inv_t = r.scale_inv_t.empty() ? nullptr : r.scale_inv_t.data();
  const ops::OpTable& cpu = ops::cpu_table();
  if (c.cast == Cast::per_tensor)
    r.amax = cpu.fp8_cast_transpose(p);
  else if (c.cast == Cast::tile_1x128)
    cpu.fp8_quantize_1x128(p);
  else
    cpu.fp8_quantize_128x128(p);
  return r;
}

// x rounded to bf16 (its bits), and those values back in fp32 (exact).
inline std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = f32_to_bf16_bits(x[i]);
  return bits;
}
inline std::vector<float> widen(const std::vector<uint16_t>& bits) {
  std::vector<float> x(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) x[i] = bf16_bits_to_f32(bits[i]);
  return x;
}

// The cast on `on`, x (float, or bf16 bits as uint16_t) and the outputs at the case's offsets, the outputs
// between guards.
template <typename T>
CastResult run_on(Device on, const CastCase& c, const std::vector<T>& x) {
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  const bool block = c.cast != Cast::per_tensor;
  DeviceArray<T> dx(on, x, c.x_offset);
  GuardedOutput<uint8_t> q(on, c.q ? n : 0, c.sentinel, c.q_offset),
      q_t(on, c.q_t ? n : 0, c.sentinel, c.q_t_offset);
  GuardedOutput<float> scale_inv(on, block && c.q ? static_cast<size_t>(c.scale_count()) : 0, c.sentinel);
  GuardedOutput<float> scale_inv_t(on, block && c.q_t ? static_cast<size_t>(c.scale_t_count()) : 0,
                                   c.sentinel);
  ops::Fp8CastParams p = params_of(c);
  p.x = dx.data();
  p.q = c.q ? q.data() : nullptr;
  p.q_t = c.q_t ? q_t.data() : nullptr;
  p.scale_inv = block && c.q ? scale_inv.data() : nullptr;
  p.scale_inv_t = block && c.q_t ? scale_inv_t.data() : nullptr;
  CastResult r;
  if (c.cast == Cast::per_tensor)
    r.amax = FORGE_TEST_OP(fp8_cast_transpose, on, p);
  else if (c.cast == Cast::tile_1x128)
    FORGE_TEST_OP(fp8_quantize_1x128, on, p);
  else
    FORGE_TEST_OP(fp8_quantize_128x128, on, p);
  const std::string what = c.name();
  if (c.q) r.q = q.download(what + ": q");
  if (c.q_t) r.q_t = q_t.download(what + ": q_t");
  if (block && c.q) r.scale_inv = scale_inv.download(what + ": scale_inv");
  if (block && c.q_t) r.scale_inv_t = scale_inv_t.download(what + ": scale_inv_t");
  return r;
}

inline void expect_same(const CastResult& got, const CastResult& cpu, const CastCase& c,
                        const std::string& what) {
  test::expect_bitwise(got.q, cpu.q, c.cols, what + ": q");
  test::expect_bitwise(got.q_t, cpu.q_t, c.rows, what + ": q_t");
  // Both block layouts have ceil(cols/128) scales per row of scale_inv, ceil(rows/128) per row of
  // scale_inv_t.
  test::expect_bitwise(got.scale_inv, cpu.scale_inv, blocks(c.cols), what + ": scale_inv");
  test::expect_bitwise(got.scale_inv_t, cpu.scale_inv_t, blocks(c.rows), what + ": scale_inv_t");
  if (c.cast == Cast::per_tensor) expect_same_amax(got.amax, cpu.amax, what);
}

// The case on `on` against the CPU table on plain fp32 arrays; with a bf16 x, x is rounded to bf16 first and
// the reference casts the fp32 copy of the rounded values.
inline void check_case(Device on, const CastCase& c, const std::vector<float>& x) {
  SCOPED_TRACE(c.name());
  if (c.x_dtype == DType::bf16) {
    const std::vector<uint16_t> x16 = to_bf16(x);
    expect_same(run_on(on, c, x16), run_cpu(c, widen(x16)), c, c.name());
    return;
  }
  expect_same(run_on(on, c, x), run_cpu(c, x), c, c.name());
}

// The output combinations each cast accepts.
inline const std::vector<std::pair<bool, bool>> kAnyOutputs = {{true, false}, {false, true}, {true, true}};
inline const std::vector<std::pair<bool, bool>> kRowwiseOutputs = {{true, false}, {true, true}};

// A shape: ragged on both axes, with every remainder of rows and cols modulo 4 (multiples of 4 take the CUDA
// vector paths), one element, narrow tensors, whole tiles only.
struct Case {
  int64_t rows, cols;
  std::string name() const { return std::to_string(rows) + "x" + std::to_string(cols); }
};
inline const std::vector<Case> kCases = {{1, 1},    {3, 130}, {129, 257}, {300, 1000},
                                         {67, 387}, {200, 3}, {256, 384}};

class Fp8CastOp : public testing::OpTest<Case> {};

// 1 and 2^-3: exact products, ties included; 0.7: inexact products; 3e5: most products saturate; 2^-12:
// most products are FP8 subnormals or round to zero; 0: inf * 0 is the host's default NaN.
TEST_P(Fp8CastOp, CastTranspose) {
  const Case& s = test_case();
  const std::vector<float> x = make_input(s.rows, s.cols, 21);
  for (DType fp8 : {DType::e4m3, DType::e5m2})
    for (float scale : {1.0f, 0x1p-3f, 0.7f, 3e5f, 0x1p-12f, 0.0f})
      for (auto [q, q_t] : kAnyOutputs) {
        CastCase c;
        c.cast = Cast::per_tensor, c.rows = s.rows, c.cols = s.cols, c.fp8 = fp8, c.q = q, c.q_t = q_t,
        c.scale = scale;
        check_case(device(), c, x);
      }
}

TEST_P(Fp8CastOp, Quantize1x128) {
  const Case& s = test_case();
  const std::vector<float> x = make_input(s.rows, s.cols, 31);
  for (DType fp8 : {DType::e4m3, DType::e5m2})
    for (bool power_of_two : {false, true})
      for (auto [q, q_t] : kAnyOutputs) {
        CastCase c;
        c.cast = Cast::tile_1x128, c.rows = s.rows, c.cols = s.cols, c.fp8 = fp8, c.q = q, c.q_t = q_t;
        c.power_of_two = power_of_two;
        check_case(device(), c, x);
      }
}

TEST_P(Fp8CastOp, Quantize128x128) {
  const Case& s = test_case();
  const std::vector<float> x = make_input(s.rows, s.cols, 41);
  for (DType fp8 : {DType::e4m3, DType::e5m2})
    for (bool power_of_two : {false, true})
      for (auto [q, q_t] : kRowwiseOutputs) {
        CastCase c;
        c.cast = Cast::block_128x128, c.rows = s.rows, c.cols = s.cols, c.fp8 = fp8, c.q = q, c.q_t = q_t;
        c.power_of_two = power_of_two;
        check_case(device(), c, x);
      }
}

// bf16 activations cast as they are (no fp32 copy): every cast and output layout, both FP8 formats, the
// specials (NaN, inf, subnormals round to bf16 subnormals or zero) included.
TEST_P(Fp8CastOp, Bf16Inputs) {
  const Case& s = test_case();
  const std::vector<float> x = make_input(s.rows, s.cols, 81);
  for (Cast cast : {Cast::per_tensor, Cast::tile_1x128, Cast::block_128x128})
    for (DType fp8 : {DType::e4m3, DType::e5m2})
      for (auto [q, q_t] : cast == Cast::block_128x128 ? kRowwiseOutputs : kAnyOutputs) {
        CastCase c;
        c.cast = cast, c.rows = s.rows, c.cols = s.cols, c.fp8 = fp8, c.q = q, c.q_t = q_t, c.scale = 0.7f;
        c.power_of_two = fp8 == DType::e4m3, c.x_dtype = DType::bf16;
        check_case(device(), c, x);
      }
}

class Fp8CastFixed : public testing::OpTest<testing::FixedCase> {};

// The delayed recipe's amax accumulators: the per-tensor cast folds its amax into a float where it runs (max,
// NaN-propagating) without returning it. Three casts into one accumulator, against the fold of the CPU's
// amaxes; both output layouts and the row-wise-only path (a different CUDA kernel) take part.
TEST_P(Fp8CastFixed, CastTransposeFoldsAmaxIntoAnAccumulator) {
  for (int variant = 0; variant < 2; ++variant) {
    float expected = 0.25f;  // a value already there, from an earlier micro-batch
    DeviceArray<float> accumulator(device(), std::vector<float>{expected});
    int call = 0;
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{3, 130}, {129, 257}, {67, 387}}) {
      std::vector<float> x = make_input(rows, cols, 31 + call, false);
      if (variant == 1 && call == 1) x[5] = kNaN;  // a NaN amax sticks
      DeviceArray<float> dx(device(), x);
      DeviceArray<uint8_t> dq(device(), x.size()), dq_t(device(), x.size());
      ops::Fp8CastParams p;
      p.rows = rows, p.cols = cols, p.x = dx.data(), p.fp8 = DType::e4m3, p.scale = 0.5f;
      p.q = dq.data(), p.q_t = call == 2 ? nullptr : dq_t.data();
      p.amax_accumulate = accumulator.data();
      FORGE_TEST_OP(fp8_cast_transpose, device(), p);
      const float amax = ops::cpu_table().amax(x.data(), rows * cols);
      expected = std::isnan(expected) || std::isnan(amax) ? kNaN : std::max(expected, amax);
      ++call;
    }
    const float got = accumulator.download()[0];
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << "variant " << variant << ": " << got;
    } else {
      EXPECT_EQ(got, expected) << "variant " << variant;
    }
  }
}

TEST_P(Fp8CastFixed, CastTransposeWithNaNScale) {
  // A NaN scale makes every product that NaN (quietened, sign kept) on the CPU. Inputs hold no NaN: with two
  // NaN operands the CPU's choice depends on the operand order its compiler picked.
  const std::vector<float> x = make_input(129, 257, 22, true, false);
  for (float scale : {kNaN, std::bit_cast<float>(0xff800123u)})
    for (auto [q, q_t] : kAnyOutputs) {
      CastCase c;
      c.cast = Cast::per_tensor, c.rows = 129, c.cols = 257, c.q = q, c.q_t = q_t, c.scale = scale;
      check_case(device(), c, x);
    }
}

// Shapes that allow float4 loads and word stores, with pointers that do not: the scalar paths on every side.
TEST_P(Fp8CastFixed, UnalignedPointers) {
  const std::vector<float> x = make_input(300, 1000, 51);
  struct Offsets {
    size_t x, q, q_t;
  };
  for (DType x_dtype : {DType::f32, DType::bf16})
    for (Offsets o : {Offsets{1, 0, 0}, Offsets{0, 1, 2}, Offsets{2, 3, 1}})
      for (Cast cast : {Cast::per_tensor, Cast::tile_1x128, Cast::block_128x128})
        for (auto [q, q_t] : cast == Cast::block_128x128 ? kRowwiseOutputs : kAnyOutputs) {
          CastCase c;
          c.cast = cast, c.rows = 300, c.cols = 1000, c.fp8 = DType::e4m3, c.q = q, c.q_t = q_t,
          c.scale = 0x1p-2f, c.x_dtype = x_dtype;
          c.x_offset = o.x, c.q_offset = o.q, c.q_t_offset = o.q_t;
          check_case(device(), c, x);
        }
}

// More tiles than the CUDA tiled kernels' grid (1024 CTAs) and more elements than one round of its flat
// kernels: every kernel loops, carrying its amax across tiles and reusing its shared memory.
TEST_P(Fp8CastFixed, LargeInputs) {
  const int64_t rows = 33 * kTile + 5, cols = 32 * kTile;
  const std::vector<float> x = make_input(rows, cols, 61);
  CastCase c;
  c.rows = rows, c.cols = cols, c.fp8 = DType::e4m3, c.scale = 0x1p-2f;
  c.cast = Cast::per_tensor, c.q = true, c.q_t = false;
  check_case(device(), c, x);
  c.q_t = true;
  check_case(device(), c, x);
  c.cast = Cast::tile_1x128, c.power_of_two = true;
  check_case(device(), c, x);
  c.cast = Cast::block_128x128, c.fp8 = DType::e5m2;
  check_case(device(), c, x);
  c.x_dtype = DType::bf16;
  for (Cast cast : {Cast::per_tensor, Cast::tile_1x128, Cast::block_128x128}) {
    c.cast = cast;
    check_case(device(), c, x);
  }
}

// The same call twice gives the same bits (and fills outputs that started from different sentinels alike,
// so no element is left unwritten by chance of the sentinel matching).
TEST_P(Fp8CastFixed, BitwiseRepeatable) {
  const std::vector<float> x = make_input(300, 1000, 71);
  for (Cast cast : {Cast::per_tensor, Cast::tile_1x128, Cast::block_128x128}) {
    CastCase c;
    c.cast = cast, c.rows = 300, c.cols = 1000, c.fp8 = DType::e5m2, c.scale = 0.3f, c.power_of_two = false;
    c.sentinel = 0x00;
    const CastResult first = run_on(device(), c, x);
    c.sentinel = 0xff;
    const CastResult second = run_on(device(), c, x);
    expect_same(second, first, c, c.name() + " (repeat)");
  }
}

}  // namespace forge::op_tests::fp8_cast
