// Current scaling on the GPU without a host round trip, against the CPU table, bitwise: amax_to writes max
// |x| into device memory; the per-tensor cast computes its scale there from that amax
// (Fp8CastParams::amax_in, fp8::compute_scale's arithmetic) and writes scale and scale_inv; the cuBLASLt FP8
// GEMM reads scale_inv through its scale pointers (Fp8GemmParams::a_scale_inv_ptr / b_scale_inv_ptr). Codes,
// amaxes and scales are exact functions of their inputs, so everything but the GEMM is compared bit for bit;
// the GEMM with device scale pointers must give the bits of the same GEMM with the host values (same plan,
// same scales). A stream capture of the whole chain shows that nothing in it waits for the device.
//
// GPU cases skip without a usable device; the parameter checks, which fail before any CUDA call, run
// everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/fp8/recipe.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "kernels/cuda/bitwise_compare.h"

namespace forge {
namespace {

using cuda::DeviceBuffer;
using test::expect_bitwise;
using test::hex;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr uint8_t kSentinel = 0xa5;

bool has_gpu() { return cuda::available(); }
bool has_fp8_gpu() { return has_gpu() && cuda::compute_capability() >= 89; }

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

// Copies on cuda::stream(), in order with the kernels there (a plain cudaMemcpy runs on the legacy stream,
// which a non-blocking stream does not wait for), finished when they return.
void upload(void* device, const void* host, size_t bytes) {
  if (bytes == 0) return;
  FORGE_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, cuda::stream()));
  cuda::synchronize();
}

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host, size_t offset = 0) {
  DeviceBuffer buffer((host.size() + offset) * sizeof(T) + 1);
  upload(buffer.as<T>() + offset, host.data(), host.size() * sizeof(T));
  return buffer;
}

template <typename T>
std::vector<T> to_host(const T* device, size_t n) {
  std::vector<T> host(n);
  if (n > 0) {
    FORGE_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost, cuda::stream()));
    cuda::synchronize();
  }
  return host;
}

// A device buffer of n bytes at `offset` from an aligned address, with 64 sentinel bytes on each side that
// the kernels must leave alone.
class Guarded {
 public:
  explicit Guarded(size_t n, size_t offset = 0) : n_(n), offset_(offset), buffer_(n + 128 + offset) {
    const std::vector<uint8_t> fill(buffer_.bytes(), kSentinel);
    buffer_.upload(fill.data(), fill.size());
  }
  uint8_t* bytes() const { return buffer_.as<uint8_t>() + 64 + offset_; }
  float* floats() const { return reinterpret_cast<float*>(bytes()); }
  std::vector<uint8_t> download(const std::string& what) const {
    std::vector<uint8_t> all(buffer_.bytes());
    buffer_.download(all.data(), all.size());
    const size_t begin = 64 + offset_, end = begin + n_;
    size_t bad = 0;
    for (size_t i = 0; i < all.size(); ++i)
      if ((i < begin || i >= end) && all[i] != kSentinel) ++bad;
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " guard bytes written";
    return std::vector<uint8_t>(all.begin() + static_cast<std::ptrdiff_t>(begin),
                                all.begin() + static_cast<std::ptrdiff_t>(end));
  }
  std::vector<float> download_floats(const std::string& what) const {
    const std::vector<uint8_t> raw = download(what);
    std::vector<float> out(n_ / sizeof(float));
    if (!out.empty()) std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
    return out;
  }

 private:
  size_t n_, offset_;
  DeviceBuffer buffer_;
};

void expect_error(const std::function<void()>& call, const std::string& op, const std::string& culprit) {
  try {
    call();
    ADD_FAILURE() << op << ": expected an error naming '" << culprit << "'";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(op), std::string::npos) << message;
    EXPECT_NE(message.find(culprit), std::string::npos) << message;
    EXPECT_EQ(message.find("CUDA error"), std::string::npos) << "checked too late: " << message;
  }
}

// x [rows, cols]: +-(1 + m/64) * 2^e over e in [-12, 12] (many products land on FP8 rounding ties), a -0, and
// with `nan` a negative NaN with a payload.
std::vector<float> make_input(int64_t rows, int64_t cols, uint64_t seed, bool nan = false) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& v : x) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    const auto r = static_cast<uint32_t>(state >> 16);
    const int exponent = static_cast<int>(r % 25) - 12;
    v = std::bit_cast<float>(((r >> 20) & 1u) << 31 | uint32_t(127 + exponent) << 23 | ((r >> 8) % 64) << 17);
  }
  if (!x.empty()) x[x.size() / 3] = -0.0f;
  if (nan && !x.empty()) x[x.size() / 2] = std::bit_cast<float>(0xffc00001u);
  return x;
}

// ---------------------------------------------------------------------------------------------------------------
// Parameter checks (no GPU needed)

TEST(CudaFp8CurrentScaling, BadArgumentsFailBeforeTheDevice) {
  float x[4] = {}, out = 0;
  expect_error([&] { cuda::amax_to(x, -1, &out); }, "amax_to", "negative size -1");
  expect_error([&] { cuda::amax_to(x, 4, nullptr); }, "amax_to", "out is null");
  expect_error([&] { cuda::amax_to(nullptr, 4, &out); }, "amax_to", "x is null");
  uint8_t q[4] = {};
  ops::Fp8CastParams p;
  p.rows = 2, p.cols = 2, p.x = x, p.q = q, p.amax_in = &out, p.margin = -2;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, "fp8_cast_transpose", "negative margin -2");
  p.margin = 0, p.fp8 = DType::bf16;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, "fp8_cast_transpose", "bf16 is not an FP8 dtype");
}

// A scale_inv behind a pointer is not the host value: a non-finite host value beside it is not refused.
TEST(CudaFp8CurrentScaling, GemmHostValueIsNotCheckedWhenAPointerReplacesIt) {
  alignas(256) static uint8_t codes[32 * 32];
  alignas(256) static float c[32 * 32];
  alignas(16) static float scale_inv = 1.0f;
  ops::Fp8GemmParams p;
  p.m = p.n = p.k = 32, p.lda = p.ldb = p.ldc = 32, p.trans_b = true;
  p.a = p.b = codes, p.c = c;
  p.a_scale_inv = kInf, p.a_scale_inv_ptr = &scale_inv;
  p.b_scale_inv = kNaN, p.b_scale_inv_ptr = &scale_inv;
  // Host arrays: the call fails later, at the device (no GPU, no FP8, or the pointers' memory), never on the
  // values the pointers replace.
  try {
    cuda::fp8_gemm(p);
    ADD_FAILURE() << "fp8_gemm accepted host pointers";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("must be finite"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// amax_to

TEST(CudaFp8CurrentScaling, AmaxToMatchesCpuBitwise) {
  if (!has_gpu()) GTEST_SKIP() << cuda::describe_device();
  // 300001 and 2^22 + 3 elements take the flat kernel through several CTAs and a scalar tail.
  for (int64_t n :
       {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{1000}, int64_t{300001}, (int64_t{1} << 22) + 3}) {
    const std::vector<float> original = make_input(1, n, 7);
    for (int variant = 0; variant < 6; ++variant) {
      if (n == 0 && variant > 0) break;
      std::vector<float> x = original;
      if (variant == 1) x[n / 2] = -kInf;
      if (variant == 2) x[n - 1] = std::bit_cast<float>(0xffc00001u);  // NaN in the tail, negative, payload
      if (variant == 3) x[0] = std::bit_cast<float>(0x7f800001u);      // signalling NaN
      if (variant == 4) std::fill(x.begin(), x.end(), 0.0f);
      if (variant == 5) x[n / 3] = -3e38f;
      const size_t offset = variant % 2;  // x not 16-byte aligned: the scalar path
      const DeviceBuffer dx = to_device(x, offset);
      Guarded out(sizeof(float));  // starts as sentinel bytes: the op must write it
      cuda::amax_to(dx.as<float>() + offset, n, out.floats());
      const std::string what = "amax_to n=" + std::to_string(n) + " variant " + std::to_string(variant);
      float want = 0;
      ops::cpu_table().amax_to(x.data(), n, &want);
      expect_bitwise(out.download_floats(what), std::vector<float>{want}, what);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The cast with a device-side scale

struct Case {
  int64_t rows = 0, cols = 0;
  DType fp8 = DType::e4m3;
  bool q = true, q_t = true;
  int margin = 0;
  // The amax: x's own (amax_to on each side), or this value placed in memory.
  bool own_amax = true;
  float amax = 0;
  size_t x_offset = 0, q_offset = 0, q_t_offset = 0;
  bool accumulate = false;  // also fold x's amax into an accumulator holding 0.25

  std::string name() const {
    std::ostringstream out;
    out << "[" << rows << ", " << cols << "] " << dtype_name(fp8) << (q ? " q" : "") << (q_t ? " q_t" : "")
        << " margin " << margin;
    if (own_amax)
      out << " own amax";
    else
      out << " amax " << amax << " (" << hex(bits(amax)) << ")";
    if (x_offset || q_offset || q_t_offset)
      out << " offsets " << x_offset << "/" << q_offset << "/" << q_t_offset;
    if (accumulate) out << " accumulate";
    return out.str();
  }
};

struct Result {
  std::vector<uint8_t> q, q_t;
  std::vector<float> scales;  // amax, scale, scale_inv
  float accumulator = 0;
};

Result run_cpu(const Case& c, const std::vector<float>& x) {
  Result r;
  r.scales.assign(3, 0.0f);
  const ops::OpTable& cpu = ops::cpu_table();
  if (c.own_amax)
    cpu.amax_to(x.data(), c.rows * c.cols, &r.scales[0]);
  else
    r.scales[0] = c.amax;
  if (c.q) r.q.assign(x.size(), 0);
  if (c.q_t) r.q_t.assign(x.size(), 0);
  r.accumulator = 0.25f;
  ops::Fp8CastParams p;
  p.rows = c.rows, p.cols = c.cols, p.x = x.data(), p.fp8 = c.fp8;
  p.q = c.q ? r.q.data() : nullptr, p.q_t = c.q_t ? r.q_t.data() : nullptr;
  p.amax_in = &r.scales[0], p.margin = c.margin, p.scale_out = &r.scales[1], p.scale_inv_out = &r.scales[2];
  if (c.accumulate) p.amax_accumulate = &r.accumulator;
  cpu.fp8_cast_transpose(p);
  return r;
}

Result run_cuda(const Case& c, const std::vector<float>& x) {
  const size_t n = x.size();
  const DeviceBuffer dx = to_device(x, c.x_offset);
  Guarded q(c.q ? n : 0, c.q_offset), q_t(c.q_t ? n : 0, c.q_t_offset), scales(3 * sizeof(float));
  Guarded accumulator(sizeof(float));
  const float start = 0.25f;
  upload(accumulator.floats(), &start, sizeof start);
  float* amax = scales.floats();
  if (c.own_amax)
    cuda::amax_to(dx.as<float>() + c.x_offset, c.rows * c.cols, amax);
  else
    upload(amax, &c.amax, sizeof(float));
  ops::Fp8CastParams p;
  p.rows = c.rows, p.cols = c.cols, p.x = dx.as<float>() + c.x_offset, p.fp8 = c.fp8;
  p.q = c.q ? q.bytes() : nullptr, p.q_t = c.q_t ? q_t.bytes() : nullptr;
  p.scale = 77.0f;  // ignored under amax_in
  p.amax_in = amax, p.margin = c.margin, p.scale_out = amax + 1, p.scale_inv_out = amax + 2;
  if (c.accumulate) p.amax_accumulate = accumulator.floats();
  cuda::fp8_cast_transpose(p);
  cuda::synchronize();
  const std::string what = c.name();
  Result r;
  if (c.q) r.q = q.download(what + ": q");
  if (c.q_t) r.q_t = q_t.download(what + ": q_t");
  r.scales = scales.download_floats(what + ": scales");
  r.accumulator = accumulator.download_floats(what + ": accumulator")[0];
  return r;
}

void check_case(const Case& c, const std::vector<float>& x) {
  SCOPED_TRACE(c.name());
  const Result cuda = run_cuda(c, x), cpu = run_cpu(c, x);
  const std::string what = c.name();
  expect_bitwise(cuda.q, cpu.q, what + ": q");
  expect_bitwise(cuda.q_t, cpu.q_t, what + ": q_t");
  expect_bitwise(cuda.scales, cpu.scales, what + ": amax, scale, scale_inv");
  if (c.accumulate)
    expect_bitwise(std::vector<float>{cuda.accumulator}, {cpu.accumulator}, what + ": accumulator");
}

const std::vector<std::pair<bool, bool>> kOutputs = {{true, false}, {false, true}, {true, true}};

TEST(CudaFp8CurrentScaling, CastWithItsOwnAmaxMatchesCpu) {
  if (!has_gpu()) GTEST_SKIP() << cuda::describe_device();
  // Ragged shapes (partial tiles, sizes that rule out vector loads), one element, narrow tensors.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},    {3, 130}, {129, 257}, {300, 1000},
                                                           {67, 387}, {200, 3}, {256, 384}};
  for (auto [rows, cols] : shapes) {
    const std::vector<float> x = make_input(rows, cols, static_cast<uint64_t>(rows * 7 + cols));
    for (DType fp8 : {DType::e4m3, DType::e5m2})
      for (int margin : {0, 3})
        for (auto [q, q_t] : kOutputs) {
          Case c;
          c.rows = rows, c.cols = cols, c.fp8 = fp8, c.q = q, c.q_t = q_t, c.margin = margin;
          check_case(c, x);
        }
  }
  // A NaN in x: amax NaN, scale 1 (and NaN codes where the NaN sits).
  const std::vector<float> x = make_input(129, 257, 5, /*nan=*/true);
  for (auto [q, q_t] : kOutputs) {
    Case c;
    c.rows = 129, c.cols = 257, c.q = q, c.q_t = q_t;
    check_case(c, x);
  }
}

// compute_scale's special cases, from an amax placed in device memory: 0, inf, NaN (of either sign) and a
// negative value keep scale 1; a subnormal amax overflows the quotient to FLT_MAX; a margin of 156 makes
// fp8_max / 2^margin a rounded fp32 subnormal.
TEST(CudaFp8CurrentScaling, CastWithSpecialAmaxesMatchesCpu) {
  if (!has_gpu()) GTEST_SKIP() << cuda::describe_device();
  const std::vector<float> x = make_input(129, 257, 9);
  const float amaxes[] = {0.0f,
                          kInf,
                          kNaN,
                          std::bit_cast<float>(0xffc00001u),
                          -2.0f,
                          -0.0f,
                          std::numeric_limits<float>::denorm_min(),
                          0.37f,
                          3e38f};
  for (float amax : amaxes)
    for (DType fp8 : {DType::e4m3, DType::e5m2})
      for (int margin : {0, 156})
        for (auto [q, q_t] : kOutputs) {
          Case c;
          c.rows = 129, c.cols = 257, c.fp8 = fp8, c.q = q, c.q_t = q_t, c.margin = margin;
          c.own_amax = false, c.amax = amax;
          check_case(c, x);
        }
}

// Shapes that allow float4 loads and word stores, pointers that do not; more tiles than the tiled kernel's
// grid (1024 CTAs) and more elements than one round of the flat kernel, so every CTA of a looping grid
// computes the scale for itself; the delayed recipe's accumulator alongside the device scale.
TEST(CudaFp8CurrentScaling, CastPathsAndLargeInputsMatchCpu) {
  if (!has_gpu()) GTEST_SKIP() << cuda::describe_device();
  {
    const std::vector<float> x = make_input(300, 1000, 13);
    for (auto [xo, qo, qto] : {std::tuple<size_t, size_t, size_t>{1, 0, 0}, {0, 1, 2}, {2, 3, 1}})
      for (auto [q, q_t] : kOutputs) {
        Case c;
        c.rows = 300, c.cols = 1000, c.q = q, c.q_t = q_t, c.margin = 1;
        c.x_offset = xo, c.q_offset = qo, c.q_t_offset = qto;
        check_case(c, x);
      }
    for (auto [q, q_t] : kOutputs) {
      Case c;
      c.rows = 300, c.cols = 1000, c.fp8 = DType::e5m2, c.q = q, c.q_t = q_t, c.accumulate = true;
      check_case(c, x);
    }
  }
  const int64_t rows = 33 * 128 + 5, cols = 32 * 128;
  const std::vector<float> x = make_input(rows, cols, 17);
  for (auto [q, q_t] : {std::pair{true, false}, std::pair{true, true}}) {
    Case c;
    c.rows = rows, c.cols = cols, c.q = q, c.q_t = q_t, c.margin = 2;
    check_case(c, x);
  }
}

// An empty tensor still writes the scale (1 launch, no element); a host scale is handed out too.
TEST(CudaFp8CurrentScaling, ScaleOutputsForEmptyInputsAndHostScales) {
  if (!has_gpu()) GTEST_SKIP() << cuda::describe_device();
  Guarded scales(3 * sizeof(float));
  const float amax = 2.0f;
  upload(scales.floats(), &amax, sizeof amax);
  ops::Fp8CastParams p;
  p.rows = 0, p.cols = 64, p.fp8 = DType::e4m3;
  Guarded q(1);
  p.q = q.bytes();
  p.amax_in = scales.floats(), p.scale_out = scales.floats() + 1, p.scale_inv_out = scales.floats() + 2;
  cuda::fp8_cast_transpose(p);
  std::vector<float> got = scales.download_floats("empty: scales");
  expect_bitwise(got, std::vector<float>{2.0f, 224.0f, 1.0f / 224.0f}, "empty input");
  EXPECT_EQ(q.download("empty: q")[0], kSentinel);

  // Host scale (the delayed recipe's) with scale outputs: the returned amax is still the CPU's.
  const std::vector<float> x = make_input(48, 80, 19);
  const DeviceBuffer dx = to_device(x);
  Guarded codes(x.size()), outputs(2 * sizeof(float));
  ops::Fp8CastParams h;
  h.rows = 48, h.cols = 80, h.x = dx.as<float>(), h.fp8 = DType::e5m2, h.scale = 0.7f, h.q = codes.bytes();
  h.scale_out = outputs.floats(), h.scale_inv_out = outputs.floats() + 1;
  const float returned = cuda::fp8_cast_transpose(h);
  EXPECT_EQ(bits(returned), bits(ops::cpu_table().amax(x.data(), 48 * 80)));
  expect_bitwise(outputs.download_floats("host scale: outputs"), std::vector<float>{0.7f, 1.0f / 0.7f},
                 "host scale outputs");
  std::vector<uint8_t> want(x.size());
  ops::Fp8CastParams hc = h;
  hc.x = x.data(), hc.q = want.data(), hc.scale_out = hc.scale_inv_out = nullptr;
  ops::cpu_table().fp8_cast_transpose(hc);
  expect_bitwise(codes.download("host scale: q"), want, "host scale: q");
}

// ---------------------------------------------------------------------------------------------------------------
// The GEMM with device scale pointers

struct Gemm {
  int64_t m = 64, n = 96, k = 160;
  DeviceBuffer a, b, c;
  std::vector<uint8_t> ha, hb;

  Gemm() {
    ha.resize(m * k), hb.resize(n * k);
    uint64_t state = 99;
    auto next = [&] {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      return static_cast<uint32_t>(state >> 16);
    };
    // Values over several binades: the products' rounding inside the tensor cores is whatever it is, the same
    // for both runs; what is compared is two runs of one plan.
    for (auto& v : ha)
      v = f32_to_e4m3(std::ldexp(static_cast<float>(next() % 15) - 7.0f, int(next() % 7) - 3));
    for (auto& v : hb)
      v = f32_to_e5m2(std::ldexp(static_cast<float>(next() % 15) - 7.0f, int(next() % 7) - 3));
    a = to_device(ha), b = to_device(hb), c = DeviceBuffer(m * n * sizeof(float));
  }
  ops::Fp8GemmParams params() const {
    ops::Fp8GemmParams p;
    p.m = m, p.n = n, p.k = k;
    p.a = a.as<uint8_t>(), p.lda = k, p.a_dtype = DType::e4m3;
    p.b = b.as<uint8_t>(), p.ldb = k, p.trans_b = true, p.b_dtype = DType::e5m2;
    p.c = c.as<float>(), p.ldc = n;
    return p;
  }
  std::vector<float> run(const ops::Fp8GemmParams& p) {
    c.zero();
    cuda::fp8_gemm(p);
    return to_host(c.as<float>(), static_cast<size_t>(m * n));
  }
};

TEST(CudaFp8CurrentScaling, GemmScalePointersGiveTheHostValuesBits) {
  if (!has_fp8_gpu()) GTEST_SKIP() << "no FP8 tensor cores: " << cuda::describe_device();
  Gemm g;
  const float a_inv = 0.0123f, b_inv = 3.71f;  // not powers of two: applying them rounds
  DeviceBuffer scales(4 * sizeof(float));
  const float values[4] = {a_inv, b_inv, 0.5f, 2.0f};
  scales.upload(values, sizeof values);
  ops::Fp8GemmParams host = g.params();
  host.a_scale_inv = a_inv, host.b_scale_inv = b_inv;
  const std::vector<float> want = g.run(host);
  ops::Fp8GemmParams other = g.params();
  other.a_scale_inv = 0.5f, other.b_scale_inv = 2.0f;
  const std::vector<float> want_other = g.run(other);
  for (auto [ap, bp] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
    ops::Fp8GemmParams p = host;
    // A pointer replaces its value, which is set wrong (and not finite) on purpose.
    if (ap) p.a_scale_inv_ptr = scales.as<float>(), p.a_scale_inv = kInf;
    if (bp) p.b_scale_inv_ptr = scales.as<float>() + 1, p.b_scale_inv = kNaN;
    const std::string what = std::string("pointers ") + (ap ? "a" : "") + (bp ? "b" : "");
    expect_bitwise(g.run(p), want, what);
    // The cached descriptor goes back to the host values' scratch afterwards.
    expect_bitwise(g.run(other), want_other, what + ", then host values");
  }
  // Pointers that change from call to call (a new operand's scales each time) are followed.
  ops::Fp8GemmParams moved = host;
  moved.a_scale_inv_ptr = scales.as<float>() + 2, moved.b_scale_inv_ptr = scales.as<float>() + 3;
  expect_bitwise(g.run(moved), want_other, "pointers to other floats");
}

TEST(CudaFp8CurrentScaling, GemmRefusesHostScalePointers) {
  if (!has_fp8_gpu()) GTEST_SKIP() << "no FP8 tensor cores: " << cuda::describe_device();
  Gemm g;
  static float host_scale = 1.0f;
  ops::Fp8GemmParams p = g.params();
  p.b_scale_inv_ptr = &host_scale;
  try {
    cuda::fp8_gemm(p);
    ADD_FAILURE() << "fp8_gemm accepted a host scale pointer";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("b_scale_inv_ptr"), std::string::npos) << message;
    EXPECT_NE(message.find("not device memory"), std::string::npos) << message;
  }
  // The device is still usable.
  p.b_scale_inv_ptr = nullptr;
  EXPECT_NO_THROW(g.run(p));
}

// ---------------------------------------------------------------------------------------------------------------
// The whole chain in stream order

// amax_to, the cast with the device scale and the GEMM reading scale_inv, for both operands, captured into a
// CUDA graph: a call that waited for the device (a copy to the host, a stream synchronisation) would
// invalidate the capture. The graph's results must be the uncaptured chain's.
TEST(CudaFp8CurrentScaling, ChainRunsWithoutWaitingForTheDevice) {
  if (!has_fp8_gpu()) GTEST_SKIP() << "no FP8 tensor cores: " << cuda::describe_device();
  const int64_t m = 64, n = 96, k = 160;
  const std::vector<float> hx = make_input(m, k, 23), hw = make_input(n, k, 29);
  const DeviceBuffer x = to_device(hx), w = to_device(hw);
  DeviceBuffer xq(m * k), wq(n * k), scales(6 * sizeof(float)), c(m * n * sizeof(float));
  auto chain = [&] {
    float* s = scales.as<float>();
    cuda::amax_to(x.as<float>(), m * k, s);
    cuda::amax_to(w.as<float>(), n * k, s + 3);
    ops::Fp8CastParams p;
    p.rows = m, p.cols = k, p.x = x.as<float>(), p.q = xq.as<uint8_t>();
    p.amax_in = s, p.scale_out = s + 1, p.scale_inv_out = s + 2, p.margin = 1;
    cuda::fp8_cast_transpose(p);
    p.rows = n, p.x = w.as<float>(), p.q = wq.as<uint8_t>(), p.fp8 = DType::e5m2;
    p.amax_in = s + 3, p.scale_out = s + 4, p.scale_inv_out = s + 5;
    cuda::fp8_cast_transpose(p);
    ops::Fp8GemmParams g;
    g.m = m, g.n = n, g.k = k;
    g.a = xq.as<uint8_t>(), g.lda = k, g.b = wq.as<uint8_t>(), g.ldb = k, g.trans_b = true;
    g.b_dtype = DType::e5m2, g.c = c.as<float>(), g.ldc = n;
    g.a_scale_inv_ptr = s + 2, g.b_scale_inv_ptr = s + 5;
    cuda::fp8_gemm(g);
  };
  chain();  // plans, workspace and kernels loaded outside the capture
  cuda::synchronize();
  const std::vector<float> want_c = to_host(c.as<float>(), static_cast<size_t>(m * n));
  const std::vector<float> want_scales = to_host(scales.as<float>(), 6);
  c.zero(), scales.zero();

  cudaStream_t stream = cuda::stream();
  FORGE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  std::string error;
  try {
    chain();
  } catch (const Error& e) {
    error = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  (void)cudaGetLastError();  // an invalidated capture leaves its error behind
  ASSERT_TRUE(error.empty())
      << "a call in the chain failed under stream capture (did it wait for the device?): " << error;
  ASSERT_EQ(end, cudaSuccess) << "the capture was invalidated: " << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  FORGE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  FORGE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  cuda::synchronize();
  FORGE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FORGE_CUDA_CHECK(cudaGraphDestroy(graph));
  expect_bitwise(to_host(scales.as<float>(), 6), want_scales, "graph: scales");
  expect_bitwise(to_host(c.as<float>(), static_cast<size_t>(m * n)), want_c, "graph: c");
  // And the scales are the CPU's.
  std::vector<float> cpu(6);
  ops::cpu_table().amax_to(hx.data(), m * k, &cpu[0]);
  ops::cpu_table().amax_to(hw.data(), n * k, &cpu[3]);
  cpu[1] = fp8::compute_scale(cpu[0], kE4m3Max, 1, 1.0f), cpu[2] = 1.0f / cpu[1];
  cpu[4] = fp8::compute_scale(cpu[3], kE5m2Max, 1, 1.0f), cpu[5] = 1.0f / cpu[4];
  expect_bitwise(want_scales, cpu, "scales against the CPU");
}

}  // namespace
}  // namespace forge
