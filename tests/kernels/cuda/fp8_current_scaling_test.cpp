// Current scaling on the GPU: the op tests of kernels/op_tests/fp8_current_scaling.h (amax_to, the cast with
// a scale from an amax in device memory, the FP8 GEMM reading scale_inv through pointers; against the CPU,
// bitwise) on the GPU, and what only the CUDA backend has: its parameter checks, which fail before any CUDA
// call (these run without a GPU too), host scale pointers refused, and a stream capture of the whole chain
// showing that nothing in it waits for the device.
#include "kernels/op_tests/fp8_current_scaling.h"

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
#include "op_harness.h"

namespace forge::op_tests::fp8_current_scaling {
FORGE_INSTANTIATE_OP_TEST(Fp8CurrentScalingOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(Fp8CurrentScalingFixed, testing::kFixedCase, testing::Backend::gpu);
// The GEMM tests skip on a GPU without FP8 tensor cores.
const bool kFp8GemmQuery = (
    gpu_runs_fp8_gemms = [] { return cuda::compute_capability() >= 89; }, true);
}  // namespace forge::op_tests::fp8_current_scaling

namespace forge::fp8_current_scaling_test {

namespace {

using cuda::DeviceBuffer;
using test::expect_bitwise;
using test::hex;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

bool has_gpu() { return cuda::available(); }
bool has_fp8_gpu() { return has_gpu() && cuda::compute_capability() >= 89; }

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
}  // namespace forge::fp8_current_scaling_test
