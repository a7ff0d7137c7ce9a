// The CUDA backend's FP8 casts: the op tests of kernels/op_tests/fp8_cast.h (every code, scale_inv and
// returned amax bitwise the CPU's, on ragged shapes, special values, unaligned pointers, inputs larger than
// one grid) on the GPU, and its parameter checks, which fail before any CUDA call (these run without a GPU
// too). Each names the op and the culprit.
#include "kernels/op_tests/fp8_cast.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::fp8_cast {
FORGE_INSTANTIATE_OP_TEST(Fp8CastOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(Fp8CastFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace forge::op_tests::fp8_cast

namespace forge::fp8_cast_test {

namespace {

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

// Host arrays standing in for device pointers: the checks must fail before anything is dereferenced.
struct FakePointers {
  float x[4] = {};
  uint8_t q[4] = {}, q_t[4] = {};
  float scale_inv[4] = {}, scale_inv_t[4] = {};
  ops::Fp8CastParams params() {
    ops::Fp8CastParams p;
    p.rows = 2, p.cols = 2, p.x = x, p.q = q, p.q_t = q_t, p.scale_inv = scale_inv,
    p.scale_inv_t = scale_inv_t;
    return p;
  }
};

TEST(CudaFp8Cast, AmaxRejectsBadArguments) {
  float x[4] = {};
  expect_error([&] { cuda::amax(x, -1); }, "amax", "negative size -1");
  expect_error([&] { cuda::amax(nullptr, 4); }, "amax", "x is null");
  EXPECT_EQ(cuda::amax(nullptr, 0), 0.0f);  // nothing to read: no CUDA call either
}

TEST(CudaFp8Cast, CastTransposeRejectsBadArguments) {
  FakePointers f;
  const char* op = "fp8_cast_transpose";
  auto p = f.params();
  p.q = nullptr, p.q_t = nullptr;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, op, "neither q nor q_t");
  p = f.params(), p.fp8 = DType::bf16;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, op, "bf16 is not an FP8 dtype");
  p = f.params(), p.rows = -3;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, op, "negative shape [-3, 2]");
  p = f.params(), p.cols = -1;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, op, "negative shape [2, -1]");
  p = f.params(), p.x = nullptr;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, op, "x is null");
  p = f.params(), p.rows = int64_t{1} << 40, p.cols = int64_t{1} << 40;
  expect_error([&] { cuda::fp8_cast_transpose(p); }, op, "too large");
  // An empty tensor needs no device: amax 0, nothing written.
  p = f.params(), p.rows = 0;
  EXPECT_EQ(cuda::fp8_cast_transpose(p), 0.0f);
}

TEST(CudaFp8Cast, Quantize1x128RejectsBadArguments) {
  FakePointers f;
  const char* op = "fp8_quantize_1x128";
  auto p = f.params();
  p.q = nullptr, p.q_t = nullptr;
  expect_error([&] { cuda::fp8_quantize_1x128(p); }, op, "neither q nor q_t");
  p = f.params(), p.scale_inv = nullptr;
  expect_error([&] { cuda::fp8_quantize_1x128(p); }, op, "q is given without scale_inv");
  p = f.params(), p.scale_inv_t = nullptr;
  expect_error([&] { cuda::fp8_quantize_1x128(p); }, op, "q_t is given without scale_inv_t");
  p = f.params(), p.fp8 = DType::f32;
  expect_error([&] { cuda::fp8_quantize_1x128(p); }, op, "fp32 is not an FP8 dtype");
  p = f.params(), p.cols = -5;
  expect_error([&] { cuda::fp8_quantize_1x128(p); }, op, "negative shape [2, -5]");
  p = f.params(), p.x = nullptr;
  expect_error([&] { cuda::fp8_quantize_1x128(p); }, op, "x is null");
  p = f.params(), p.cols = 0;
  EXPECT_NO_THROW(cuda::fp8_quantize_1x128(p));
}

TEST(CudaFp8Cast, Quantize128x128RejectsBadArguments) {
  FakePointers f;
  const char* op = "fp8_quantize_128x128";
  auto p = f.params();
  p.q = nullptr;
  expect_error([&] { cuda::fp8_quantize_128x128(p); }, op, "q (the row-wise output) is null");
  p = f.params(), p.scale_inv = nullptr;
  expect_error([&] { cuda::fp8_quantize_128x128(p); }, op, "scale_inv is null");
  p = f.params(), p.scale_inv_t = nullptr;
  expect_error([&] { cuda::fp8_quantize_128x128(p); }, op, "q_t is given without scale_inv_t");
  p = f.params(), p.fp8 = DType::u8;
  expect_error([&] { cuda::fp8_quantize_128x128(p); }, op, "uint8 is not an FP8 dtype");
  p = f.params(), p.rows = -1;
  expect_error([&] { cuda::fp8_quantize_128x128(p); }, op, "negative shape [-1, 2]");
  p = f.params(), p.rows = 0, p.cols = 0;
  EXPECT_NO_THROW(cuda::fp8_quantize_128x128(p));
}

}  // namespace
}  // namespace forge::fp8_cast_test
