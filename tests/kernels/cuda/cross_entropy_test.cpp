// The CUDA output projection fused with chunked softmax cross-entropy (kernels/cuda/cross_entropy.cu): the op
// tests of kernels/op_tests/linear_cross_entropy.h on the GPU (against the CPU kernel on the same inputs,
// within bounds from the arithmetic; the out-of-vocabulary targets), and what only the CUDA backend checks:
// host pointers refused, and its parameter checks, which come before any CUDA call (these run without a GPU
// too).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "kernels/op_tests/linear_cross_entropy.h"
#include "op_harness.h"

namespace forge::op_tests::linear_cross_entropy {
FORGE_INSTANTIATE_OP_TEST(LinearCrossEntropyOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(LinearCrossEntropyMisalignedWorkspace, kMisalignedWorkspaceCases,
                          testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(LinearCrossEntropyFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace forge::op_tests::linear_cross_entropy

namespace forge::cross_entropy_test {

namespace {

TEST(CudaLinearCrossEntropyErrors, RejectsHostPointers) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  using op_tests::linear_cross_entropy::make_problem;
  using testing::DeviceArray;
  const op_tests::linear_cross_entropy::Problem pr = make_problem({"host", 8, 16, 40, 16, DType::f32}, 37);
  ops::LinearCrossEntropyParams p = pr.params();
  DeviceArray<float> hidden(Device::cuda, pr.hidden), weight(Device::cuda, pr.weight),
      lse(Device::cuda, size_t(pr.c.rows)), loss(Device::cuda, size_t(pr.c.rows)),
      dhidden(Device::cuda, size_t(pr.c.rows * pr.c.dim)), dweight(Device::cuda, pr.dweight0),
      workspace(Device::cuda, size_t(ops::linear_cross_entropy_workspace_floats(p)));
  p.hidden_gemm = hidden.data(), p.weight_gemm = weight.data(), p.lse = lse.data(), p.loss = loss.data();
  p.dhidden = dhidden.data(), p.dweight = dweight.data(), p.workspace = workspace.data();
  p.targets = pr.targets.data();
  testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_forward(p); },
                                   {"linear_cross_entropy_forward", "targets", "not device memory"});
  testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_backward(p); },
                                   {"linear_cross_entropy_backward", "targets", "not device memory"});
  // An optional output on the host, too.
  DeviceArray<int32_t> targets(Device::cuda, pr.targets);
  std::vector<float> host_max_logit(pr.c.rows);
  p.targets = targets.data(), p.max_logit = host_max_logit.data();
  testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_forward(p); },
                                   {"linear_cross_entropy_forward", "max_logit", "not device memory"});
}

// The checks below fail before any CUDA call: they run on machines without a GPU too. The pointers are host
// addresses that are never dereferenced.
ops::LinearCrossEntropyParams host_params(std::vector<float>& storage, std::vector<int32_t>& targets) {
  ops::LinearCrossEntropyParams p;
  p.rows = 3, p.dim = 4, p.vocab = 10, p.vocab_chunk = 4;
  p.hidden_gemm = storage.data(), p.weight_gemm = storage.data(), p.targets = targets.data();
  p.lse = storage.data(), p.loss = storage.data(), p.dhidden = storage.data(), p.dweight = storage.data();
  p.workspace = storage.data();
  return p;
}

TEST(CudaLinearCrossEntropyErrors, BadParametersFailBeforeTouchingTheDevice) {
  std::vector<float> storage(64);
  std::vector<int32_t> targets(3);
  const ops::OpTable& gpu = ops::cuda_table();
  for (auto run : {gpu.linear_cross_entropy_forward, gpu.linear_cross_entropy_backward}) {
    const std::string op = run == gpu.linear_cross_entropy_forward ? "linear_cross_entropy_forward"
                                                                   : "linear_cross_entropy_backward";
    auto p = host_params(storage, targets);
    p.dim = 0;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "dim=0"});
    p = host_params(storage, targets), p.rows = -1;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "rows=-1"});
    p = host_params(storage, targets), p.vocab_chunk = 0;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "vocab_chunk=0"});
    p = host_params(storage, targets), p.vocab = 0;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "vocab=0"});
    p = host_params(storage, targets), p.gemm_dtype = DType::f16;
    testing::expect_error_containing([&] { run(p); },
                                     {op, "gemm_dtype must be fp32 or bf16", dtype_name(DType::f16)});
    p = host_params(storage, targets), p.workspace = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "workspace is required"});
    p = host_params(storage, targets), p.vocab_start = -3;
    testing::expect_error_containing([&] { run(p); }, {op, "negative vocabulary start -3"});
    p = host_params(storage, targets), p.rows = int64_t{1} << 31;
    testing::expect_error_containing([&] { run(p); }, {op, "rows=2147483648", "grid"});
    p = host_params(storage, targets), p.hidden_gemm = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "hidden_gemm is null"});
    p = host_params(storage, targets), p.weight_gemm = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "weight_gemm is null"});
    p = host_params(storage, targets), p.targets = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "targets is null"});
    p = host_params(storage, targets), p.lse = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "lse is null"});
  }
  auto p = host_params(storage, targets);
  p.loss = nullptr;
  testing::expect_error_containing([&] { gpu.linear_cross_entropy_forward(p); },
                                   {"linear_cross_entropy_forward", "loss is null"});
  p = host_params(storage, targets), p.dhidden = nullptr;
  testing::expect_error_containing([&] { gpu.linear_cross_entropy_backward(p); },
                                   {"linear_cross_entropy_backward", "dhidden is null"});
  // A null dweight is allowed: a frozen head takes no weight gradient (the LLaVA golden test's frozen
  // language model runs that path and checks every other gradient bitwise).
}

// No rows: nothing to do and nothing touched (the CPU kernel's behaviour), without a GPU too. The workspace
// is still required, as on the CPU.
TEST(CudaLinearCrossEntropyErrors, NoRowsIsANoOp) {
  std::vector<float> storage(4);
  ops::LinearCrossEntropyParams p;
  p.rows = 0, p.dim = 8, p.vocab = 10, p.vocab_chunk = 4, p.workspace = storage.data();
  ops::cuda_table().linear_cross_entropy_forward(p);
  ops::cuda_table().linear_cross_entropy_backward(p);
  p.workspace = nullptr;
  testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_forward(p); },
                                   {"linear_cross_entropy_forward", "workspace is required"});
}

}  // namespace
}  // namespace forge::cross_entropy_test
