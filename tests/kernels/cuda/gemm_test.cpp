// The CUDA GEMMs (kernels/cuda/gemm_cublaslt.cpp, fp8_block_gemm.cu) against the CPU op table on the same
// host data (fp32 and bf16 through the op tests of kernels/op_tests/gemm.h), and the device allocator. Every
// case that needs a GPU skips where none is usable; the parameter checks, which the GEMMs make before
// touching the device, run everywhere.
#include "kernels/op_tests/gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/device_allocator.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "kernels/op_tests/fp8_gemm.h"
#include "op_harness.h"

namespace forge::gemm_test {
namespace {

using cuda::DeviceBuffer;

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer buffer(host.size() * sizeof(T));
  buffer.upload(host.data(), host.size() * sizeof(T));
  return buffer;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& buffer, size_t n) {
  std::vector<T> host(n);
  buffer.download(host.data(), n * sizeof(T));
  return host;
}

// Per element of C: |alpha| sum_l |op(A)[i,l] op(B)[l,j]| + |beta C0[i,j]|, the scale of every rounding error
// an fp32-accumulating GEMM can make (av, bv give the dequantised stored operands).
template <typename AValue, typename BValue>
std::vector<double> magnitudes(int64_t m, int64_t n, int64_t k, bool trans_a, int64_t lda, bool trans_b,
                               int64_t ldb, float alpha, float beta, const std::vector<float>& c0,
                               int64_t ldc, AValue av, BValue bv) {
  std::vector<double> mag(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l)
        s += std::abs(av(trans_a ? l * lda + i : i * lda + l) * bv(trans_b ? j * ldb + l : l * ldb + j));
      mag[i * n + j] =
          std::abs(double{alpha}) * s + (beta != 0 ? std::abs(double{beta} * c0[i * ldc + j]) : 0.0);
    }
  return mag;
}

// got and want are [m, ldc]; the first n columns must agree within tolerance * magnitude, the padding columns
// past n must be what they were (compared bitwise: NaN when beta = 0).
void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::vector<float>& before, const std::vector<double>& mag, int64_t m, int64_t n,
                  int64_t ldc, double tolerance) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j)
      ASSERT_LE(std::abs(double{got[i * ldc + j]} - want[i * ldc + j]), tolerance * mag[i * n + j])
          << "C[" << i << "," << j << "] cuda " << got[i * ldc + j] << " cpu " << want[i * ldc + j];
    if (ldc > n) {
      EXPECT_EQ(std::memcmp(&got[i * ldc + n], &before[i * ldc + n], (ldc - n) * sizeof(float)), 0)
          << "padding of row " << i << " was written";
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// fp32 and bf16: the op tests of kernels/op_tests/gemm.h (odd shapes, padded leading dimensions, pointers off
// by one element, the tensor-core shapes of a training step, plan reuse; fp32 and bf16 output, with gemm.h's
// bounds) on the GPU, and what only the GPU refuses.

}  // namespace
}  // namespace forge::gemm_test

namespace forge::op_tests::gemm {
FORGE_INSTANTIATE_OP_TEST(GemmOp, kCases, testing::Backend::gpu);
}  // namespace forge::op_tests::gemm

namespace forge::op_tests::fp8_gemm {
FORGE_INSTANTIATE_OP_TEST(Fp8GemmOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(Fp8GemmFixed, testing::kFixedCase, testing::Backend::gpu);
// The FP8 tests skip on a GPU without FP8 tensor cores.
const bool kFp8GemmQuery = (
    gpu_runs_fp8_gemms = [] { return cuda::compute_capability() >= 89; }, true);
}  // namespace forge::op_tests::fp8_gemm

namespace forge::gemm_test {
namespace {

// cuBLASLt is loaded on the first GEMM, not linked (gemm_cublaslt.cpp): every function the GEMMs call must be
// found in the library of the toolkit forge was built with. Runs without a GPU (CI has the toolkit).
TEST(CudaCublasLt, LoadsWithEveryFunctionTheGemmsCall) {
  std::string why;
  EXPECT_TRUE(cuda::cublaslt_loadable(&why)) << why;
  EXPECT_TRUE(why.empty()) << why;
}

TEST(CudaGemmErrors, HostPointersAreRefusedAndTheDeviceStaysUsable) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const op_tests::gemm::Case c{16, 16, 16, op_tests::gemm::kNT, DType::f32, DType::f32, 0, 0};
  const op_tests::gemm::Problem pr(c, 51);
  std::vector<float> host_c(pr.c0.size());
  DeviceBuffer a = to_device(pr.a_bytes), b = to_device(pr.b_bytes);
  ops::GemmParams p = pr.p;
  p.a = a.data(), p.b = b.data(), p.c = host_c.data();
  testing::expect_error_containing([&] { ops::gemm(p, Device::cuda); }, {"gemm", "not device memory"});
  op_tests::gemm::expect_matches_cpu(Device::cuda, c, pr);  // nothing was launched, so the context is fine
}

// Parameter checks come before any device call: these run without a GPU too.
TEST(CudaGemmErrors, BadParametersFailWithOneLine) {
  alignas(256) static float dummy[64];
  ops::GemmParams p;
  p.m = p.n = p.k = 4, p.lda = p.ldb = p.ldc = 4;
  p.a = p.b = dummy, p.c = dummy;
  ops::GemmParams bad = p;
  bad.ab_dtype = DType::f16;
  testing::expect_error_containing([&] { cuda::gemm(bad); },
                                   {"gemm", "fp32 or bf16", dtype_name(DType::f16)});
  bad = p, bad.k = 0;
  testing::expect_error_containing([&] { cuda::gemm(bad); }, {"empty problem"});
  bad = p, bad.ldc = 3;
  testing::expect_error_containing([&] { cuda::gemm(bad); }, {"ldc 3"});
  bad = p, bad.trans_a = true, bad.m = 8;
  testing::expect_error_containing([&] { cuda::gemm(bad); }, {"lda 4", "8 stored columns"});
}

// Output checks come before any device call: these run without a GPU too.
TEST(CudaGemmErrors, OutputDtypeAndAlignmentFailWithOneLine) {
  alignas(256) static uint16_t dummy[64];
  ops::GemmParams p;
  p.m = p.n = p.k = 4, p.lda = p.ldb = p.ldc = 4;
  p.a = p.b = dummy, p.c = dummy;
  p.ab_dtype = DType::bf16, p.c_dtype = DType::bf16;
  ops::GemmParams bad = p;
  bad.c_dtype = DType::f16;
  testing::expect_error_containing([&] { cuda::gemm(bad); }, {"gemm", "c_dtype", "fp32 or bf16", "fp16"});
  bad = p, bad.ab_dtype = DType::f32;
  testing::expect_error_containing([&] { cuda::gemm(bad); },
                                   {"gemm", "c_dtype bf16 needs bf16 operands", "fp32"});
  bad = p, bad.c = reinterpret_cast<char*>(dummy) + 1;
  testing::expect_error_containing([&] { cuda::gemm(bad); },
                                   {"gemm", "not aligned to its 2-byte bf16 elements"});
}

// ------------------------------------------------------------------------------------------------------------
// FP8, per-tensor scaling

float decode(uint8_t code, DType dtype) {
  return dtype == DType::e4m3 ? e4m3_to_f32(code) : e5m2_to_f32(code);
}
uint8_t encode(float x, DType dtype) { return dtype == DType::e4m3 ? f32_to_e4m3(x) : f32_to_e5m2(x); }

// Small integers (exact in both formats): every partial sum of their products is an integer far below 2^11,
// exact in any accumulator the tensor cores keep, so the GPU and the CPU emulation may differ only in how the
// scales, alpha and beta are applied (a few fp32 roundings).
std::vector<uint8_t> integer_codes(size_t n, DType dtype, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> value(-4, 4);
  std::vector<uint8_t> codes(n);
  for (auto& c : codes) c = encode(static_cast<float>(value(gen)), dtype);
  return codes;
}

// Normal values over several binades, as the FP8 recipes produce.
std::vector<uint8_t> spread_codes(size_t n, DType dtype, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> binade(-3, 3);
  const float max = dtype == DType::e4m3 ? kE4m3Max : kE5m2Max;
  std::vector<uint8_t> codes(n);
  for (auto& c : codes) c = encode(std::ldexp(normal(gen), binade(gen)) * max / 16, dtype);
  return codes;
}

struct Fp8Problem {
  ops::Fp8GemmParams p;  // host pointers
  std::vector<uint8_t> a, b;
  std::vector<float> c0;
};

// K-major operands (NT: A stored [m,k], B stored [n,k]) with padded leading dimensions (multiples of 16).
Fp8Problem make_fp8(int64_t m, int64_t n, int64_t k, DType a_dtype, DType b_dtype, float alpha, float beta,
                    int64_t pad, bool integers, uint32_t seed) {
  Fp8Problem f;
  ops::Fp8GemmParams& p = f.p;
  p.m = m, p.n = n, p.k = k;
  p.trans_a = false, p.trans_b = true;
  p.a_dtype = a_dtype, p.b_dtype = b_dtype;
  p.lda = k + pad, p.ldb = k + 2 * pad, p.ldc = n + (pad > 0 ? 4 : 0);
  p.alpha = alpha, p.beta = beta;
  p.a_scale_inv = 0.0123f, p.b_scale_inv = 3.71f;  // not powers of two: applying them rounds
  f.a = integers ? integer_codes(m * p.lda, a_dtype, seed) : spread_codes(m * p.lda, a_dtype, seed);
  f.b = integers ? integer_codes(n * p.ldb, b_dtype, seed + 1) : spread_codes(n * p.ldb, b_dtype, seed + 1);
  f.c0 = testing::random_floats(m * p.ldc, seed + 2);
  p.a = f.a.data(), p.b = f.b.data();
  return f;
}

std::vector<double> fp8_magnitudes(const Fp8Problem& f) {
  const ops::Fp8GemmParams& p = f.p;
  return magnitudes(
      p.m, p.n, p.k, p.trans_a, p.lda, p.trans_b, p.ldb, p.alpha, p.beta, f.c0, p.ldc,
      [&](int64_t i) { return double{decode(f.a[i], p.a_dtype)} * p.a_scale_inv; },
      [&](int64_t i) { return double{decode(f.b[i], p.b_dtype)} * p.b_scale_inv; });
}

// Runs on CUDA (C starts as NaN when beta = 0: it must not be read); returns C [m, ldc] and what C held
// before.
std::vector<float> run_fp8_cuda(const Fp8Problem& f, std::vector<float>* before_out = nullptr) {
  std::vector<float> before = f.c0;
  if (f.p.beta == 0) std::fill(before.begin(), before.end(), std::numeric_limits<float>::quiet_NaN());
  DeviceBuffer a = to_device(f.a), b = to_device(f.b), c = to_device(before);
  ops::Fp8GemmParams p = f.p;
  p.a = a.as<uint8_t>(), p.b = b.as<uint8_t>(), p.c = c.as<float>();
  ops::fp8_gemm(p, Device::cuda);
  if (before_out) *before_out = before;
  return to_host<float>(c, before.size());
}

std::vector<float> run_fp8_cpu(const Fp8Problem& f) {
  std::vector<float> c = f.c0;
  ops::Fp8GemmParams p = f.p;
  p.c = c.data();
  ops::cpu_table().fp8_gemm(p);
  return c;
}

TEST(CudaFp8GemmData, OddMAndNWhereCublasLtAllowsThem) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  if (cuda::compute_capability() < 89) GTEST_SKIP() << "no FP8 tensor cores: " << cuda::describe_device();
  const Fp8Problem f = make_fp8(37, 29, 64, DType::e4m3, DType::e4m3, 1, 0, 0, true, 81);
  std::vector<float> before, got;
  try {
    got = run_fp8_cuda(f, &before);
  } catch (const Error& e) {
    // Not every cuBLASLt version runs FP8 with m, n off multiples of 16; it must then say so in one line.
    const std::string message = e.what();
    ASSERT_TRUE(message.find("no algorithm") != std::string::npos ||
                message.find("NOT_SUPPORTED") != std::string::npos)
        << message;
    GTEST_SKIP() << "cuBLASLt refuses this shape: " << message;
  }
  expect_close(got, run_fp8_cpu(f), before, fp8_magnitudes(f), f.p.m, f.p.n, f.p.ldc, std::ldexp(16.0, -24));
}

// The FP8 Linear's three GEMMs with the K-major copies CUDA needs, against the CPU emulation in the
// orientations the CPU takes directly (ops.h): same results.
TEST(CudaFp8GemmData, LinearGemmsThroughTransposedCopies) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  if (cuda::compute_capability() < 89) GTEST_SKIP() << "no FP8 tensor cores: " << cuda::describe_device();
  const int64_t tokens = 64, in = 96, out = 128;
  const auto x = integer_codes(tokens * in, DType::e4m3, 91);    // [tokens, in]
  const auto w = integer_codes(out * in, DType::e4m3, 92);       // [out, in]
  const auto dy = integer_codes(tokens * out, DType::e5m2, 93);  // [tokens, out]
  auto transpose = [](const std::vector<uint8_t>& src, int64_t rows, int64_t cols) {
    std::vector<uint8_t> t(src.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = src[r * cols + c];
    return t;
  };
  const auto w_t = transpose(w, out, in), dy_t = transpose(dy, tokens, out), x_t = transpose(x, tokens, in);

  struct Gemm {
    const char* name;
    ops::Fp8GemmParams cpu, cuda;
    const std::vector<uint8_t>*cuda_a, *cuda_b;
  };
  auto params = [](int64_t m, int64_t n, int64_t k, const std::vector<uint8_t>& a, DType ad, bool ta,
                   int64_t lda, const std::vector<uint8_t>& b, DType bd, bool tb, int64_t ldb, float beta) {
    ops::Fp8GemmParams p;
    p.m = m, p.n = n, p.k = k;
    p.a = a.data(), p.a_dtype = ad, p.trans_a = ta, p.lda = lda;
    p.b = b.data(), p.b_dtype = bd, p.trans_b = tb, p.ldb = ldb;
    p.ldc = n, p.beta = beta;
    p.a_scale_inv = 0.02f, p.b_scale_inv = 1.7f;
    return p;
  };
  const Gemm gemms[] = {
      {"forward y = x W^T", params(tokens, out, in, x, DType::e4m3, false, in, w, DType::e4m3, true, in, 0),
       params(tokens, out, in, x, DType::e4m3, false, in, w, DType::e4m3, true, in, 0), &x, &w},
      {"backward_input dx = dy W",
       params(tokens, in, out, dy, DType::e5m2, false, out, w, DType::e4m3, false, in, 0),
       params(tokens, in, out, dy, DType::e5m2, false, out, w_t, DType::e4m3, true, out, 0), &dy, &w_t},
      {"backward_weight dW += dy^T x",
       params(out, in, tokens, dy, DType::e5m2, true, out, x, DType::e4m3, false, in, 1),
       params(out, in, tokens, dy_t, DType::e5m2, false, tokens, x_t, DType::e4m3, true, tokens, 1), &dy_t,
       &x_t},
  };
  for (const Gemm& g : gemms) {
    SCOPED_TRACE(g.name);
    const auto c0 = testing::random_floats(g.cpu.m * g.cpu.ldc, 94);
    std::vector<float> want = c0;
    ops::Fp8GemmParams cpu = g.cpu;
    cpu.c = want.data();
    ops::cpu_table().fp8_gemm(cpu);
    DeviceBuffer a = to_device(*g.cuda_a), b = to_device(*g.cuda_b), c = to_device(c0);
    ops::Fp8GemmParams dev = g.cuda;
    dev.a = a.as<uint8_t>(), dev.b = b.as<uint8_t>(), dev.c = c.as<float>();
    ops::fp8_gemm(dev, Device::cuda);
    const auto got = to_host<float>(c, c0.size());
    const double scale = double{cpu.a_scale_inv} * cpu.b_scale_inv;
    for (size_t i = 0; i < got.size(); ++i) {
      // Exact integer sums: only the scaling and the beta addition round.
      const double tolerance =
          std::ldexp(16.0, -24) * (std::abs(want[i]) + std::abs(double{c0[i]}) + scale * 64);
      ASSERT_NEAR(got[i], want[i], tolerance) << i;
    }
  }
}

// Parameter checks come before any device call: these run without a GPU too.
TEST(CudaFp8GemmErrors, UnsupportedRequestsFailWithOneLine) {
  alignas(256) static uint8_t codes[64 * 64];
  alignas(256) static float c[64 * 64];
  ops::Fp8GemmParams p;
  p.m = p.n = p.k = 32, p.lda = p.ldb = p.ldc = 32;
  p.a = p.b = codes, p.c = c;
  p.trans_b = true;
  ops::Fp8GemmParams bad = p;
  bad.trans_b = false;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"NN orientation", "K-major", "W^T stored [in,out]"});
  bad = p, bad.trans_a = true;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"TT orientation", "A stored [k,m]"});
  bad = p, bad.trans_a = true, bad.trans_b = false;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"TN orientation", "dy^T [out,tokens]"});
  bad = p, bad.scaling = ops::Fp8Scaling::block;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"block scaling", "a_scales and b_scales must be set"});
  bad = p, bad.accumulator_bits = 14;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"accumulator_bits = 14", "not implemented"});
  bad = p, bad.a_dtype = bad.b_dtype = DType::e5m2;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"e5m2 x e5m2"});
  bad = p, bad.a_dtype = DType::bf16;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"e4m3 or e5m2", "bf16"});
  bad = p, bad.lda = 40;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"lda 40", "multiples of 16"});
  bad = p, bad.b = codes + 8;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"16-byte aligned"});
  bad = p, bad.a_scale_inv = std::numeric_limits<float>::infinity();
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"scale_inv must be finite"});
  bad = p, bad.c_dtype = DType::f16;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"fp8_gemm", "c_dtype", "fp32 or bf16", "fp16"});
  bad = p, bad.c_dtype = DType::bf16, bad.ldc = 36;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"fp8_gemm", "bf16 C", "ldc 36", "multiple of 8"});
  bad = p, bad.c_dtype = DType::bf16, bad.c = reinterpret_cast<char*>(c) + 8;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"bf16 C", "16-byte aligned", "alignment 8"});
}

// ------------------------------------------------------------------------------------------------------------
// Device allocator

TEST(CudaDeviceAllocator, ReusesFreedBlocksAndKeepsStats) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const auto start = cuda::allocator_stats();
  void* a = cuda::device_alloc(3 << 20);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  FORGE_CUDA_CHECK(cudaMemsetAsync(a, 0, 3 << 20, cuda::stream()));  // usable memory
  auto s = cuda::allocator_stats();
  EXPECT_EQ(s.allocated_bytes - start.allocated_bytes, 4 << 20);  // rounded to 2 MiB steps
  cuda::device_free(a);
  void* b = cuda::device_alloc((3 << 20) + 100);  // same rounded size: the cached block
  EXPECT_EQ(b, a);
  EXPECT_EQ(cuda::allocator_stats().cache_hits, s.cache_hits + 1);
  cuda::device_free(b);
  cuda::synchronize();
  cuda::empty_cache();
  s = cuda::allocator_stats();
  EXPECT_EQ(s.reserved_bytes, s.allocated_bytes);  // nothing cached
  testing::expect_error_containing([&] { cuda::device_free(b); }, {"not allocated by this device allocator"});
}

TEST(CudaDeviceAllocator, OutOfMemoryIsOneLineAndTheDeviceStaysUsable) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  testing::expect_error_containing([] { cuda::device_alloc(size_t{1} << 40); },
                                   {"out of device memory allocating 1024.00 GiB", "allocated", "reserved"});
  void* p = cuda::device_alloc(1 << 20);
  FORGE_CUDA_CHECK(cudaMemsetAsync(p, 0, 1 << 20, cuda::stream()));
  cuda::synchronize();
  cuda::device_free(p);
}

TEST(CudaDeviceAllocator, WithoutAGpuAllocationFailsCleanly) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is usable: " << cuda::describe_device();
  testing::expect_error_containing([] { cuda::device_alloc(1024); }, {"no usable GPU"});
}

}  // namespace
}  // namespace forge::gemm_test
