// The CUDA backend's attention (kernels/cuda/attention.cu): the attention op tests (op_tests/attention.h:
// forward, backward and the key/value-cache forward against the CPU within bounds derived there, determinism,
// causal masking, stale cache positions) on the GPU, skipped where none is usable; and the CUDA backend's
// parameter checks, which need no GPU.
#include "kernels/op_tests/attention.h"

#include <gtest/gtest.h>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::attention {
FORGE_INSTANTIATE_OP_TEST(AttentionOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(AttentionCacheOp, kCacheCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(AttentionFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace forge::op_tests::attention

namespace forge::attention_test {

namespace {

using op_tests::attention::Problem;

// Parameter errors are raised on the host before any CUDA call: these run without a GPU.
TEST(CudaAttentionErrors, RejectsBadParametersBeforeTouchingTheDevice) {
  Problem pr({1, 4, 2, 1, 16, true}, 1);
  const auto good = pr.host_params();  // host pointers: never dereferenced, every call below fails first
  const ops::OpTable& cuda = ops::cuda_table();
  auto p = good;
  p.kv_heads = 3;  // 2 heads do not split into 3 kv heads
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"heads 2", "kv_heads 3"});
  p = good;
  p.q_stride = 8;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"q_stride 8"});
  p = good;
  p.kv_seq = 4, p.q_offset = 1;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"positions 1..4", "kv_seq is 4"});
  p = good;
  p.head_dim = 300, p.q_stride = p.out_stride = 600, p.k_stride = p.v_stride = 300;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"head_dim 300", "CUDA"});
  p = good;
  p.k = nullptr;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"q, k, v and out"});
  p = good;
  p.kv_seq = 6;
  testing::expect_error_containing([&] { cuda.attention_backward(p); }, {"only square attention"});
  p = good;
  p.dk = nullptr;
  testing::expect_error_containing([&] { cuda.attention_backward(p); }, {"dout, dq, dk and dv"});
  p = good;
  p.lse = nullptr;
  testing::expect_error_containing([&] { cuda.attention_backward(p); }, {"lse must be set"});
}

}  // namespace
}  // namespace forge::attention_test
