// The block-scaled FP8 GEMM on CUDA (kernels/cuda/fp8_block_gemm.cu): what only the CUDA backend checks, host
// pointers refused (the device stays usable) and its parameter checks, which run before anything touches the
// device (these run without a GPU too). Its comparisons with the CPU (integer and spread codes, 1x128 tiles
// and 128x128 blocks, the FP8 Linear's shapes, bf16 output, repeatability) are op tests of
// kernels/op_tests/fp8_gemm.h, instantiated for the GPU in gemm_test.cpp. The tolerance of the comparison
// below: integer-valued codes make every partial sum exact in any accumulator, so two fp32 sums of the same k
// terms in different orders differ by at most 2 (k + 16) 2^-24 S, S = |alpha| sum_kb |a_scale b_scale| sum_{l
// in kb} |a_il b_jl| + |beta C|.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::fp8_block_gemm_test {
namespace {

using cuda::DeviceBuffer;
using ops::Fp8BlockScales;

constexpr int64_t kBlock = ops::kFp8BlockSize;
constexpr uint8_t kNanCode = 0x7f;  // NaN in both E4M3 and E5M2: fills the padding no kernel may read

bool have_fp8_gpu() { return cuda::available() && cuda::compute_capability() >= 89; }
#define SKIP_WITHOUT_FP8_GPU() \
  if (!have_fp8_gpu()) GTEST_SKIP() << "needs a GPU with FP8 tensor cores: " << cuda::describe_device()

float decode(uint8_t code, DType dtype) {
  return dtype == DType::e4m3 ? e4m3_to_f32(code) : e5m2_to_f32(code);
}
uint8_t encode(float x, DType dtype) { return dtype == DType::e4m3 ? f32_to_e4m3(x) : f32_to_e5m2(x); }

enum class Data { integers, spread };

// Integers in [-4, 4] (exact in both formats; block sums stay below 2^11) or normal values over six binades
// scaled toward the format's range, as the FP8 recipes produce.
uint8_t random_code(std::mt19937& gen, DType dtype, Data data) {
  if (data == Data::integers)
    return encode(static_cast<float>(std::uniform_int_distribution<int>(-4, 4)(gen)), dtype);
  std::normal_distribution<float> normal;
  const int binade = std::uniform_int_distribution<int>(-3, 3)(gen);
  const float max = dtype == DType::e4m3 ? kE4m3Max : kE5m2Max;
  return encode(std::ldexp(normal(gen), binade) * max / 16, dtype);
}

// Scales over about 24 binades, not powers of two (applying them rounds).
float random_scale(std::mt19937& gen) {
  const int exponent = std::uniform_int_distribution<int>(-12, 12)(gen);
  return std::ldexp(1.0f + std::uniform_real_distribution<float>(0.0f, 0.9f)(gen), exponent);
}

struct Case {
  int64_t m, n, k;
  DType a_dtype, b_dtype;
  Fp8BlockScales b_block;
  float alpha, beta;
  int64_t pad;       // extra bytes in lda and ldb (a multiple of 16), extra floats in ldc
  int64_t c_offset;  // floats between C's allocation and C (1: only 4-byte aligned)
};

struct Problem {
  ops::Fp8GemmParams p;  // host pointers into the vectors below
  std::vector<uint8_t> a, b;
  std::vector<float> a_scales, b_scales, c0;
};

int64_t round_up_16(int64_t x) { return (x + 15) / 16 * 16; }

Problem make_problem(const Case& c, Data data, uint32_t seed) {
  Problem f;
  ops::Fp8GemmParams& p = f.p;
  p.m = c.m, p.n = c.n, p.k = c.k;
  p.trans_a = false, p.trans_b = true;
  p.a_dtype = c.a_dtype, p.b_dtype = c.b_dtype;
  p.lda = round_up_16(c.k) + c.pad, p.ldb = round_up_16(c.k) + 2 * c.pad, p.ldc = c.n + c.pad;
  p.alpha = c.alpha, p.beta = c.beta;
  p.scaling = ops::Fp8Scaling::block;
  p.b_block = c.b_block;
  std::mt19937 gen(seed);
  auto fill = [&](std::vector<uint8_t>& codes, int64_t rows, int64_t ld, DType dtype) {
    codes.assign(static_cast<size_t>(rows * ld), kNanCode);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t l = 0; l < c.k; ++l) codes[r * ld + l] = random_code(gen, dtype, data);
  };
  fill(f.a, c.m, p.lda, c.a_dtype);
  fill(f.b, c.n, p.ldb, c.b_dtype);
  const int64_t k_blocks = (c.k + kBlock - 1) / kBlock, n_blocks = (c.n + kBlock - 1) / kBlock;
  f.a_scales.resize(c.m * k_blocks);
  f.b_scales.resize((c.b_block == Fp8BlockScales::tile_1x128 ? c.n : n_blocks) * k_blocks);
  for (float& s : f.a_scales) s = random_scale(gen);
  for (float& s : f.b_scales) s = random_scale(gen);
  f.c0 = testing::random_floats(c.m * p.ldc, seed + 1);
  p.a = f.a.data(), p.b = f.b.data();
  p.a_scales = f.a_scales.data(), p.b_scales = f.b_scales.data();
  return f;
}

// S per element of C [m, n] (see the header), in double.
std::vector<double> magnitudes(const Problem& f) {
  const ops::Fp8GemmParams& p = f.p;
  const int64_t k_blocks = (p.k + kBlock - 1) / kBlock;
  std::vector<double> a(p.m * p.k), b(p.n * p.k);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t l = 0; l < p.k; ++l) a[i * p.k + l] = std::abs(decode(f.a[i * p.lda + l], p.a_dtype));
  for (int64_t j = 0; j < p.n; ++j)
    for (int64_t l = 0; l < p.k; ++l) b[j * p.k + l] = std::abs(decode(f.b[j * p.ldb + l], p.b_dtype));
  std::vector<double> mag(p.m * p.n);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      double s = 0;
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const double b_scale = p.b_block == Fp8BlockScales::tile_1x128
                                   ? f.b_scales[j * k_blocks + kb]
                                   : f.b_scales[j / kBlock * k_blocks + kb];
        double block = 0;
        for (int64_t l = kb * kBlock; l < std::min(p.k, (kb + 1) * kBlock); ++l)
          block += a[i * p.k + l] * b[j * p.k + l];
        s += std::abs(f.a_scales[i * k_blocks + kb] * b_scale) * block;
      }
      mag[i * p.n + j] = std::abs(double{p.alpha}) * s + std::abs(double{p.beta} * f.c0[i * p.ldc + j]);
    }
  return mag;
}

std::vector<float> run_cpu(const Problem& f) {
  std::vector<float> c = f.c0;
  ops::Fp8GemmParams p = f.p;
  p.c = c.data();
  ops::cpu_table().fp8_gemm(p);
  return c;
}

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host, size_t offset_elements = 0) {
  std::vector<T> shifted(offset_elements + host.size());
  std::copy(host.begin(), host.end(), shifted.begin() + static_cast<std::ptrdiff_t>(offset_elements));
  DeviceBuffer buffer(shifted.size() * sizeof(T));
  buffer.upload(shifted.data(), shifted.size() * sizeof(T));
  return buffer;
}

// Runs through the op table's dispatch (ops::fp8_gemm -> cuda::fp8_gemm -> fp8_block_gemm). Operands sit 16
// bytes into their allocations (aligned, but not as cudaMalloc aligns), C c_offset floats in; C starts as NaN
// when beta = 0 (it must not be read). Returns C [m, ldc]; `before` gets what C held.
std::vector<float> run_cuda(const Problem& f, int64_t c_offset, std::vector<float>* before_out = nullptr) {
  std::vector<float> before = f.c0;
  if (f.p.beta == 0) std::fill(before.begin(), before.end(), std::numeric_limits<float>::quiet_NaN());
  const DeviceBuffer a = to_device(f.a, 16), b = to_device(f.b, 16);
  const DeviceBuffer a_scales = to_device(f.a_scales, 1), b_scales = to_device(f.b_scales, 3);
  const DeviceBuffer c = to_device(before, static_cast<size_t>(c_offset));
  ops::Fp8GemmParams p = f.p;
  p.a = a.as<uint8_t>() + 16, p.b = b.as<uint8_t>() + 16;
  p.a_scales = a_scales.as<float>() + 1, p.b_scales = b_scales.as<float>() + 3;
  p.c = c.as<float>() + c_offset;
  ops::fp8_gemm(p, Device::cuda);
  std::vector<float> all(c_offset + before.size());
  c.download(all.data(), all.size() * sizeof(float));
  if (before_out) *before_out = before;
  return {all.begin() + c_offset, all.end()};
}

// Every element of C within tolerance(S) of the CPU's (the first offender named), the padding columns past n
// untouched (bitwise: they may be NaN). Returns the largest |gpu - cpu| / S.
template <typename Tolerance>
double expect_close(const Problem& f, const std::vector<float>& got, const std::vector<float>& want,
                    const std::vector<float>& before, const std::vector<double>& mag, Tolerance tolerance) {
  const ops::Fp8GemmParams& p = f.p;
  double worst = 0;
  int64_t bad = -1;
  for (int64_t i = 0; i < p.m && bad < 0; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      const double s = mag[i * p.n + j], d = std::abs(double{got[i * p.ldc + j]} - want[i * p.ldc + j]);
      if (!(d <= tolerance(s))) {  // NaN fails too
        bad = i * p.ldc + j;
        ADD_FAILURE() << "C[" << i << "," << j << "] cuda " << got[bad] << " cpu " << want[bad] << " |diff| "
                      << d << " > tolerance " << tolerance(s) << " (S = " << s << ")";
        break;
      }
      if (s > 0) worst = std::max(worst, d / s);
    }
  for (int64_t i = 0; i < p.m && p.ldc > p.n; ++i)
    if (std::memcmp(&got[i * p.ldc + p.n], &before[i * p.ldc + p.n], (p.ldc - p.n) * sizeof(float)) != 0) {
      ADD_FAILURE() << "padding of C's row " << i << " was written";
      break;
    }
  return worst;
}

double fp32_order_bound(int64_t k, double s) { return 2.0 * (k + 16) * std::ldexp(s, -24); }

TEST(CudaFp8BlockGemmErrors, HostPointersAreRefusedAndTheDeviceStaysUsable) {
  SKIP_WITHOUT_FP8_GPU();
  const Case c{40, 24, 64, DType::e4m3, DType::e4m3, Fp8BlockScales::tile_1x128, 1, 0, 0, 0};
  const Problem f = make_problem(c, Data::integers, 31);
  std::vector<float> host_c = f.c0;
  ops::Fp8GemmParams p = f.p;  // every pointer a host pointer
  p.c = host_c.data();
  testing::expect_error_containing([&] { ops::fp8_gemm(p, Device::cuda); },
                                   {"fp8_gemm (block scaling)", "not device memory"});
  std::vector<float> before;
  const auto got = run_cuda(f, 0, &before);  // nothing was launched: the context is fine
  expect_close(f, got, run_cpu(f), before, magnitudes(f), [&](double s) { return fp32_order_bound(c.k, s); });
}

// ------------------------------------------------------------------------------------------------------------
// Parameter checks: they come before any device call, so these run without a GPU too.

ops::Fp8GemmParams valid_host_params() {
  alignas(256) static uint8_t codes[64 * 64];
  alignas(256) static float scales[64], c[64 * 64];
  ops::Fp8GemmParams p;
  p.m = p.n = p.k = 32, p.lda = p.ldb = p.ldc = 32;
  p.a = p.b = codes, p.c = c;
  p.trans_b = true;
  p.scaling = ops::Fp8Scaling::block;
  p.a_scales = p.b_scales = scales;
  return p;
}

TEST(CudaFp8BlockGemmErrors, LayoutsOtherThanKMajorFailWithOneLine) {
  const ops::Fp8GemmParams p = valid_host_params();
  ops::Fp8GemmParams bad = p;
  bad.trans_b = false;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); },
                                   {"fp8_gemm (block scaling)", "NN orientation", "must be K-major"});
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"block scaling", "NN orientation", "K-major"});
  bad = p, bad.trans_a = true;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"TT orientation", "A stored [k,m]"});
  bad = p, bad.trans_a = true, bad.trans_b = false;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"TN orientation", "must be K-major"});
}

TEST(CudaFp8BlockGemmErrors, BadParametersFailWithOneLine) {
  const ops::Fp8GemmParams p = valid_host_params();
  ops::Fp8GemmParams bad = p;
  bad.a_dtype = bad.b_dtype = DType::e5m2;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"block scaling", "e5m2 x e5m2"});
  bad = p, bad.b_dtype = DType::bf16;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"e4m3 or e5m2", "bf16"});
  bad = p, bad.a_scales = nullptr;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); }, {"a_scales and b_scales", "null and set"});
  bad = p, bad.b_scales = nullptr;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"set and null"});
  bad = p, bad.c = nullptr;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"null operand pointer"});
  bad = p, bad.k = 0;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"empty problem"});
  bad = p, bad.ldb = 16;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"ldb 16", "32 stored columns"});
  bad = p, bad.ldc = 31;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"ldc 31"});
  bad = p, bad.lda = 40;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"lda 40", "multiples of 16"});
  bad = p, bad.b = p.b + 8;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"16-byte aligned", "b % 16 = 8"});
  bad = p, bad.c = reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(p.c) + 2);
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"c must be aligned", "4-byte fp32"});
  bad = p, bad.c_dtype = DType::bf16, bad.c = static_cast<char*>(p.c) + 1;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"c must be aligned", "2-byte bf16"});
  bad = p, bad.c_dtype = DType::f16;
  testing::expect_error_containing([&] { cuda::fp8_gemm(bad); },
                                   {"fp8_gemm (block scaling)", "c_dtype", "fp32 or bf16", "fp16"});
  bad = p, bad.scaling = ops::Fp8Scaling::per_tensor;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"per-tensor scaling"});
  bad = p, bad.accumulator_bits = 14;
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(bad); }, {"accumulator_bits = 14"});
}

TEST(CudaFp8BlockGemmErrors, ValidParametersWithoutAGpuFailWithOneLine) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is usable: " << cuda::describe_device();
  const ops::Fp8GemmParams p = valid_host_params();
  testing::expect_error_containing([&] { cuda::fp8_block_gemm(p); }, {"fp8_gemm (block scaling)"});
}

}  // namespace
}  // namespace forge::fp8_block_gemm_test
