// The FP8 Linear under the current recipe on the GPU, where its scales never leave device memory (amax_to,
// the cast computing its scale there, cuBLASLt reading scale_inv through its scale pointers), against the
// same Linear on the CPU:
//   - every FP8 code and every operand's amax, scale and scale_inv are exact functions of the inputs:
//   bitwise;
//   - y, dx and dW come from the same codes and scales, so they differ only by the tensor cores' accumulation
//     (partial sums kept to ~2^-13 relative inside cuBLASLt's promotion intervals, then fp32) against the
//     CPU's fp32 sums: per element a few 2^-13 of sum |a b|, i.e. a scale-free dissimilarity of order 1e-6
//     here; bound 1e-4, which any wrong scale (a factor of 2 gives 0.2) or NaN exceeds;
//   - inputs saved in fp32 and cast again in backward give the bits of inputs saved in FP8 on the GPU too
//   (the
//     re-cast reads the forward's amax from device memory).
// Each case runs on a GPU with FP8 tensor cores (skipped without one) and under the device emulation
// (device_backends.h: the CPU kernels, device memory closed to the host).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device_backends.h"
#include "forge/core/device.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/linear.h"
#include "op_harness.h"

namespace forge::nn::fp8_linear_cuda_test {
using namespace forge::train;
namespace {

// Multiples of 16 (FP8 tensor cores), not of 128.
constexpr int64_t kRows = 160, kIn = 208, kOut = 144;

std::vector<float> random_matrix(int64_t n, float std, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, std);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(gen);
  for (int64_t i = 0; i < n; i += 997) v[static_cast<size_t>(i)] *= 40.0f;  // outliers set the scale
  return v;
}

Tensor on(Device device, const std::vector<float>& v, Shape shape) {
  Tensor host = Tensor::empty(std::move(shape), DType::f32);
  std::memcpy(host.f32(), v.data(), v.size() * sizeof(float));
  return host.to(device);
}

template <typename T>
std::vector<T> host_vector(const Tensor& t) {
  const Tensor host = t.to(Device::cpu);
  const T* data = host.data<T>();
  return std::vector<T>(data, data + host.numel());
}

double dissimilarity(const std::vector<float>& x, const std::vector<float>& y) {
  double xy = 0, xx = 0, yy = 0;
  for (size_t i = 0; i < x.size(); ++i)
    xy += double(x[i]) * y[i], xx += double(x[i]) * x[i], yy += double(y[i]) * y[i];
  return xx + yy == 0 ? 0 : 1 - 2 * xy / (xx + yy);
}

struct LinearRun {
  std::vector<uint8_t> x_codes, dy_codes, dy_codes_t, w_codes, w_codes_t;
  std::vector<float> x_scales, dy_scales, w_scales;
  std::vector<float> y, dx, dw;
};

LinearRun run_linear(Device device, const Fp8Options& options) {
  const std::vector<float> w = random_matrix(kOut * kIn, 0.05f, 1), x = random_matrix(kRows * kIn, 1.0f, 2);
  const std::vector<float> dy = random_matrix(kRows * kOut, 1e-4f, 3);
  ParameterStore store;
  store.add("w", {kOut, kIn}, true, Init::normal);
  store.allocate(false, true, device);
  Tensor weight = store.span(store.params(), 0, 1, kIn);
  weight.copy_from(on(Device::cpu, w, {kOut, kIn}));
  store.mark_updated();
  Fp8Context context(options);
  ComputeOptions compute;
  compute.gemm_dtype = DType::f32;
  compute.fp8 = &context;
  compute.device = device;
  Linear linear(&store, {0}, kIn, compute);
  context.seal();

  const Fp8Recording recording(&context, true);
  LinearRun r;
  GemmOperand xo = linear.input(on(device, x, {kRows, kIn}));
  r.x_codes = host_vector<uint8_t>(xo.data);
  r.x_scales = host_vector<float>(xo.scales);
  r.y = host_vector<float>(linear.forward(xo));
  GemmOperand dyo = linear.grad_output(on(device, dy, {kRows, kOut}));
  r.dy_codes = host_vector<uint8_t>(dyo.data), r.dy_codes_t = host_vector<uint8_t>(dyo.data_t);
  r.dy_scales = host_vector<float>(dyo.scales);
  r.dx = host_vector<float>(linear.backward_input(dyo));
  store.zero_grads();
  linear.backward_weight(dyo, xo);
  r.dw = host_vector<float>(store.span(store.grads(), 0, 1, kIn));
  const Fp8Weight& fw = context.weight(0);
  r.w_codes = host_vector<uint8_t>(fw.q), r.w_codes_t = host_vector<uint8_t>(fw.q_t);
  r.w_scales = host_vector<float>(fw.scales);
  return r;
}

template <typename T>
void expect_bitwise(const std::vector<T>& gpu, const std::vector<T>& cpu, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < gpu.size(); ++i)
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size() << " differ, first at " << first
                     << ": gpu " << double(gpu[first]) << ", cpu " << double(cpu[first]);
}

class Fp8LinearCuda : public DeviceBackendTest {
 protected:
  void SetUp() override {
    DeviceBackendTest::SetUp();
    if (!IsSkipped() && !emulated() && cuda::compute_capability() < 89)
      GTEST_SKIP() << "no FP8 tensor cores: " << cuda::describe_device();
  }
};

Fp8Options current(int margin, bool save_fp8_inputs) {
  Fp8Options o;
  o.recipe.recipe = fp8::Recipe::current;
  o.recipe.format = fp8::Format::hybrid;
  o.recipe.margin = margin;
  o.save_fp8_inputs = save_fp8_inputs;
  return o;
}

TEST_P(Fp8LinearCuda, CurrentScalingMatchesCpu) {
  for (int margin : {0, 2}) {
    const std::string what = "margin " + std::to_string(margin);
    const LinearRun gpu = run_linear(Device::cuda, current(margin, true));
    const LinearRun cpu = run_linear(Device::cpu, current(margin, true));
    expect_bitwise(gpu.x_scales, cpu.x_scales, what + ": x amax, scale, scale_inv");
    expect_bitwise(gpu.dy_scales, cpu.dy_scales, what + ": dy amax, scale, scale_inv");
    expect_bitwise(gpu.w_scales, cpu.w_scales, what + ": W amax, scale, scale_inv");
    expect_bitwise(gpu.x_codes, cpu.x_codes, what + ": x codes");
    expect_bitwise(gpu.dy_codes, cpu.dy_codes, what + ": dy codes");
    expect_bitwise(gpu.dy_codes_t, cpu.dy_codes_t, what + ": dy^T codes");
    expect_bitwise(gpu.w_codes, cpu.w_codes, what + ": W codes");
    expect_bitwise(gpu.w_codes_t, cpu.w_codes_t, what + ": W^T codes");
    EXPECT_LT(dissimilarity(gpu.y, cpu.y), 1e-4) << what;
    EXPECT_LT(dissimilarity(gpu.dx, cpu.dx), 1e-4) << what;
    EXPECT_LT(dissimilarity(gpu.dw, cpu.dw), 1e-4) << what;
  }
}

TEST_P(Fp8LinearCuda, InputsRecastInBackwardGiveTheSameBits) {
  const LinearRun saved_fp8 = run_linear(Device::cuda, current(1, true));
  const LinearRun saved_fp32 = run_linear(Device::cuda, current(1, false));
  expect_bitwise(saved_fp32.x_scales, saved_fp8.x_scales, "x scales");
  expect_bitwise(saved_fp32.dw, saved_fp8.dw, "dW");
  expect_bitwise(saved_fp32.y, saved_fp8.y, "y");
}

// A token count FP8 tensor cores do not tile (24 rows) is refused before any kernel runs, naming the Linear
// (its operand check; the support query before each FP8 GEMM backs it up for what only the backend knows).
TEST_P(Fp8LinearCuda, UnsupportedShapeIsRefusedNamingTheLinear) {
  constexpr int64_t rows = 24;
  ParameterStore store;
  store.add("w", {kOut, kIn}, true, Init::normal);
  store.allocate(false, true, Device::cuda);
  store.initialize(1);
  Fp8Context context(current(0, true));
  ComputeOptions compute;
  compute.gemm_dtype = DType::f32;
  compute.fp8 = &context;
  compute.device = Device::cuda;
  Linear linear(&store, {0}, kIn, compute, "layer.w");
  context.seal();
  const Fp8Recording recording(&context, true);
  testing::expect_error_containing(
      [&] {
        GemmOperand xo = linear.input(on(Device::cuda, random_matrix(rows * kIn, 1.0f, 4), {rows, kIn}));
        linear.forward(xo);
        GemmOperand dyo =
            linear.grad_output(on(Device::cuda, random_matrix(rows * kOut, 1e-4f, 5), {rows, kOut}));
        linear.backward_input(dyo);
        linear.backward_weight(dyo, xo);
      },
      {"'layer.w'", "on cuda", "multiples of 16"});
}

FORGE_INSTANTIATE_DEVICE_BACKENDS(Fp8LinearCuda);

}  // namespace
}  // namespace forge::nn::fp8_linear_cuda_test
